"""Tile sizes: the canonical form H*(M) = Σ α_t·M^(−β_t), the continuous optimum, and the
integer optimum under each level's capacity and the hardware's divisibility rules.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import sympy

from napkin.cost.model import (Cost, CostError, bytes_per_value, cost as cost_of, evaluate_on,
                               sym_subs, value_at)

M_SYM = sympy.Symbol("M", positive=True)
ZERO = sympy.Integer(0)


# --------------------------------------------------------------------------- canonical form
@dataclass(frozen=True)
class Canonical:
    """H*(M) at one level: the least transfers reachable with on-chip memory M, for large M.

    ``terms``: [(α_t, β_t)], β = 0 first (traffic no tiling removes: compulsory reads and
    writes), then by β.  ``tiles``: the continuous optimum of every tile symbol as a function
    of M (symbols the transfers do not depend on sit at their minimum, 1).  ``memory``: the
    leading part of the memory model the optimum saturates.  ``exact``: False when the
    variable terms of H have different degrees (then the split into terms is approximate).
    """
    level: str
    unit: str
    terms: tuple
    tiles: dict
    memory: sympy.Expr
    exact: bool = True

    @property
    def H(self) -> sympy.Expr:
        return sum((a * M_SYM ** (-b) for a, b in self.terms), ZERO)

    @property
    def alpha_beta(self) -> list:
        return [(a, b) for a, b in self.terms if b != 0]

    def to_json(self, sizes: Mapping | None = None) -> list:
        out = []
        for a, b in self.terms:
            row = {"alpha_expr": str(a), "beta": str(b), "beta_value": float(b)}
            if sizes is not None:
                try:
                    row["alpha"] = value_at(a, sizes)
                except CostError:
                    pass
            out.append(row)
        return out


def _dominant(cands: list, tiles) -> sympy.Expr:
    """The memory candidate that grows fastest in the tiles, then the largest at a sample point."""
    if len(cands) == 1:
        return cands[0]

    def key(e):
        e = sympy.expand(e)
        deg = sympy.Poly(e, *tiles).total_degree() if tiles else 0
        sample = e.subs({s: 1024 for s in e.free_symbols})
        return (deg, float(sample))
    return max(cands, key=key)


def _degree(term, syms) -> sympy.Expr:
    powers = term.as_powers_dict()
    return sum((powers.get(s, 0) for s in syms), ZERO)


@functools.lru_cache(maxsize=256)
def _solve_unit(Hv: sympy.Expr, Mlead: sympy.Expr, syms: tuple):
    """argmin Hv subject to Mlead = 1 (positive reals): {sym: value}."""
    reals = {s: sympy.Symbol(f"_{s.name}", positive=True) for s in syms}
    back = {v: k for k, v in reals.items()}
    h, m = Hv.xreplace(reals), Mlead.xreplace(reals)
    xs = [reals[s] for s in syms]
    if len(xs) == 1:
        sols = [{xs[0]: r} for r in sympy.solve(sympy.Eq(m, 1), xs[0])]
    else:
        lam = sympy.Symbol("_lam")
        eqs = [sympy.diff(h, x) - lam * sympy.diff(m, x) for x in xs] + [m - 1]
        sols = sympy.solve(eqs, xs + [lam], dict=True)
    best = None
    for sol in sols:
        if any(x not in sol for x in xs):
            continue
        vals = [sol[x] for x in xs]
        probe = {s: sympy.Integer(7) for e in vals for s in e.free_symbols}
        if not all(sympy.N(v.subs(probe)).is_positive for v in vals):
            continue
        hv = sympy.simplify(h.subs(sol))
        score = float(sympy.N(hv.subs({s: 7 for s in hv.free_symbols})))
        if best is None or score < best[0]:
            best = (score, {back[x]: sympy.simplify(sol[x]) for x in xs}, hv)
    if best is None:
        raise CostError(f"no positive optimum of {Hv} subject to {Mlead} = 1")
    return best[1], best[2]


def canonical_form(c: Cost, level: str | None = None, unit: str = "values") -> Canonical:
    """Derive H*(M) = Σ α_t·M^(−β_t) from the cost model of a program.

    Method: symbols the transfers do not depend on (stream chunks, extra group axes) take
    their minimum (1); the memory keeps its leading homogeneous part (degree D in the
    remaining tiles); each transfer term of degree −k scales as M^(−k/D) along the optimal
    ray, so β = k/D, and α follows from the Lagrange conditions at M = 1.
    """
    level = level or c.main_level
    if unit not in ("values", "bytes"):
        raise CostError(f"unit must be 'values' or 'bytes', got {unit!r}")
    H = (c.transfers if unit == "values" else c.transfers_bytes)[level]
    cands = (c.memory_candidates if unit == "values" else c.memory_bytes_candidates)[level]
    tiles = list(c.tiles)
    TH = [t for t in tiles if t in H.free_symbols]
    TM = [t for t in tiles if t not in TH]
    mem = _dominant(cands, TH)
    mins = {t: sympy.Integer(1) for t in TM}
    Ms = sympy.expand(sympy.sympify(mem).subs(mins))
    if not TH:
        return Canonical(level, unit, ((sympy.expand(H), sympy.Integer(0)),), dict(mins), Ms)
    poly = sympy.Poly(Ms, *TH)
    D = poly.total_degree()
    if D <= 0:
        raise CostError(f"memory {mem} at {level} does not grow with the tiles {TH}")
    Mlead = sympy.expand(sum((coef * sympy.Mul(*(t ** e for t, e in zip(TH, mon)))
                              for mon, coef in poly.terms() if sum(mon) == D), ZERO))
    const, groups = ZERO, {}
    for term in sympy.Add.make_args(sympy.expand(H)):
        k = -_degree(term, TH)
        if k == 0:
            const += term
        else:
            groups[k] = groups.get(k, ZERO) + term
    exact = len(groups) == 1
    kmin = min(groups)
    unit_tiles, _ = _solve_unit(groups[kmin], Mlead, tuple(TH))
    terms = [(sympy.factor(const), sympy.Integer(0))] if const != 0 else []
    for k in sorted(groups):
        alpha = sympy.factor(sympy.simplify(groups[k].subs(unit_tiles)))
        terms.append((alpha, sympy.Rational(k) / D))
    tile_exprs = {t: sympy.simplify(v * M_SYM ** sympy.Rational(1, D))
                  for t, v in unit_tiles.items()}
    tile_exprs.update(mins)
    return Canonical(level, unit, tuple(terms), tile_exprs, Mlead, exact)


# --------------------------------------------------------------------------- the optimum
@dataclass
class Tiles:
    """The chosen tile sizes of a program on a hardware profile, with the figures behind them.

    Integer optimum: ``values`` ({"g_q": 128, ...}) minimising ``objective`` over the
    candidate grid (multiples of each tile's divisibility LCM, times powers of two, up to the
    axis size) among the points that fit every level; its ``transfers`` (values at the main
    level), ``transfers_bytes``, ``memory_bytes`` per level, ``time_s``, ``bound_by``.
    Continuous optimum: ``continuous`` tiles (floats, along the optimal ray, fitted to the
    capacity with every other tile at its minimum multiple), ``continuous_expr`` (functions of
    M), ``transfers_continuous`` (values).  Canonical form: ``canonical``; lower bound:
    ``lower_bound`` (values) and ``lower_bound_ratio`` = transfers / lower_bound.
    """
    values: dict
    objective: str
    level: str
    feasible: bool
    transfers: float
    transfers_bytes: float
    memory_bytes: dict
    time_s: float
    bound_by: str | None
    capacity_values: float
    multiples: dict
    candidates: dict
    evaluated: int
    # the continuous optimum, the canonical form and the bounds: worked out when first read
    # (sympy: a fifth of a search's time went to the best program's), see ``_fill``
    continuous: dict = field(init=False, repr=False, compare=False)
    continuous_expr: dict = field(init=False, repr=False, compare=False)
    transfers_continuous: float | None = field(init=False, repr=False, compare=False)
    canonical: Canonical | None = field(init=False, repr=False, compare=False)
    lower_bound: float | None = field(init=False, repr=False, compare=False)
    lower_bound_expr: sympy.Expr | None = field(init=False, repr=False, compare=False)
    lower_bound_ratio: float | None = field(init=False, repr=False, compare=False)
    lower_bound_ratio_continuous: float | None = field(init=False, repr=False, compare=False)
    launch: list = field(default_factory=list)   # per kernel: warps, stages, smem, blocks...
    why: str = ""              # infeasible: the budget the chosen point breaks

    def __getattr__(self, name):  # only for attributes not set: the lazy continuous ones
        if name in _CONTINUOUS and "_fill" in self.__dict__:
            fill = self.__dict__.pop("_fill")
            for k, v in _CONTINUOUS.items():
                self.__dict__.setdefault(k, v() if callable(v) else v)
            fill(self)
            return self.__dict__[name]
        if name in _CONTINUOUS:
            return _CONTINUOUS[name]() if callable(_CONTINUOUS[name]) else _CONTINUOUS[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self):  # pickled filled: the deferred work is a closure
        if "_fill" in self.__dict__:
            self.continuous  # noqa: B018
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def to_json(self, sizes: Mapping | None = None) -> dict:
        return {
            "values": dict(self.values), "objective": self.objective, "level": self.level,
            "feasible": self.feasible, "transfers": self.transfers,
            "transfers_bytes": self.transfers_bytes, "memory_bytes": dict(self.memory_bytes),
            "time_s": self.time_s, "bound_by": self.bound_by,
            "capacity_values": self.capacity_values, "multiples": dict(self.multiples),
            "evaluated": self.evaluated,
            "continuous": dict(self.continuous),
            "continuous_expr": {k: str(v) for k, v in self.continuous_expr.items()},
            "transfers_continuous": self.transfers_continuous,
            "alpha_beta": self.canonical.to_json(sizes) if self.canonical else None,
            "lower_bound": self.lower_bound,
            "lower_bound_expr": (None if self.lower_bound_expr is None
                                 else str(self.lower_bound_expr)),
            "lower_bound_ratio": self.lower_bound_ratio,
            "lower_bound_ratio_continuous": self.lower_bound_ratio_continuous,
            "launch": list(self.launch),
        }


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
                 power_of_two: bool = True, multiples: Mapping | None = None):
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
            self.cands[t.name] = candidates(upper[t.name], m, power_of_two)
        self.thinned = _thinned(self.cands)
        # the grid is the product of the tiles' candidates, point i at np.unravel_index(i,
        # shape); each tile is held as a vector along its own dimension, so an expression of
        # a few tiles is worked out on their candidates and broadcast (a program of twenty
        # kernels over ten tiles has millions of points)
        self.shape = tuple(len(self.cands[t.name]) for t in free) or (1,)
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

    WHOLE = ("nested_ok", "mem", "memsum", "_times", "steps", "flat", "transfer_time", "time",
             "Hv", "Hb", "launches")

    def slim(self) -> None:
        """Drop the arrays over the whole grid (a large program's grid holds millions of
        points, tens of MB an array): a search keeps hundreds of evaluated states, and reads
        a state's arrays again only for the few it reports, worked out afresh."""
        for name in self.WHOLE:
            self.__dict__.pop(name, None)

    # Times and traffic are worked out on first use: a search that finds no tiling
    # fitting in memory needs only the memory.
    @functools.cached_property
    def _times(self):
        c, hw = self.c, self.c.hardware
        tb = c.transfers_bytes
        times = [self.ev(tb[lv]) / hw.level(lv).bandwidth_bytes_per_s for lv in c.levels[1:]]
        labels = list(c.levels[1:])
        for unit, e in c.compute_times().items():
            times.append(self.ev(e))
            labels.append(f"compute:{unit}")
        return np.stack(times), labels

    @functools.cached_property
    def steps(self) -> np.ndarray:
        """Tile steps of the program (the product over tiles of its extent ÷ the tile): of
        points the roofline prices alike, the one with fewer, larger steps wins (each step
        has overheads the roofline does not price)."""
        out = np.ones(())  # (on the tiles' own dimensions, broadcast once at the end)
        for t in self.free:
            out = out * evaluate_on(self.c.tiles[t].full, self.sizes, self.axis_of,
                                    None) / self.axis_of[t]
        return np.broadcast_to(out, self.shape).reshape(-1)

    @functools.cached_property
    def flat(self) -> list:
        """Each free tile's value at every point (for pictures: a search reads the grid's
        expressions, worked out on the tiles' own dimensions)."""
        return [np.broadcast_to(self.axis_of[t], self.shape).reshape(-1) for t in self.free]

    @property
    def labels(self) -> list:
        return self._times[1]

    @functools.cached_property
    def transfer_time(self) -> np.ndarray:
        return self._times[0][:len(self.c.levels) - 1].sum(axis=0)

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
        return self._times[0].max(axis=0)

    def bound_by(self, i: int) -> str:
        """What bounds point ``i``'s roofline: a level's transfers or a unit's compute."""
        return self.labels[int(self._times[0][:, i].argmax())]

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
        # the paper's problem (least transfers within each level's capacity) is priced
        # without the launch model; time is the GPU's, launch model included
        ok = self.feasible(capacity, launch=objective == "time")
        if not ok.any():
            return int(np.argmin(self.memsum)), False
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
        order = np.lexsort((self.memsum[pick], self.steps[pick], rank(sec[pick]), spilled, pr))
        return int(pick[order[0]]), True

    def values(self, i: int) -> dict:
        at = np.unravel_index(int(i), self.shape) if self.free else ()
        out = {t.name: int(self.cands[t.name][k]) for t, k in zip(self.free, at)}
        out.update({t.name: int(self.sizes[t.name]) for t in self.c.tiles if t.name in self.sizes})
        return out


