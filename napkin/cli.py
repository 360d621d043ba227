"""The ``napkin`` command line.

Every subcommand is one small function registered with :func:`command` in
:data:`COMMANDS`; :func:`main` builds the argument parser from that table and
dispatches.  Adding a subcommand (rules, check, cost, optimize, lower, run,
demo, pseudocode, ...) is one decorated function::

    @command("cost", "print the symbolic cost of an algorithm",
             arg("algorithm", metavar="ALGO", help="a library algorithm"),
             arg("--dtype", default="f32", help="storage dtype"))
    def _cost(args) -> int:
        from napkin.cost import cost            # import heavy things lazily
        print(cost(_algorithm(args.algorithm).diagram(args.dtype)))
        return 0

Errors: a :class:`~napkin.errors.NapkinError` (or a usage error: unknown
command, bad option) prints one line ``napkin: error: ...`` on stderr and
exits with status 2 — never a traceback.  Files a command writes are declared
up front with :class:`Outputs` (checked before any work; removed again if the
command then fails).  An unexpected exception (a bug)
prints one line ``napkin: internal error: ...`` and exits 1; ``--traceback``
shows the full traceback instead.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from napkin.errors import NapkinError

PROG = "napkin"


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Arg:
    """The arguments of one ``parser.add_argument`` call."""
    flags: tuple
    options: dict


def arg(*flags, **options) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    args: tuple[Arg, ...]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, *args: Arg):
    """Register ``fn(args) -> int | None`` as subcommand ``name`` (None means 0)."""
    def wrap(fn):
        if name in COMMANDS:
            raise ValueError(f"napkin command {name!r} registered twice")
        COMMANDS[name] = Command(name, help, args, fn)
        return fn
    return wrap


# ----------------------------------------------------------------------------- parsing
class UsageError(NapkinError):
    """A command line argparse rejected."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version as _v
        return _v("napkin")
    except PackageNotFoundError:
        pass
    try:  # running from a checkout that is not installed
        import tomllib
        from pathlib import Path
        data = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
        return data["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Deep-learning algorithms as string diagrams, "
                                            "rewritten into streamed kernels.")
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for a in cmd.args:
            p.add_argument(*a.flags, **a.options)
    return parser


