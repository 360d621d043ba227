"""The program cache: what a search chose, kept across processes, never trusted.

An entry is one JSON file per (diagram fingerprint, sizes, dtype, hardware, napkin's code),
in ``NAPKIN_CACHE_DIR`` (default ``~/.cache/napkin``).  It holds the chain as a certificate
(each step's rule, site, parameters and result fingerprint), the tiles and the launch
parameters.  Loading replays the certificate on the diagram in hand with napkin's own rules —
the checker's symbolic stages: every premise re-checked, every fingerprint compared — so an
entry that was edited, or made by other rules, is re-derived rather than used: the cache
saves the search, not the proof.  What it does not hold: the backward's programs (searched
when first differentiated) and the numeric cross-check (``napkin check`` does that).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from napkin.core.errors import NapkinError

FORMAT = "napkin-cache/1"
ENV = "NAPKIN_CACHE_DIR"


def folder() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "napkin")


@functools.cache
def code_digest() -> str:
    """A digest of the code that decides a program (the rules, search, cost model, schedule,
    hardware profiles and core): an entry made by other code — another napkin version, an
    edited rule — is another entry."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in ("../rewrites", "search", "cost", "schedule", "hardware.py", "core"):
        base = (root / part).resolve()
        for f in sorted(base.rglob("*.py")) if base.is_dir() else [base]:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def key(diagram, sizes: dict, dtype, hardware) -> dict:
    from napkin.certify.certificate import fingerprint
    return {"fingerprint": fingerprint(diagram), "sizes": dict(sorted(sizes.items())),
            "dtype": dtype, "hardware": hardware.name, "code": code_digest()}


def _path(k: dict) -> Path:
    return folder() / (hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:32]
                       + ".json")


@dataclass(frozen=True)
class Entry:
    """What a search chose, as the cache keeps it (``chain``: the moves; ``launches``: the
    launch model's per kernel)."""
    name: str
    chain: tuple
    tiles: dict
    launch: dict
    launches: list
    time_s: float
    program: object = None      # the program the replayed chain gives (on load)


def store(diagram, sizes: dict, dtype, hardware, entry: Entry, instance) -> Path:
    """Write ``entry`` for ``diagram`` at ``sizes``, ``dtype``, ``hardware``; returns its path.
    ``instance``: the (sizes, tiles) its certificate records (``pipeline.check_instance``)."""
    from napkin.certify.certificate import Source, derive_from
    small, small_tiles = instance
    cert = derive_from(Source(entry.name, lambda dt: diagram), {"cache": entry.name},
                       [(m.rule, m.site, m.params_dict) for m in entry.chain], small,
                       small_tiles, dtype or "f32")
    k = key(diagram, sizes, dtype, hardware)
    entry = {"format": FORMAT, "key": k, "name": entry.name, "certificate": cert.to_dict(),
             "tiles": dict(entry.tiles), "launch": dict(entry.launch),
             "launches": [dict(x) for x in entry.launches], "time_s": entry.time_s}
    path = _path(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # whole or not at all, even if two write
    tmp.write_text(json.dumps(entry, sort_keys=True, indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def load(diagram, sizes: dict, dtype, hardware, name: str) -> Entry | None:
    """The :class:`Entry` kept for this diagram, its chain replayed and checked (its
    ``program`` the result); None when there is none or it does not replay (the caller
    re-derives it and writes it again).  ``hardware``: the profile as the search sees it."""
    path = _path(key(diagram, sizes, dtype, hardware))
    if not path.is_file():
        return None
    try:
        return _replayed(json.loads(path.read_text(encoding="utf-8")), diagram, sizes, dtype,
                         hardware, name)
    except (NapkinError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _replayed(entry, diagram, sizes, dtype, hardware, name) -> Entry | None:
    from napkin.certify.certificate import Certificate, Source, size_symbols
    from napkin.certify.checker import replay
    from napkin.core.streamed import names
    from napkin.lower.backends import get_backend
    from napkin.search.engine import Move
    if entry.get("format") != FORMAT or entry.get("key") != key(diagram, sizes, dtype,
                                                                hardware):
        return None
    cert = Certificate.from_dict(entry["certificate"])
    _, programs = replay(cert, Source(name, lambda dt: diagram))  # CheckFailure: NapkinError
    program = programs[-1] if programs else diagram
    tiles = _ints(entry["tiles"])
    if set(tiles) != set(names(program).tiles) or not set(tiles) <= size_symbols(program):
        return None
    own = get_backend("triton")
    launch = dict(entry["launch"])
    launches = [dict(x) for x in entry["launches"]]
    for given in (launch, *launches):  # values a block cannot take would fail the lowering
        own.check_launch({**own.launch, **{k: v for k, v in given.items() if k in own.launch}})
    chain = tuple(Move(s.rule, s.site, tuple(sorted(s.params.items()))) for s in cert.steps)
    return Entry(name, chain, tiles, launch, launches, float(entry["time_s"]), program)


def _ints(d) -> dict:
    out = {str(k): v for k, v in dict(d).items()}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in out.values()):
        raise ValueError("tiles are positive integers")
    return out


def entries() -> list[dict]:
    """Every readable entry: name, sizes, dtype, hardware, modelled time, file."""
    out = []
    for path in sorted(folder().glob("*.json")):
        try:
            e = json.loads(path.read_text(encoding="utf-8"))
            k = e["key"]
            out.append({"name": e["name"], "sizes": k["sizes"], "dtype": k["dtype"],
                        "hardware": k["hardware"], "time_s": e["time_s"],
                        "current": k["code"] == code_digest(), "path": path})
        except (OSError, ValueError, KeyError, TypeError):
            out.append({"name": "?", "path": path, "unreadable": True})
    return out


def clear() -> int:
    """Remove every entry; returns how many."""
    n = 0
    for path in folder().glob("*.json"):
        path.unlink(missing_ok=True)
        n += 1
    return n
