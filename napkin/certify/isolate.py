"""Checking certificates in processes of their own (what ``napkin check`` does).

:func:`check_paths` checks every certificate in a process of its own, forked
from a server process that imported napkin.certify.checker (jax, sympy, the rules) but
never ran a computation nor any certificate's code: a `from` file changes
nothing outside the one check it belongs to, and forking the server costs
milliseconds where a fresh interpreter costs seconds of imports.  The verdict
comes back as one line of JSON on a pipe (never a pickle: nothing the child
sends can run code here); no verdict in time is a failure.  Those processes
do not re-import the caller's __main__ (as multiprocessing otherwise does):
they run napkin.certify.checker only, so scripts without a main guard, code read from
stdin and notebooks can call check_paths.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json as _json
import multiprocessing as _mp
import os as _os
import signal as _signal
import sys as _sys
import time
import types as _types
from multiprocessing.connection import wait as _wait
from pathlib import Path

# No napkin import at the top: `napkin check` imports this module, starts the
# server (which imports napkin.certify.checker, seconds), and only then imports the rest.
DEFAULT_TIMEOUT_S = 600.0
# everything the judging process runs is imported before any file runs (the server forks
# every process from these modules, loaded once)
_PRELOAD = ["napkin.certify.checker", "napkin.certify.isolate", "napkin.core.serial",
            "napkin.frontend.grad"]
_VERDICT_LIMIT = 1 << 16   # bytes
_BUILT_LIMIT = 1 << 26     # bytes of a diagram (and its reference's runs) handed back
_GRACE_S = 5.0             # for a process to end after handing back its verdict


def _certificate_files(path: Path):
    if path.is_dir():
        return sorted(p for p in path.rglob("*.json") if p.is_file())
    return [path]


def check_paths(paths, *, numeric: bool = True, timeout: float | None = None,
                progress=None) -> tuple[int, int, list[str]]:
    """Check certificate files and every ``*.json`` under directories.

    Every certificate is checked in a fresh process of its own
    (:func:`check_isolated`), with a time limit of ``timeout`` seconds
    (default :data:`DEFAULT_TIMEOUT_S`): the code of a ``from`` file runs
    there, so it can change neither another certificate's verdict nor this
    process; a process that ends without a verdict, or runs out of time, is a
    failure.

    Returns ``(n_ok, n_fail, lines)``, one line per certificate (a directory
    without certificates, or a missing path, counts as one failure);
    ``progress(line)``, if given, is called with each line as soon as it is known."""
    n_ok = n_fail = 0
    lines = []

    def add(ok: bool, line: str) -> None:
        nonlocal n_ok, n_fail
        n_ok, n_fail = n_ok + ok, n_fail + (not ok)
        lines.append(line)
        if progress is not None:
            progress(line)

    for raw in paths:
        path = Path(raw)
        if not path.exists():
            add(False, f"FAIL {raw}: no such file or directory")
            continue
        files = _certificate_files(path)
        if not files:
            add(False, f"FAIL {raw}: no certificates (*.json) found")
            continue
        for f in files:
            report = check_isolated(f, numeric=numeric, name=str(f), timeout=timeout)
            add(report.ok, f"{'ok  ' if report.ok else 'FAIL'} {f}: {report}")
    return n_ok, n_fail, lines


def checking_context():
    """The multiprocessing context certificates are checked in: a fork server
    that preloads napkin.certify.checker (where the platform has one; else spawn)."""
    if "forkserver" in _mp.get_all_start_methods():
        ctx = _mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
        return ctx
    return _mp.get_context("spawn")


def start_server() -> None:
    """Start the fork server now, so that its imports run while the caller imports
    the rest (``napkin check`` proves the rules meanwhile); check_paths starts it
    otherwise, or reports why it cannot."""
    if "forkserver" not in _mp.get_all_start_methods():
        return
    from multiprocessing import forkserver
    checking_context()
    try:
        with _bare_main():
            forkserver.ensure_running()
    except OSError:
        pass


@contextlib.contextmanager
def _bare_main():
    """While starting a checking process (or the server): a ``__main__`` without
    a file, so that multiprocessing does not make them import the caller's."""
    main = _sys.modules.get("__main__")
    _sys.modules["__main__"] = _types.ModuleType("__main__")
    try:
        yield
    finally:
        _sys.modules["__main__"] = main


