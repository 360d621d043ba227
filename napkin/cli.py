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
exits with status 2 — never a traceback.  An unexpected exception (a bug)
prints one line ``napkin: internal error: ...`` and exits 1; ``--traceback``
shows the full traceback instead.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass
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
    diagram = algo.diagram(dtype)
    if args.streamed:
        from napkin.drawing_streamed import draw_streamed
        from napkin.commands import sizes_for
        from napkin.search import search
        r = search(diagram, args.hardware, sizes_for(diagram, {}), "bf16")
        path = draw_streamed(r.best.program, args.output or f"{algo.name}_streamed.png",
                             hardware=args.hardware, tiles=r.best.tile_values)
        print(path)
        return 0
    title = f"{algo.name}: {signature(diagram).replace(' -> ', ' → ')}"
    if dtype != "f32":
        title += f"  ({dtype})"
    path = draw(diagram, args.output or f"{algo.name}.png", title=title)
    print(path)
    return 0


import napkin.commands  # noqa: E402,F401  (registers the pipeline's subcommands)

if __name__ == "__main__":  # run the registry of the imported module, not of __main__
    from napkin.cli import main as _main
    raise SystemExit(_main())