TIED = 1e-3  # relative: modelled times this close are one time

_CONTINUOUS = {"continuous": dict, "continuous_expr": dict, "transfers_continuous": None,
               "canonical": None, "lower_bound": None, "lower_bound_expr": None,
               "lower_bound_ratio": None, "lower_bound_ratio_continuous": None}


def optimize_tiles(program, hardware=None, sizes: Mapping | None = None, dtype=None, *,
                   objective: str = "time", level: str | None = None,
                   power_of_two: bool = True, capacity: Mapping | None = None,
                   multiples: Mapping | None = None, intermediates: bool = True,
                   grid: Grid | None = None) -> Tiles:
    """Choose tile sizes for ``program`` (a diagram or a :class:`Cost`) on ``hardware``.

    ``sizes``: axis sizes by name ({"q": 4096, ...}); tile symbols given here stay fixed.
    ``objective``: "time" (roofline; ties broken by the summed transfer time of all levels,
    then by fewer tile steps, then memory) or "transfers"
    (values moved at ``level``, the main level by default; ties broken by time, then memory).
    ``capacity``: bytes per level overriding the profile; ``multiples``: extra divisibility
    {tile name: multiple}, combined by LCM with what the model derived.
    """
    c = program if isinstance(program, Cost) else cost_of(program, hardware, dtype,
                                                         intermediates=intermediates)
    if objective not in ("time", "transfers"):
        raise CostError(f"objective must be 'time' or 'transfers', got {objective!r}")
    g = grid or Grid(c, sizes or {}, level=level, power_of_two=power_of_two, multiples=multiples)
    level = g.level
    best, feasible = g.best(objective, capacity)
    hw = c.hardware
    cap_level = (capacity or {}).get(level, hw.level(level).capacity_bytes)
    out = Tiles(values=g.values(best), objective=objective, level=level, feasible=feasible,
                transfers=float(g.Hv[best]), transfers_bytes=float(g.Hb[best]),
                memory_bytes={lv: float(g.mem[lv][best]) for lv in g.mem},
                time_s=float(g.time[best]), bound_by=g.bound_by(best),
                capacity_values=(cap_level or math.inf) / reference_bytes(c), multiples=dict(g.mult),
                candidates=dict(g.cands), evaluated=int(g.n),
                launch=g.launches.at(best) if g.launches is not None else [],
                why=g.launches.why(best) if g.launches is not None else "")
    sizes_at, mult = g.sizes, dict(g.mult)  # not the grid itself: it is large
    out.__dict__["_fill"] = lambda t: _continuous(c, t, sizes_at, level, cap_level, mult)
    return out


