"""Tile sizes: the canonical form H*(M) = Σ α_t·M^(−β_t), the continuous optimum, and the
integer optimum under each level's capacity and the hardware's divisibility rules.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy

from napkin.cost.grid import Grid, reference_bytes
from napkin.cost.model import Cost, CostError, cost as cost_of, sym_subs, value_at
from napkin.cost.separable import Parts, grid_for

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
    kw = {k: v for k, v in (("level", level), ("power_of_two", power_of_two),
                            ("multiples", multiples)) if v not in (None, True, {})}
    if grid is None or (isinstance(grid, Parts) and (objective != "time" or capacity)):
        grid = grid_for(c, sizes or {}, objective, capacity, **kw)
    g = grid
    level = g.level
    best, feasible = g.best(objective, capacity)
    hw = c.hardware
    cap_level = (capacity or {}).get(level, hw.level(level).capacity_bytes)
    at = g.summary(best)
    out = Tiles(values=g.values(best), objective=objective, level=level, feasible=feasible,
                transfers=at["transfers"], transfers_bytes=at["transfers_bytes"],
                memory_bytes=at["memory_bytes"], time_s=at["time_s"], bound_by=at["bound_by"],
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
