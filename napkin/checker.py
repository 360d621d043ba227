"""The certificate checker: an independent re-verification of a derivation.

It trusts nothing in a certificate but its *claims*, and re-establishes each
one from the rules and the semantics alone (it imports no search code):

0. the source: the algorithm is rebuilt (library name or ``FILE:NAME``) and its
   fingerprint compared with the recorded ``source``; every symbolic axis size
   must have a positive value in ``sizes``;
1. every step, in order: the rule exists; its premises hold at the recorded
   site with the recorded parameters (``rule.check``); the rule is applied;
   every tile size it introduces is bound in ``tiles`` to a positive integer;
   the fingerprint of the new program equals the recorded one;
2. the final fingerprint equals the recorded ``result``, the program's free
   size symbols equal ``symbolic``, and no tile in ``tiles`` is unused;
3. numerically: the final program, the original diagram and the library's
   plain-jnp reference agree (float64, relative error <= 1e-9) on random inputs
   at the certificate's sizes and at a ragged size set (each size a few less,
   so the last group or chunk is partial).  If they do not, every
   intermediate program is evaluated to name the first step that broke it.

A failure is a :class:`CheckReport` naming the step (1-based; 0 = the source,
None = the certificate as a whole) and the reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from napkin.certificate import (Certificate, CertificateError, fingerprint, load_algorithm,
                                size_symbols)
from napkin.errors import NapkinError
from napkin.semantics import evaluate
from rewrites import RULES

RTOL = 1e-9
# The check runs each program once per size set: compile for speed of compiling.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class CheckFailure(Exception):
    def __init__(self, step, reason, rule=None, line=None):
        super().__init__(reason)
        self.step, self.reason, self.rule, self.line = step, reason, rule, line


@dataclass
class CheckReport:
    ok: bool
    name: str = ""                   # what was checked (a file name, or the algorithm)
    step: int | None = None          # failing step, 1-based; 0 = the source; None = whole
    rule: str | None = None
    reason: str = ""
    n_steps: int = 0
    max_error: float | None = None   # worst relative error of the numeric check
    seconds: float = 0.0
    line: str | None = None          # the whole message, where it names its place itself

    @property
    def where(self) -> str:
        if self.step is None:
            return "certificate"
        if self.step == 0:
            return "source"
        return f"step {self.step}" + (f" ({self.rule})" if self.rule else "")

    def __str__(self):
        if self.ok:
            err = (f"; numeric max rel err {self.max_error:.1e}" if self.max_error is not None
                   else "; numeric check skipped")
            return (f"verified: {self.n_steps} step(s) replayed{err} "
                    f"({self.seconds:.1f} s)")
        return self.line or f"{self.where}: {self.reason}"


# ----------------------------------------------------------------------------- helpers
def _short(digest: str) -> str:
    return digest[:12] + ".." if len(digest) > 12 else digest


def ragged(n: int) -> int:
    """A size a few less than ``n`` (never below 1): the last piece is partial."""
    return max(1, n - max(1, min(3, n // 4)))


def _tile_ok(name, tiles):
    v = tiles.get(name)
    if v is None:
        return f"tile size {name} is not bound in the certificate's tiles"
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        return f"tile size {name} = {v!r} is not a positive integer"
    return None


def _sample(program, sizes, rng):
    """Standard-normal inputs for a diagram without a sampler of its own."""
    out = []
    for ob in program.dom.inside:
        shape = []
        for a in ob.type.axes:
            shape.append(a.size if isinstance(a.size, int) else int(sizes[str(a.size)]))
        out.append(rng.standard_normal(shape))
    return out


def _run(program, env, xs):
    """The program's meaning (the semantics functor) on ``xs``, traced once
    and compiled as one XLA program (op-by-op dispatch would compile every
    primitive at every shape, which is slower by an order of magnitude)."""
    return jax.jit(evaluate(program, env), compiler_options=_FAST_COMPILE)(*xs)


def _run_all(original, final, reference, cases):
    """For each case ``(env, xs)``: (original, final, reference) on ``xs``,
    all cases in one compiled program (one XLA compile per certificate)."""
    fns = [(evaluate(original, env), evaluate(final, env)) for env, _ in cases]
    flat = [x for _, xs in cases for x in xs]
    cuts = np.cumsum([0] + [len(xs) for _, xs in cases])

    def split(args):
        return [args[cuts[i]:cuts[i + 1]] for i in range(len(cases))]

    def napkin_side(*args):
        return [(f(*xs), g(*xs)) for (f, g), xs in zip(fns, split(args))]

    def everything(*args):
        return [(w, o, reference(*xs) if reference is not None else None)
                for (w, o), xs in zip(napkin_side(*args), split(args))]
    try:
        return jax.jit(everything, compiler_options=_FAST_COMPILE)(*flat)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
        # a reference that needs concrete values (numpy, Python control flow): run it as is
        sides = jax.jit(napkin_side, compiler_options=_FAST_COMPILE)(*flat)
        return [(w, o, reference(*xs)) for (w, o), (_, xs) in zip(sides, cases)]


def _outputs(y):
    return [np.asarray(v, dtype=np.float64) for v in (y if isinstance(y, tuple) else (y,))]


def _rel_error(got, want) -> float:
    got, want = _outputs(got), _outputs(want)
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return float("inf")
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            if not np.array_equal(a, b, equal_nan=True):
                return float("inf")
            continue
        scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-300)
        worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)) / scale)
    return worst


# ----------------------------------------------------------------------------- the checker
def _replay(cert: Certificate, src):
    """Stages 0-2; returns (original, [program after each step])."""
    try:
        original = src.build(cert.dtype)
    except NapkinError as e:
        raise CheckFailure(0, f"cannot build the algorithm: {e}") from None
    got = fingerprint(original)
    if got != cert.source:
        raise CheckFailure(0, f"source fingerprint mismatch: the algorithm {_label(cert)} "
                              f"({cert.dtype}) is not the one the certificate was made from "
                              f"(recorded {_short(cert.source)}, rebuilt {_short(got)})")
    axes = size_symbols(original)
    for name in sorted(axes):
        v = cert.sizes.get(name)
        if v is None:
            raise CheckFailure(0, f"sizes: no value for the symbolic size {name}")
        if v <= 0:
            raise CheckFailure(0, f"sizes: {name} = {v} is not positive")
    extra = sorted(set(cert.sizes) - axes)
    if extra:
        raise CheckFailure(0, f"sizes: {', '.join(extra)} is not a size of the algorithm")

    program, programs, seen = original, [], set(axes)
    for i, step in enumerate(cert.steps, 1):
        rule = RULES.get(step.rule)
        if rule is None:
            reason = f"unknown rule {step.rule!r} (known: {', '.join(sorted(RULES))})"
            raise CheckFailure(i, reason, line=f"unknown rule {step.rule!r} at step {i} "
                                               f"(known: {', '.join(sorted(RULES))})")
        try:
            rule.check(program, step.site, dict(step.params))
            program = rule.apply(program, step.site, dict(step.params))
        except NapkinError as e:
            raise CheckFailure(i, f"premise failed: {e}", step.rule) from None
        except Exception as e:  # noqa: BLE001 - a rule that crashes does not apply
            raise CheckFailure(i, f"the rule failed on this site and parameters: "
                                  f"{type(e).__name__}: {e}", step.rule) from None
        now = size_symbols(program)
        for name in sorted(now - seen):
            why = _tile_ok(name, cert.tiles)
            if why:
                raise CheckFailure(i, f"premise failed: {why}", step.rule)
        seen |= now
        got = fingerprint(program)
        if got != step.result:
            raise CheckFailure(i, f"result fingerprint mismatch (recorded {_short(step.result)}, "
                                  f"replayed {_short(got)})", step.rule)
        programs.append(program)

    got = fingerprint(program)
    if got != cert.result:
        raise CheckFailure(None, f"final result fingerprint mismatch (recorded "
                                 f"{_short(cert.result)}, replayed {_short(got)})")
    final_syms = size_symbols(program)
    if sorted(cert.symbolic) != sorted(final_syms):
        raise CheckFailure(None, f"symbolic sizes {sorted(cert.symbolic)} are not those of the "
                                 f"final program {sorted(final_syms)}")
    unused = sorted(set(cert.tiles) - (seen - axes))
    if unused:
        raise CheckFailure(None, f"tiles: {', '.join(unused)} is bound but no step introduces it")
    return original, programs


def _label(cert):
    a = cert.algorithm
    return a if isinstance(a, str) else a.get("from", repr(a)) if isinstance(a, dict) else repr(a)


def _numeric(cert, src, original, programs, seed=0):
    """Stage 3; returns the worst relative error."""
    final = programs[-1] if programs else original
    sets = [("the certificate's sizes", dict(cert.sizes)),
            ("ragged sizes", {k: ragged(v) for k, v in cert.sizes.items()})]
    worst = 0.0
    with jax.enable_x64(True):
        cases = []
        try:
            for i, (what, sizes) in enumerate(sets):
                rng = np.random.default_rng(seed + i)
                xs = (src.sample(rng, sizes) if src.sample else _sample(original, sizes, rng))
                cases.append(({**sizes, **cert.tiles}, [np.asarray(x, np.float64) for x in xs]))
            results = _run_all(original, final, src.reference, cases)
        except Exception as e:  # noqa: BLE001 - any failure to evaluate is a failed check
            raise CheckFailure(None, f"numeric check: evaluation failed at sizes "
                                     f"{sets[0][1]} / ragged {sets[1][1]}: "
                                     f"{type(e).__name__}: {e}") from None
        for (what, sizes), (env, xs), (want, got, ref) in zip(sets, cases, results):
            err = _rel_error(got, want)
            if err > RTOL:
                step, rule = _first_bad_step(cert, original, programs, want, xs, env)
                raise CheckFailure(step, f"numeric check failed at {what} {sizes}: the program "
                                         f"after this step differs from the algorithm's diagram "
                                         f"(relative error {err:.2e} > {RTOL:g})", rule)
            worst = max(worst, err)
            if ref is not None:
                err = _rel_error(got, ref)
                if err > RTOL:
                    ref_err = _rel_error(want, ref)
                    whose = ("the algorithm's diagram itself disagrees with its reference "
                             f"(relative error {ref_err:.2e})" if ref_err > RTOL else
                             "the final program")
                    raise CheckFailure(None, f"numeric check failed at {what} {sizes}: the final "
                                             f"program differs from the reference (relative error "
                                             f"{err:.2e} > {RTOL:g}); {whose}")
                worst = max(worst, err)
    return worst


def _first_bad_step(cert, original, programs, want, xs, env):
    for i, p in enumerate(programs, 1):
        try:
            err = _rel_error(_run(p, env, xs), want)
        except (NapkinError, ValueError, TypeError):
            err = float("inf")
        if err > RTOL:
            return i, cert.steps[i - 1].rule
    return None, None


def check_certificate(cert, *, numeric: bool = True, name: str = "") -> CheckReport:
    """Re-verify a certificate (a :class:`Certificate`, a dict, JSON text or a path)."""
    t0 = time.perf_counter()
    try:
        if isinstance(cert, Path) or (isinstance(cert, str) and not cert.lstrip().startswith("{")):
            name = name or Path(cert).name
            cert = Certificate.load(cert)
        elif isinstance(cert, str):
            cert = Certificate.from_json(cert)
        elif isinstance(cert, dict):
            cert = Certificate.from_dict(cert)
    except (CertificateError, OSError) as e:
        return CheckReport(False, name, getattr(e, "step", None), None,
                           f"malformed certificate: {e}", seconds=time.perf_counter() - t0)
    name = name or _label(cert)
    report = CheckReport(False, name, n_steps=len(cert.steps))
    try:
        try:
            src = load_algorithm(cert.algorithm, cert.origin)
        except NapkinError as e:
            raise CheckFailure(0, f"algorithm: {e}") from None
        original, programs = _replay(cert, src)
        if numeric:
            report.max_error = _numeric(cert, src, original, programs)
        report.ok = True
    except CheckFailure as f:
        report.step, report.rule, report.reason, report.line = f.step, f.rule, f.reason, f.line
    except Exception as e:  # noqa: BLE001 - a checker reports, it does not crash
        report.reason = f"internal error while checking: {type(e).__name__}: {e}"
    report.seconds = time.perf_counter() - t0
    return report


def _certificate_files(path: Path):
    if path.is_dir():
        return sorted(p for p in path.rglob("*.json") if p.is_file())
    return [path]


def check_paths(paths, *, numeric: bool = True) -> tuple[int, int, list[str]]:
    """Check certificate files and every ``*.json`` under directories.

    Returns ``(n_ok, n_fail, lines)``, one line per certificate (a directory
    without certificates, or a missing path, counts as one failure)."""
    n_ok = n_fail = 0
    lines = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            n_fail += 1
            lines.append(f"FAIL {raw}: no such file or directory")
            continue
        files = _certificate_files(path)
        if not files:
            n_fail += 1
            lines.append(f"FAIL {raw}: no certificates (*.json) found")
            continue
        for f in files:
            report = check_certificate(f, numeric=numeric, name=str(f))
            if report.ok:
                n_ok += 1
                lines.append(f"ok   {f}: {report}")
            else:
                n_fail += 1
                lines.append(f"FAIL {f}: {report}")
    return n_ok, n_fail, lines


__all__ = ["CheckReport", "RTOL", "check_certificate", "check_paths", "ragged"]