def _continuous(c: Cost, out: Tiles, sizes, level, cap_bytes, mult):
    """Fill the continuous optimum, canonical form and lower-bound ratios of ``out``."""
    from napkin.cost.bounds import lower_bound
    try:
        canon = canonical_form(c, level, "values")
    except (CostError, NotImplementedError, ValueError, TypeError) as e:  # pragma: no cover
        out.canonical = None
        out.continuous_expr = {"error": str(e)}
        return
    out.canonical = canon
    out.continuous_expr = {t.name: e for t, e in canon.tiles.items()}
    fixed = {k: v for k, v in sizes.items()}
    if cap_bytes is None:
        return
    # the optimal ray g = ĝ·λ, other tiles at their minimum multiple; fit λ to the capacity
    ray = {}
    for t, e in canon.tiles.items():
        if t.name in fixed:
            continue
        if M_SYM in e.free_symbols:
            ray[t] = sym_subs(e.subs(M_SYM, 1), fixed)
        else:
            ray[t] = None
    mem_b = c.memory_bytes_candidates[level]

    def point(lam):
        p = dict(fixed)
        for t, e in ray.items():
            p[t.name] = float(e) * lam if e is not None else float(mult.get(t.name, 1))
        return p

    def used(lam):
        p = point(lam)
        return max(value_at(e, p) for e in mem_b)
    if ray and any(e is not None for e in ray.values()):
        lo, hi = 1e-12, 1.0
        while used(hi) < cap_bytes and hi < 1e30:
            hi *= 2
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if used(mid) <= cap_bytes else (lo, mid)
            if hi / lo < 1 + 1e-12:
                break
        p = point(lo)
        out.continuous = {t.name: p[t.name] for t in ray}
        out.transfers_continuous = value_at(c.transfers[level], p)
    lb = lower_bound(c, M_SYM)
    out.lower_bound_expr = lb
    try:
        lbv = value_at(lb.subs(M_SYM, out.capacity_values), sizes)
    except CostError:
        return
    out.lower_bound = lbv
    if lbv > 0:
        out.lower_bound_ratio = out.transfers / lbv
        if out.transfers_continuous is not None:
            out.lower_bound_ratio_continuous = out.transfers_continuous / lbv


def optimum_curve(c: Cost, sizes: Mapping, capacities_bytes, *, level: str | None = None,
                  objective: str = "transfers", power_of_two: bool = True) -> list:
    """Integer-optimal transfers (values at ``level``) for each capacity (bytes) of ``level``,
    other levels at the profile's capacities: [(capacity_bytes, transfers or nan, tiles)]."""
    g = Grid(c, sizes, level=level, power_of_two=power_of_two)
    out = []
    for cap in capacities_bytes:
        i, ok = g.best(objective, {g.level: cap})
        out.append((cap, float(g.Hv[i]) if ok else float("nan"), g.values(i)))
    return out