def check_isolated(path, *, numeric: bool = True, name: str = "",
                   timeout: float | None = None):
    """Check the certificate file ``path`` in a fresh process (see
    :func:`checking_context`) and return its report.  A process that exits,
    crashes or is killed without handing back a verdict, or has none within
    ``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`; it is then
    killed), gives a failed report saying so.

    A certificate whose algorithm is a ``from`` file is judged without running
    that file beside the judgement: a first process runs the file and hands back
    its diagram as data (napkin.core.serial) with, where the file has them, its
    sampler's inputs and its reference's outputs; the judging process rebuilds
    the diagram from that data with napkin's own primitives and never imports
    the file, so nothing the file does can change the verdict."""
    from napkin.certify.checker import CheckReport
    name = name or str(path)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout

    def failed(line: str) -> CheckReport:
        return CheckReport(False, name, line=line, seconds=time.perf_counter() - t0)
    absolute = str(Path(path).absolute())
    built = None
    if _runs_a_file(absolute):
        built, why = _in_child(_build_in_child, (absolute, numeric, _os.getcwd()), name,
                               deadline, _BUILT_LIMIT, timeout)
        if built is None:
            if why.startswith("timed out"):
                return failed(f"{why} (while its algorithm's file ran)")
            return failed(f"no verdict: the process that runs its algorithm's file {why}")
        if not _well_formed(built):
            return failed("the process that runs its algorithm's file handed back malformed "
                          "data (want one JSON object: the diagram it built)")
    data, why = _in_child(_check_in_child, (absolute, name, numeric, _os.getcwd(), built),
                          name, deadline, _VERDICT_LIMIT, timeout)
    report = _parse_verdict(data, name) if data else None
    if report is not None:
        return report
    if why.startswith("timed out"):
        return failed(why)
    if data:
        return failed("the process checking it handed back a malformed verdict")
    return failed(f"no verdict: the process checking it {why}")


def _runs_a_file(path: str) -> bool:
    """Whether the certificate at ``path`` names a ``from`` file (False when it cannot
    be read: the checking process reports why)."""
    from napkin.certify.certificate import Certificate, from_specs
    try:
        return bool(from_specs(Certificate.load(Path(path)).algorithm))
    except Exception:  # noqa: BLE001 - a malformed certificate: its check says so
        return False


def _well_formed(data: bytes) -> bool:
    try:
        v = _json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(v, dict) and set(v) == {"built", "runs", "error"}


def _in_child(target, args, name: str, deadline: float, limit: int, timeout: float):
    """Run ``target(writer, *args)`` in a process of the checking context and return
    (the first line it wrote or None, why there is none)."""
    try:
        ctx = checking_context()
        reader, writer = ctx.Pipe(duplex=False)
    except OSError as e:
        return None, f"could not start: {e}"
    proc = ctx.Process(target=target, name=f"napkin check {name}", args=(writer, *args))
    try:
        try:
            with _bare_main():
                proc.start()
        except (OSError, EOFError, ValueError, RuntimeError) as e:  # e.g. the server died
            return None, f"could not start: {type(e).__name__}: {e}"
        finally:
            writer.close()
        data, timed_out = _read_verdict(proc, reader, deadline, limit)
        if data and not timed_out:
            proc.join(_GRACE_S)
            return data, ""
        if timed_out:
            return None, (f"timed out: no verdict within {timeout:g} s (the time limit, "
                          f"napkin check --timeout); its checking process was stopped")
        proc.join(_GRACE_S)
        if data:
            return data, ""
        return None, (f"{_ended(proc.exitcode)} before handing anything back (a crash, or "
                      f"code in its algorithm file that ended the process)")
    finally:
        reader.close()
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
            proc.join()


def _read_verdict(proc, reader, deadline: float, limit: int) -> tuple[bytes, bool]:
    """The first line the child writes (b"" if none) and whether time ran out
    first; never blocks past ``deadline``."""
    fd = reader.fileno()
    _os.set_blocking(fd, False)
    buf = bytearray()

    def read() -> bool:
        """Read what is there; True at the end (EOF, a whole line, or too much)."""
        while True:
            try:
                chunk = _os.read(fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            buf.extend(chunk)
            if b"\n" in buf or len(buf) > limit:
                return True
    while True:
        left = deadline - time.monotonic()
        ready = _wait([fd, proc.sentinel], left) if left > 0 else []
        if not ready:
            return bytes(buf).partition(b"\n")[0], True
        # the process ended: what it wrote is all there is (a grandchild may hold the pipe)
        if read() or proc.sentinel in ready:
            return bytes(buf).partition(b"\n")[0], False


_JSON_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
               "None": (type(None),)}


def _field_ok(annotation, value) -> bool:
    """Whether a JSON ``value`` fits a CheckReport field annotated ``annotation``
    (a string such as ``"float | None"``)."""
    kinds = [_JSON_TYPES.get(a.strip()) for a in str(annotation).split("|")]
    if any(k is None for k in kinds):  # a type a verdict does not carry
        return False
    allowed = tuple(t for k in kinds for t in k)
    return isinstance(value, allowed) and (not isinstance(value, bool) or bool in allowed)


