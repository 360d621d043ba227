"""What the ``napkin`` subcommands are made of: the registry (:func:`command`, :func:`arg`),
the files a command writes (:class:`Outputs`, checked before any work, removed if the command
fails), and small helpers for printing (:func:`signature`, :func:`table`, :func:`one_line`).
The parser and ``main`` (napkin.cli) read the registry; the commands (napkin.cli.commands)
fill it."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from napkin.core.errors import NapkinError


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


class UsageError(NapkinError):
    """A command line argparse rejected."""


def one_line(text) -> str:
    return " ".join(str(text).split())


# ----------------------------------------------------------------------------- helpers
def algorithm_named(name: str):
    from napkin.frontend.library import get
    return get(name)


def signature(diagram) -> str:
    """``Q[q,d] @ K[x,d] @ V[x,d] -> O[q,d]``."""
    from napkin.core.arrays import describe
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
