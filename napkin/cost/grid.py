"""The grid of candidate tilings: every tile's candidates, and a program priced at every point
of their product at once (numpy), the optimum among the points that launch or fit.

napkin.cost.optimize reads the optimum off it; napkin.cost.separable splits a program whose
kernels' tiles fall apart into one grid per part.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np

from napkin.cost.model import Cost, CostError, bytes_per_value, evaluate_on, value_at

def candidates(full: int, multiple: int, power_of_two: bool = True, limit: int = 64) -> list:
    """Tile sizes to try: multiple·2^k (or every multiple) up to ``full``, plus ``full``."""
    full = int(full)
    if multiple >= full:
        return [full]
    if power_of_two:
        out, v = [], multiple
        while v <= full:
            out.append(v)
            v *= 2
    else:
        out = list(range(multiple, full + 1, multiple))
        if len(out) > limit:  # keep it small: a geometric subset
            idx = sorted({round(i) for i in np.geomspace(1, len(out), limit)})
            out = [out[i - 1] for i in idx]
    if full % multiple == 0 and full not in out:
        out.append(full)
    return out


def capped(cands: list, most: int | None) -> list:
    """Candidates up to ``most`` (a profile's ``tile_max``: a TMA box's 256), the least kept
    where none is (the writer then says why it cannot take it)."""
    if most is None:
        return cands
    return [v for v in cands if v <= most] or cands[:1]


def reference_bytes(c: Cost) -> int:
    """Bytes per value used to turn a capacity in bytes into values (uniform dtype: exact)."""
    if isinstance(c.dtype, str):
        return bytes_per_value(c.dtype)
    return max(bytes_per_value(c.dtype.get(ob.name, ob.type.dtype) if isinstance(c.dtype, Mapping)
                               else ob.type.dtype) for ob in c.program.dom.inside)


# The most points a grid holds.  Tiles are named by their axis, so the kernels of a large
# program share them and its grid is their product: the transformer block's twenty kernels
# over ten tiles make 4.2 million points, one more stream a few times that, each array
# 8 bytes a point (a search holds a grid per state).  Beyond this, the tiles with the most
# candidates lose every other one (their least and their largest kept): every point left is
# still priced exactly, the optimum is found among fewer tilings.
POINTS = 1 << 22
# Where even two candidates a tile leave more points than this (8 bytes a point, an array
# each), the grid is not made: a program of that many tiles is refused, not priced
TOO_MANY = 16 * POINTS


def _thinned(cands: dict) -> dict:
    """Thin ``cands`` (tile -> its candidates) in place to at most :data:`POINTS` points;
    {tile: candidates dropped}."""
    dropped: dict = {}
    while math.prod(len(c) for c in cands.values()) > POINTS:
        name = max(cands, key=lambda k: len(cands[k]))
        c = cands[name]
        if len(c) <= 2:
            break
        kept = c[::2] + ([c[-1]] if (len(c) - 1) % 2 else [])
        dropped[name] = dropped.get(name, 0) + len(c) - len(kept)
        cands[name] = kept
    return dropped


class Grid:
    """Every candidate tiling of a program, evaluated once (numpy over the whole grid)."""

    def __init__(self, c: Cost, sizes: Mapping, *, level: str | None = None,
                 power_of_two: bool = True, multiples: Mapping | None = None,
                 divisors: bool = False):
        self.c, self.sizes = c, dict(sizes)
        self.level = level or c.main_level
        sizes = self.sizes
        self.free = free = [t for t in c.tiles if t.name not in sizes]
        self.mult, self.cands = {}, {}
        upper = {}  # each tile's largest value: its axis size, outer tiles at their largest
        for _ in range(len(free) + 1):
            for t in free:
                if t.name not in upper:
                    try:
                        upper[t.name] = value_at(c.tiles[t].full, {**sizes, **upper})
                    except CostError:
                        pass
        for t in free:
            info = c.tiles[t]
            if t.name not in upper:
                value_at(info.full, {**sizes, **upper})  # raises: names the missing size
            m = math.lcm(info.least(sizes), int((multiples or {}).get(t.name, 1)))
            self.mult[t.name] = m
            cands = capped(candidates(upper[t.name], m, power_of_two), c.hardware.tile_max)
            if divisors:  # a writer without masked tails: tiles that divide their axis
                cands = [v for v in cands if upper[t.name] % v == 0] or cands
            self.cands[t.name] = cands
        self.thinned = _thinned(self.cands)
        # the grid is the product of the tiles' candidates, point i at np.unravel_index(i,
        # shape); each tile is held as a vector along its own dimension, so an expression of
        # a few tiles is worked out on their candidates and broadcast (a program of twenty
        # kernels over ten tiles has millions of points)
        self.shape = tuple(len(self.cands[t.name]) for t in free) or (1,)
        if math.prod(self.shape) > TOO_MANY:  # (thinned to two candidates a tile, still)
            raise CostError(f"{len(free)} tiles make {math.prod(self.shape):,} tilings even "
                            f"at two candidates a tile (at most {TOO_MANY:,} are priced "
                            f"at once)")
        self.axis_of = {t: np.asarray(self.cands[t.name], dtype=float).reshape(
            [-1 if k == j else 1 for k in range(len(free))]) for j, t in enumerate(free)}
        self.n = math.prod(self.shape)
        self.mem  # noqa: B018 - worked out now: it sets mem_least, which a search reads

    # The arrays over the whole grid (the memory peaks and everything below) are worked out
    # on first use and dropped by :meth:`slim`; what a search keeps of a state is its best
    # point and the least memory of each candidate (``mem_least``).
    @functools.cached_property
    def nested_ok(self) -> np.ndarray:
        c, free = self.c, self.free
        nested = np.ones(self.shape, bool)  # a tile inside a tile of the same axis fits it
        for t in free:
            if set(c.tiles[t].full.free_symbols) & set(free):
                nested &= self.axis_of[t] <= self._ev(c.tiles[t].full)
        return nested.reshape(-1)

    @functools.cached_property
    def mem(self) -> dict:
        """Each level's peak: the largest of its candidate peaks; of each candidate only its
        least is kept (``mem_least``: a search reads those, how far a program is from
        fitting)."""
        mem, self.mem_least = {}, {}
        for lv in self.c.levels[1:]:
            peak, least = np.zeros(self.n), []
            for e in self.c.memory_bytes_candidates[lv]:
                at = self.ev(e)
                np.maximum(peak, at, out=peak)
                least.append(float(at.min()))
            mem[lv], self.mem_least[lv] = peak, least
        return mem

    @functools.cached_property
    def memsum(self) -> np.ndarray:
        return sum(self.mem.values())

    WHOLE = ("nested_ok", "mem", "memsum", "_steps", "flat", "transfer_time", "roofline_time",
             "time", "Hv", "Hb", "launches")

    def slim(self) -> None:
        """Drop the arrays over the whole grid (a large program's grid holds millions of
        points, tens of MB an array): a search keeps hundreds of evaluated states, and reads
        a state's arrays again only for the few it reports, worked out afresh."""
        for name in self.WHOLE:
            self.__dict__.pop(name, None)

    # Times and traffic are worked out on first use: a search that finds no tiling
    # fitting in memory needs only the memory.
    @functools.cached_property
    def _rooflines(self) -> list:
        """(label, seconds as an expression of the tiles, divisor) per roofline term: each
        level's bytes over its bandwidth, then each unit's compute."""
        c, hw = self.c, self.c.hardware
        return ([(lv, c.transfers_bytes[lv], hw.level(lv).bandwidth_bytes_per_s)
                 for lv in c.levels[1:]]
                + [(f"compute:{unit}", e, 1.0) for unit, e in c.compute_times().items()])

    @functools.cached_property
    def _steps(self) -> np.ndarray:
        """Tile steps of the program (the product over tiles of its extent ÷ the tile), on
        the tiles' own dimensions (broadcastable to the grid's shape)."""
        out = np.ones(())
        for t in self.free:
            out = out * evaluate_on(self.c.tiles[t].full, self.sizes, self.axis_of,
                                    None) / self.axis_of[t]
        return out

    def steps(self, points: np.ndarray) -> np.ndarray:
        """The tile steps at ``points`` (flat indices): of points the roofline prices alike,
        the one with fewer, larger steps wins (each step has overheads the roofline does not
        price).  Read where asked, not spread over a grid of millions."""
        points = np.asarray(points, dtype=np.intp)
        whole = np.broadcast_to(self._steps, self.shape)
        if not self.shape:
            return np.full(points.shape, float(whole))
        return whole[np.unravel_index(points, self.shape)]

    @functools.cached_property
    def flat(self) -> list:
        """Each free tile's value at every point (for pictures: a search reads the grid's
        expressions, worked out on the tiles' own dimensions)."""
        return [np.broadcast_to(self.axis_of[t], self.shape).reshape(-1) for t in self.free]

    @property
    def labels(self) -> list:
        return [label for label, _, _ in self._rooflines]

    @functools.cached_property
    def transfer_time(self) -> np.ndarray:
        return sum((self.ev(e) / bw for _, e, bw in self._rooflines[:len(self.c.levels) - 1]),
                   np.zeros(()))

    @functools.cached_property
    def launches(self):
        """The launch model at every point (napkin.cost.launch), for a profile that has
        one; None for a roofline-only profile."""
        from napkin.cost.launch import Launches, modelled
        return Launches(self) if modelled(self.c.hardware) else None

    @functools.cached_property
    def time(self) -> np.ndarray:
        """Seconds at every point: the launch model's where the profile has one (each
        kernel's blocks, waves and steps), else the roofline."""
        if self.launches is not None:
            return self.launches.time
        return self.roofline_time

    @functools.cached_property
    def roofline_time(self) -> np.ndarray:
        """The roofline's seconds at every point: its slowest level or unit."""
        return functools.reduce(np.maximum, (self.ev(e) / bw for _, e, bw in self._rooflines))

    def roofline(self, i: int) -> dict:
        """Point ``i``'s roofline: {a level's name or ``compute:<unit>``: seconds}, worked
        out at that point alone (not over a grid of millions for one point's figures)."""
        env = {**self.sizes, **self.values(i)}
        return {label: value_at(e, env) / bw for label, e, bw in self._rooflines}

    def bound_by(self, i: int) -> str:
        """What bounds point ``i``'s roofline: a level's transfers or a unit's compute."""
        roof = self.roofline(i)
        return max(roof, key=roof.get)

    @functools.cached_property
    def Hv(self) -> np.ndarray:
        return self.ev(self.c.transfers[self.level])

    @functools.cached_property
    def Hb(self) -> np.ndarray:
        return self.ev(self.c.transfers_bytes[self.level])

    def ev(self, expr) -> np.ndarray:
        return self._ev(expr).reshape(-1)

    def _ev(self, expr) -> np.ndarray:
        return evaluate_on(expr, self.sizes, self.axis_of, self.shape)

    def feasible(self, capacity: Mapping | None = None, launch: bool = True) -> np.ndarray:
        """Points that run.  Tiles nest; with ``launch`` and a profile that has a launch
        model, every kernel launches within a block's shared memory and the threads'
        registers; otherwise (the paper's setting) every level's peak fits its capacity.
        A ``capacity`` given here binds either way."""
        ok = self.nested_ok.copy()
        launches = self.launches if launch else None
        if launches is not None:  # a point that spills runs, and is priced so; it is
            # chosen only where every point of the program spills
            ok &= next((m for m in (launches.fits, launches.spill_least) if (ok & m).any()),
                       launches.runs)
        for lv in self.c.levels[1:]:
            cap = (capacity or {}).get(lv)
            if cap is None and launches is None:
                cap = self.c.hardware.level(lv).capacity_bytes
            if cap is not None:
                ok &= self.mem[lv] <= cap
        return ok

    def shortfall(self, launch: bool = True) -> dict:
        """What the smallest point needs, per level: {level: bytes} (its peak, or with a
        launch model the block's shared memory at one stage)."""
        if launch and self.launches is not None:
            return self.launches.shortfall()
        return {lv: float(m.min()) for lv, m in self.mem.items()}

    def best(self, objective: str = "time", capacity: Mapping | None = None):
        """(index, feasible): the optimum among the points that fit (else the smallest)."""
        order, feasible = self.ranked(objective, capacity)
        return int(order[0]), feasible

    def ranked(self, objective: str = "time", capacity: Mapping | None = None):
        """(indices, feasible): the points that fit, best first (else the smallest alone) —
        what a backend walks when its writer may still refuse the model's optimum."""
        # the paper's problem (least transfers within each level's capacity) is priced
        # without the launch model; time is the GPU's, launch model included
        ok = self.feasible(capacity, launch=objective == "time")
        if not ok.any():
            return np.array([int(np.argmin(self.memsum))]), False
        pick = np.where(ok)[0]
        prim, sec = ((self.time, self.transfer_time) if objective == "time"
                     else (self.Hv, self.time))
        def rank(v, within=1e-9):  # equal up to rounding noise
            r = v / max(v.min(), 1e-300)
            return np.where(r <= 1 + within, 1.0, np.round(r, 9))
        # points within TIED of the least time tie: the model cannot tell them apart, and
        # of those the ones that spill least, then the fewer, larger steps win (a block of
        # one row moves too few bytes at a time to keep the memory busy, which the
        # roofline does not see)
        pr = rank(prim[pick], TIED if objective == "time" else 1e-9)
        spilled = (self.launches.spilled[pick] if objective == "time" and
                   self.launches is not None else np.zeros(len(pick)))
        order = np.lexsort((self.memsum[pick], self.steps(pick), rank(sec[pick]), spilled, pr))
        return pick[order], True

    def summary(self, i: int, memory: bool = True) -> dict:
        """The figures at point ``i`` (what :class:`Tiles` and a search's state record;
        ``memory``: each level's peak too)."""
        env = {**self.sizes, **self.values(i)}
        return {"time_s": float(self.time[i]),
                "transfers": value_at(self.c.transfers[self.level], env),
                "transfers_bytes": float(self.Hb[i]),
                "memory_bytes": ({lv: float(m[i]) for lv, m in self.mem.items()} if memory
                                 else {}),
                "bound_by": self.bound_by(i)}

    def values(self, i: int) -> dict:
        at = np.unravel_index(int(i), self.shape) if self.free else ()
        out = {t.name: int(self.cands[t.name][k]) for t, k in zip(self.free, at)}
        out.update({t.name: int(self.sizes[t.name]) for t in self.c.tiles if t.name in self.sizes})
        return out


TIED = 1e-3  # relative: modelled times this close are one time