def _check_command(argv: list[str]) -> None:
    """A friendlier message than argparse's for a missing or misspelt command."""
    for word in argv:
        if word in ("-h", "--help", "--version"):
            return
        if word.startswith("-"):
            continue  # an option: argparse judges it
        if word not in COMMANDS:
            close = difflib.get_close_matches(word, COMMANDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"unknown command {word!r}{hint}; commands: {', '.join(COMMANDS)}")
        return
    if not argv:
        raise UsageError(f"no command given; commands: {', '.join(COMMANDS)} "
                         f"(see '{PROG} --help')")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv  # accepted anywhere on the line
    argv = [a for a in argv if a != "--traceback"]
    try:
        _check_command(argv)
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise UsageError(f"no command given; commands: {', '.join(COMMANDS)} "
                             f"(see '{PROG} --help')")
        status = COMMANDS[args.command].run(args)
        return 0 if status is None else int(status)
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except NapkinError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `napkin algorithms | head`
        sys.stderr.close()
        return 0
    except Exception as e:
        if show_traceback:
            raise
        print(f"{PROG}: internal error: {type(e).__name__}: {_one_line(e)} "
              f"(rerun with --traceback for details)", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------- helpers
def _algorithm(name: str):
    from napkin.library import get
    return get(name)


def signature(diagram) -> str:
    """``Q[q,d] @ K[x,d] @ V[x,d] -> O[q,d]``."""
    from napkin.arrays import describe
    return f"{describe(diagram.dom)} -> {describe(diagram.cod)}"


def table(rows: list[tuple[str, ...]], gap: str = "  ") -> str:
    """Rows of strings as aligned columns (the last column is not padded)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(gap.join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip()
                     for r in rows)


# ----------------------------------------------------------------------------- output files
PICTURES = (".png", ".svg")


class Outputs:
    """The files one command writes.

    Each path is checked when the command declares it — before it does any
    work — and everything the command wrote is removed again if it then fails,
    so a failed command leaves no file behind::

        with Outputs() as out:
            cert = out.file(args.certificate, "--certificate")
            ...                                   # the work
            out.write(cert, lambda: c.save(cert))
    """

    def __init__(self):
        self._declared: dict[str, str] = {}       # resolved path -> option
        self._written: list[tuple[Path, tuple | None]] = []  # path, its stat before
        self._made: list[Path] = []                # directories this command created

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None:
            self.discard()
        return False

    def discard(self) -> None:
        """Remove what this command wrote (files, then the directories it made)."""
        for path, before in reversed(self._written):
            try:
                if (path.is_file() or path.is_symlink()) and _stamp(path) != before:
                    path.unlink()  # written (or begun) by this command
            except OSError:
                pass
        for d in reversed(self._made):
            try:
                d.rmdir()
            except OSError:
                pass
        self._written.clear()
        self._made.clear()

    def _claim(self, p: Path, option: str) -> None:
        key = os.path.realpath(p)
        other = self._declared.get(key)
        if other is not None:
            raise NapkinError(f"{other} and {option} name the same file {str(p)!r}: give two "
                              f"different paths")
        self._declared[key] = option

    def file(self, path, option: str, *, suffixes: tuple[str, ...] | None = None,
             overwrite: bool = True, hint: str = "") -> Path | None:
        """Check that ``path`` (given by ``option``) can be written as a file.
        None stays None (the option was not given)."""
        if path is None:
            return None
        p, shown = Path(path), f"{option} {str(path)!r}"
        if not str(path).strip():
            raise NapkinError(f"{option}: empty path; give a file name")
        if suffixes and p.suffix.lower() not in suffixes:
            kind = f"file type {p.suffix!r}" if p.suffix else "a file name without a suffix"
            raise NapkinError(f"{shown}: unsupported {kind}; use {' or '.join(suffixes)}")
        if p.is_dir():
            raise NapkinError(f"{shown} is a directory; give a file path in it")
        _existing_directory(p.parent, shown)
        if p.exists() or p.is_symlink():
            if not p.is_file():
                raise NapkinError(f"{shown} exists and is not a regular file; give a file path")
            if not overwrite:
                raise NapkinError(f"{shown} exists; {hint or 'choose another path'}")
            if not os.access(p, os.W_OK):
                raise NapkinError(f"{shown} is not writable (permission denied)")
        else:
            try:  # can a file be created there at all (read-only or pseudo file systems)?
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.close(fd)
                os.unlink(p)
            except OSError as e:
                raise NapkinError(f"{shown}: cannot create a file there "
                                  f"({e.strerror or e})") from None
        self._claim(p, option)
        return p

    def directory(self, path, option: str) -> Path:
        """Check that ``path`` is a directory, or can be made one."""
        p, shown = Path(path), f"{option} {str(path)!r}"
        if not str(path).strip():
            raise NapkinError(f"{option}: empty path; give a directory")
        if p.exists():
            if not p.is_dir():
                raise NapkinError(f"{shown} is an existing file, not a directory; give a "
                                  f"directory (it is created if missing)")
            if not os.access(p, os.W_OK | os.X_OK):
                raise NapkinError(f"{shown} is not writable (permission denied)")
        else:
            top = _existing_ancestor(p)
            if not top.is_dir():
                raise NapkinError(f"{shown}: {str(top)!r} is a file, not a directory")
            if not os.access(top, os.W_OK | os.X_OK):
                raise NapkinError(f"{shown}: cannot create it in {str(top)!r} (permission denied)")
        self._claim(p, option)
        return p

    def make_directory(self, path: Path) -> Path:
        """Create a declared directory (and missing parents); they are removed on failure
        if still empty."""
        missing = []
        d = Path(path)
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                raise NapkinError(f"cannot create directory {str(d)!r}: {e.strerror or e}") \
                    from None
            self._made.append(d)
        return Path(path)

    def write(self, path, writer: Callable[[], object], option: str | None = None):
        """Run ``writer()``, which writes ``path``; the file is this command's from now on
        (removed if the command fails, even part-way through writing it)."""
        p = Path(path)
        if option is None:  # the option that declared it, or the folder it is in
            real = Path(os.path.realpath(p))
            option = next((self._declared[str(d)] for d in (real, *real.parents)
                           if str(d) in self._declared), "output")
        self._written.append((p, _stamp(p)))
        try:
            return writer()
        except OSError as e:
            raise NapkinError(f"{option}: cannot write {str(p)!r}: {e.strerror or e}") from None


def _stamp(p: Path) -> tuple | None:
    """What tells whether a file was written since: (inode, size, mtime), None if absent."""
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _existing_ancestor(p: Path) -> Path:
    """The nearest existing path among ``p``'s parents (``p`` itself if it exists)."""
    p = Path(os.path.abspath(p))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _existing_directory(d: Path, shown: str) -> None:
    """``d`` (the parent of an output file) must be an existing directory."""
    if d.is_dir():
        return
    top = _existing_ancestor(d)
    if top.is_dir():
        raise NapkinError(f"{shown}: directory {str(d)!r} does not exist (create it first)")
    raise NapkinError(f"{shown}: {str(top)!r} is a file, not a directory")


# ----------------------------------------------------------------------------- commands
@command("algorithms", "list the library's algorithms: name, signature, summary")
def _algorithms(args) -> int:
    from napkin.library import LIBRARY
    rows = []
    for name, algo in LIBRARY.items():
        try:
            sig = signature(algo.diagram())
        except NapkinError as e:
            sig = f"(does not build: {_one_line(e)})"
        rows.append((name, sig, _one_line(algo.summary)))
    print(table(rows))
    return 0


@command("draw", "draw an algorithm's diagram to a PNG or SVG file",
         arg("algorithm", metavar="ALGO", help="a library algorithm (see 'napkin algorithms')"),
         arg("-o", "--output", metavar="PATH", default=None,
             help="file to write, .png or .svg (default: ALGO.png)"),
         arg("--dtype", default="f32", metavar="DT",
             help="storage dtype of the inputs (default: f32)"),
         arg("--streamed", action="store_true",
             help="draw the best streamed program instead (groups and streams as frames, "
                  "arrays coloured by memory level)"),
         arg("--hardware", default="h100", metavar="NAME", help="for --streamed (default: h100)"))
def _draw(args) -> int:
    from napkin.arrays import canonical_dtype
    from napkin.drawing import draw
    algo = _algorithm(args.algorithm)
    dtype = canonical_dtype(args.dtype)
    with Outputs() as out:
        target = out.file(args.output or f"{algo.name}{'_streamed' if args.streamed else ''}.png",
                          "-o/--output", suffixes=PICTURES)
        diagram = algo.diagram(dtype)
        if args.streamed:
            from napkin.drawing_streamed import draw_streamed
            from napkin.pipeline import optimize
            opt = optimize(diagram, args.hardware, dtype="bf16")
            path = out.write(target, lambda: draw_streamed(opt.program, target,
                                                           hardware=args.hardware,
                                                           tiles=opt.search.best.tile_values))
            print(path)
            return 0
        title = f"{algo.name}: {signature(diagram).replace(' -> ', ' → ')}"
        if dtype != "f32":
            title += f"  ({dtype})"
        path = out.write(target, lambda: draw(diagram, target, title=title))
    print(path)
    return 0


import napkin.commands  # noqa: E402,F401  (registers the pipeline's subcommands)

if __name__ == "__main__":  # run the registry of the imported module, not of __main__
    from napkin.cli import main as _main
    raise SystemExit(_main())
