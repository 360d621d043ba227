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

Errors: a :class:`~napkin.core.errors.NapkinError` (or a usage error: unknown
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
import sys

from napkin.cli import options
from napkin.cli.options import (COMMANDS, PICTURES, Outputs, UsageError, arg, command,  # noqa: F401
                                one_line, signature, table)
from napkin.core.errors import NapkinError

PROG = "napkin"


# ----------------------------------------------------------------------------- parsing
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
        data = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
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
    for cmd in options.COMMANDS.values():
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
        if word not in options.COMMANDS:
            close = difflib.get_close_matches(word, options.COMMANDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"unknown command {word!r}{hint}; commands: "
                             f"{', '.join(options.COMMANDS)}")
        return
    if not argv:
        raise UsageError(f"no command given; commands: {', '.join(options.COMMANDS)} "
                         f"(see '{PROG} --help')")


class _progress:
    """While a command runs, a search's progress on one rewritten line of ``stream`` — on a
    terminal only (a log or a pipe gets no carriage returns); the line is cleared after."""

    def __init__(self, stream):
        self.stream, self.shown = stream, False

    def show(self, states: int, best_s: float, elapsed: float) -> None:
        best = f"best {best_s * 1e6:,.1f} µs" if best_s < float("inf") else "nothing fits yet"
        self.stream.write(f"\rsearching: {states} states, {best}, {elapsed:.0f} s ")
        self.stream.flush()
        self.shown = True

    def __enter__(self):
        self.engine = None
        if getattr(self.stream, "isatty", lambda: False)():  # the search imported only then
            from napkin.search import engine
            self.engine, self.before = engine, engine.PROGRESS
            engine.PROGRESS = self.show
        return self

    def __exit__(self, *exc):
        if self.engine is not None:
            self.engine.PROGRESS = self.before
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv  # accepted anywhere on the line
    argv = [a for a in argv if a != "--traceback"]
    try:
        _check_command(argv)
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise UsageError(f"no command given; commands: {', '.join(options.COMMANDS)} "
                             f"(see '{PROG} --help')")
        for flag in ("arrive", "mesh"):  # options of the device plan: meaningless without it
            if getattr(args, flag, None) is not None and getattr(args, "devices", None) is None:
                raise UsageError(f"--{flag} shapes the plan over devices: give --devices N too")
        from napkin.cli.commands import mesh_shape
        mesh_shape(args)  # a bad shape stops the command before any search
        with _progress(sys.stderr):
            status = options.COMMANDS[args.command].run(args)
        return 0 if status is None else int(status)
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except NapkinError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
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
        print(f"{PROG}: internal error: {type(e).__name__}: {one_line(e)} "
              f"(rerun with --traceback for details)", file=sys.stderr)
        return 1




import napkin.cli.commands  # noqa: E402,F401  (registers the subcommands)