def _parse_verdict(data: bytes, name: str):
    """The CheckReport a child sent, or None when the data is not a well-formed verdict."""
    from napkin.certify.checker import CheckReport
    try:
        v = _json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    fields = {f.name: f for f in dataclasses.fields(CheckReport)}
    if not (isinstance(v, dict) and isinstance(v.get("ok"), bool) and set(v) <= set(fields)
            and all(_field_ok(fields[k].type, x) for k, x in v.items())):
        return None
    values = {k: (" ".join(x.split())[:4000] if isinstance(x, str) else
                  float(x) if "float" in str(fields[k].type) and x is not None else x)
              for k, x in v.items()}
    report = CheckReport(**{**values, "name": name})
    try:
        str(report)
    except (TypeError, ValueError):
        return None
    return report


def _ended(code) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {_signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _as_child(cwd: str) -> None:
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # ^C: the parent stops this process
    try:
        _os.dup2(2, 1)  # stdout carries the checker's lines only; a from-file's prints: stderr
        _os.chdir(cwd)  # where the parent is (the server's directory may differ)
    except OSError:
        pass


def _write_line(writer, obj) -> None:
    data = (_json.dumps(obj) + "\n").encode("utf-8")
    fd = writer.fileno()
    while data:
        data = data[_os.write(fd, data):]
    writer.close()


def _build_in_child(writer, path: str, numeric: bool, cwd: str) -> None:
    """In the process that runs a certificate's ``from`` file (and nothing else): build
    its diagram at the certificate's dtype and hand it back as data, with its sampler's
    inputs and its reference's outputs for the checker's cases (the judge compares the
    diagram with them)."""
    _as_child(cwd)
    out = {"built": {}, "runs": [], "error": None}
    try:
        from napkin.certify.certificate import Certificate, build_entry, from_specs
        from napkin.certify.checker import reference_runs
        cert = Certificate.load(Path(path))
        for spec in from_specs(cert.algorithm):
            entry, src = build_entry(spec, cert.origin, cert.dtype)
            out["built"][spec["from"]] = entry
            if numeric and src is not None and spec is cert.algorithm:
                try:
                    out["runs"] = [[i, [_array(x) for x in xs],
                                    None if ys is None else [_array(y) for y in ys]]
                                   for i, xs, ys in reference_runs(cert, src, src.build(
                                       cert.dtype))]
                except BaseException as e:  # noqa: BLE001 - a user's sampler or reference
                    out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    except BaseException as e:  # noqa: BLE001 - report, as one line, whatever ended it
        out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    _write_line(writer, out)


def _array(x) -> str:
    import base64
    import io

    import numpy as np
    buf = io.BytesIO()
    np.save(buf, np.asarray(x), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _read_built(built: bytes | None):
    """(prebuilt diagrams, given runs, error) from the data the file's process handed back;
    arrays are read without pickles (a value that is not a plain array is refused)."""
    if built is None:
        return None, (), None
    import base64
    import io

    import numpy as np
    v = _json.loads(built.decode("utf-8"))
    runs = []
    for run in v["runs"] if isinstance(v["runs"], list) else ():
        i, xs, ys = run
        read = lambda a: np.load(io.BytesIO(base64.b64decode(a, validate=True)),  # noqa: E731
                                 allow_pickle=False)
        runs.append((i, [read(a) for a in xs], None if ys is None else tuple(read(a) for a in ys)))
    return (v["built"] if isinstance(v["built"], dict) else {}), runs, v["error"]


def _check_in_child(writer, path: str, name: str, numeric: bool, cwd: str,
                    built: bytes | None = None) -> None:
    """In the checking process: check one certificate; write its report as one JSON line.
    ``built``: the diagram data the file's own process handed back (the file never runs
    here)."""
    from napkin.certify.checker import CheckReport, check_certificate
    _as_child(cwd)
    try:
        prebuilt, given, error = _read_built(built)
    except Exception as e:  # noqa: BLE001 - data from a process that ran user code
        report = CheckReport(False, name, 0, None, f"algorithm: the process that runs its file "
                                                   f"handed back unreadable data "
                                                   f"({type(e).__name__})")
    else:
        if error and numeric:
            report = CheckReport(False, name, None, None, f"numeric check: the algorithm's "
                                                          f"sampler or reference failed: {error}")
        else:
            report = check_certificate(Path(path), numeric=numeric, name=name,
                                       prebuilt=prebuilt, given=given)
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    # a reason quoting a huge value stays one readable line within the verdict's limit
    _write_line(writer, {k: v[:4000] if isinstance(v, str) else v for k, v in fields.items()
                         if v is None or isinstance(v, (bool, int, float, str))})


__all__ = ["DEFAULT_TIMEOUT_S", "check_isolated", "check_paths", "checking_context", "start_server"]