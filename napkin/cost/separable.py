"""Tiles chosen kernel by kernel: a program's grid as independent parts.

With a launch model, a program's time is the sum of its kernels' times and each kernel
launches (or not) on its own tiles (napkin.cost.launch).  Where the kernels' tiles fall into
disjoint sets — an untied program (napkin.core.retile) gives every kernel its own — the best
tiling is each set's best, found on that set's own grid: a sum of small grids, not their
product (a transformer block's twenty kernels over thirty tiles would be 10^20 points).

A *part* is a set of tiles that some kernel (its launch, and so its transfers and FLOPs) or
a nested tile's extent reads together (networkx's connected components); each part is a
:class:`napkin.cost.grid.Grid` over a view of the program's cost that holds that
part's tiles, kernels and terms alone (terms no tile reads add a constant: they cannot
move a part's best).  :class:`Parts` answers what a search and ``optimize_tiles`` ask of
a grid at a point (a tuple of each part's index): the parts' figures there, summed, plus
the constants.
"""
from __future__ import annotations

import functools

import networkx as nx
import sympy

from napkin.cost.launch import Launches, modelled, read_symbols
from napkin.cost.model import value_at
from napkin.cost.grid import Grid


def grid_for(c, sizes, objective: str = "time", capacity=None, **kw):
    """The grid a program's tiles are chosen on: :class:`Parts` where the time is a sum
    over kernels whose tiles fall apart (a launch model, the time objective, no capacity
    bound across kernels), else one :class:`Grid` over every tiling."""
    if objective == "time" and capacity is None and not kw and modelled(c.hardware):
        parts = _parts(c, sizes)
        if len(parts) > 1:
            return Parts(c, sizes, parts)
    return Grid(c, sizes, **kw)


def _terms(e) -> tuple:
    return sympy.Add.make_args(e) if isinstance(e, sympy.Basic) else ()


def _parts(c, sizes) -> list:
    """[(tiles, kernels)]: the program's free tiles in sets no kernel or nested extent reads
    across; every kernel in the part of its tiles (those with none in the first)."""
    free = [t for t in c.tiles if t.name not in sizes]
    if len(free) < 2:
        return [(free, None)]
    ours = set(free)
    links = nx.Graph()
    links.add_nodes_from(free)

    def link(symbols):
        nx.add_path(links, [t for t in free if t in symbols])
    for t in free:
        link(sympy.sympify(c.tiles[t].full).free_symbols | {t})
    ks = c.kernels
    for k in ks:  # (every transfer and FLOP is some kernel's: its terms read its tiles)
        link(read_symbols(k))
    sets = sorted((sorted(s, key=free.index) for s in nx.connected_components(links)),
                  key=lambda s: free.index(s[0]))
    if len(sets) < 2:
        return [(free, None)]
    where = {t: i for i, s in enumerate(sets) for t in s}
    owned = [[] for _ in sets]
    for k in ks:
        mine = [where[t] for t in read_symbols(k) if t in ours]
        owned[mine[0] if mine else 0].append(k)
    return list(zip(sets, owned))


class _View:
    """What :class:`Grid` reads of a cost, for one part: its tiles, its kernels, and the
    terms of the transfers, compute and memory that read its tiles alone."""

    def __init__(self, c, tiles, kernels, terms, memory):
        self.kernels = kernels
        mine = set(tiles)
        self.tiles = {t: info for t, info in c.tiles.items() if t in mine}
        self.levels, self.main_level, self.hardware = c.levels, c.main_level, c.hardware
        self.transfers, self.transfers_bytes, self._compute = (
            {k: sympy.Add(*ts) for k, ts in table.items()} for table in terms)
        self.memory_bytes_candidates = memory

    def compute_times(self) -> dict:
        return self._compute


def _split(c, parts, free) -> tuple:
    """Each part's terms of the transfers (values, bytes) and compute times, and its memory
    candidates; with the terms no tile reads (constants) and those that read several parts'
    tiles (none where every term is a kernel's), kept apart: (per part, constants, across)."""
    where = {t: i for i, (tiles, _) in enumerate(parts) for t in tiles}
    tables = (c.transfers, c.transfers_bytes, c.compute_times())
    mine = [tuple({k: [] for k in table} for table in tables) for _ in parts]
    const = tuple({k: [] for k in table} for table in tables)
    across = tuple({k: [] for k in table} for table in tables)
    for j, table in enumerate(tables):
        for key, e in table.items():
            for term in _terms(e):
                at = {where[t] for t in term.free_symbols & free}
                (const if not at else mine[at.pop()] if len(at) == 1 else across)[j][key] \
                    .append(term)
    memory = [{lv: [] for lv in c.memory_bytes_candidates} for _ in parts]
    for lv, cands in c.memory_bytes_candidates.items():
        for e in cands:
            at = {where[t] for t in sympy.sympify(e).free_symbols & free}
            if len(at) == 1:
                memory[at.pop()][lv].append(e)
    return mine, memory, const, across


class Parts:
    """Every tiling of a program whose kernels' tiles fall apart, as one grid per part.
    A point is a tuple: each part's index on its own grid."""

    def __init__(self, c, sizes, parts):
        self.c, self.sizes = c, dict(sizes)
        self.level = c.main_level
        free = {t for tiles, _ in parts for t in tiles}
        mine, memory, const, self._across = _split(c, parts, free)
        self._const = tuple({k: value_at(sympy.Add(*ts), self.sizes) for k, ts in table.items()}
                            for table in const)
        self.grids = [Grid(_View(c, tiles, ks, terms, mem), sizes)
                      for (tiles, ks), terms, mem in zip(parts, mine, memory)]
        self.free = [t for g in self.grids for t in g.free]
        self.cands = {k: v for g in self.grids for k, v in g.cands.items()}
        self.mult = {k: v for g in self.grids for k, v in g.mult.items()}
        self.thinned = {k: v for g in self.grids for k, v in g.thinned.items()}
        self.n = sum(g.n for g in self.grids)  # points evaluated: a sum, not a product

    @property
    def mem_least(self) -> dict:
        out: dict = {}
        for g in self.grids:
            for lv, least in g.mem_least.items():
                out.setdefault(lv, []).extend(least)
        return out

    def best(self, objective: str = "time", capacity=None):
        """(point, feasible): each part's best (its own fewest seconds among the points
        that launch; the time is a sum over the parts' kernels)."""
        if objective != "time" or capacity is not None:
            raise ValueError("Parts answers the time objective without a capacity: "
                             "build a Grid (napkin.cost.separable.grid_for)")
        picks = [g.best("time") for g in self.grids]
        return tuple(i for i, _ in picks), all(ok for _, ok in picks)

    def values(self, point) -> dict:
        out = {}
        for g, i in zip(self.grids, point):
            out.update(g.values(i))
        return out

    def shortfall(self, launch: bool = True) -> dict:
        out: dict = {}
        for g in self.grids:
            for lv, need in g.shortfall(launch).items():
                out[lv] = max(out.get(lv, 0.0), need)
        return out

    @functools.cached_property
    def launches(self):
        return _Launched(self)

    def slim(self) -> None:
        for g in self.grids:
            g.slim()

    def _extra(self, j: int, key, env) -> float:
        """Table ``j``'s ``key`` that no part holds, at ``env``: the constants and any term
        across parts."""
        out = self._const[j][key]
        if self._across[j][key]:
            out += value_at(sympy.Add(*self._across[j][key]), env)
        return out

    def summary(self, point, memory: bool = True) -> dict:
        """The figures at ``point``: the time is the parts' kernels' (every kernel is in a
        part), the traffic and roofline each part's share plus what no part holds;
        ``memory``: each level's peak too (worked out at the point: a search does not read
        it)."""
        c, hw, lv = self.c, self.c.hardware, self.level
        at = list(zip(self.grids, point))
        env = {**self.sizes, **self.values(point)}
        roof = {name: self._extra(1, name, env) / hw.level(name).bandwidth_bytes_per_s
                for name in c.levels[1:]}
        roof.update({f"compute:{u}": self._extra(2, u, env) for u in c.compute_times()})
        for g, i in at:
            for label, t in g.roofline(i).items():
                roof[label] += t
        peaks = {name: max((value_at(e, env) for e in c.memory_bytes_candidates[name]),
                           default=0.0) for name in c.levels[1:]} if memory else {}
        return {"time_s": sum(float(g.time[i]) for g, i in at),
                "transfers": self._extra(0, lv, env) + sum(float(g.Hv[i]) for g, i in at),
                "transfers_bytes": self._extra(1, lv, env) + sum(float(g.Hb[i]) for g, i in at),
                "memory_bytes": peaks,
                "bound_by": max(roof, key=roof.get)}


class _Launched:
    """What a search reads of a grid's launch model, for :class:`Parts`."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self.excess = sum(g.launches.excess for g in parts.grids)

    def at(self, point) -> list:
        return [k.at(0) for k in Launches.point(self.parts, point)]

    def why(self, point) -> str:
        return "; ".join(f"{k.name}: {k.why}" for k in Launches.point(self.parts, point) if k.why)

