"""The cost functor: transfers, peak memory, FLOPs and roofline time of a streamed program.

See the package docstring (``napkin.cost``) for the conventions.  The cost is a fold over the
program's schedule (:mod:`napkin.schedule`, the one walk that decides what moves where and
what is live when): transfers are its loads and stores times their loops' trip counts, FLOPs
its steps', memory its peaks.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import sympy

from napkin.core.errors import NapkinError
from napkin.hardware import Hardware, HardwareError
from napkin.core.memo import IdentityMemo
from napkin.schedule import (  # noqa: F401  (re-exported: the cost model's vocabulary)
    ContractionRecord, Loop, Move, Step, TileInfo, as_max, build, bytes_per_value, prune,
)

ZERO = sympy.Integer(0)


class CostError(NapkinError):
    """The cost model cannot price a program (one-line message)."""


def _peak_num(cands, sizes: Mapping) -> float:
    return max(value_at(e, sizes) for e in cands)


def sym_subs(expr, sizes: Mapping):
    expr = sympy.sympify(expr)
    try:
        return _subs_cached(expr, tuple(sorted(sizes.items())))
    except TypeError:  # unhashable sizes: no memo
        return _subs(expr, sizes)


def _subs(expr, sizes: Mapping):
    # xreplace: sizes replace whole symbols, which needs none of subs' pattern matching
    return expr.xreplace({s: sympy.sympify(sizes[s.name]) for s in expr.free_symbols
                          if s.name in sizes})


@functools.lru_cache(maxsize=65536)
def _subs_cached(expr, items: tuple):
    return _subs(expr, dict(items))


def value_at(expr, sizes: Mapping) -> float:
    """The value of a size, cost or time expression at ``sizes`` (axis and tile sizes by
    name); CostError naming the sizes it lacks."""
    v = sym_subs(expr, sizes)
    if v.free_symbols:
        raise CostError(f"cannot evaluate {expr}: no value for "
                        f"{', '.join(sorted(map(str, v.free_symbols)))}")
    return float(v)


@dataclass
class Cost:
    """Symbolic cost of a program on a hardware profile (see ``napkin.cost`` for conventions).

    Per level (keyed by level name; the top level has no transfers):
      loads / stores[level][array]       values moved into / out of ``level`` from its parent
      loads_bytes / stores_bytes         the same in bytes
      memory[level], memory_bytes[level] peak live values / bytes per instance of ``level``
    FLOPs: ``flops`` (total), ``flops_by_unit`` {"tensor:<dtype>", "vector", "sfu"}.
    Time: ``time_s`` {"<level>": bytes / bandwidth into it, "compute": ..., "total": Max}.
    """
    program: object
    hardware: Hardware
    dtype: object
    levels: tuple
    loads: dict
    stores: dict
    loads_bytes: dict
    stores_bytes: dict
    memory: dict
    memory_bytes: dict
    memory_candidates: dict      # level -> list of candidate expressions (values)
    memory_bytes_candidates: dict
    flops_by_unit: dict
    tiles: dict                  # Symbol -> TileInfo
    contractions: list
    streams: list                # (rule, axis) of every stream
    io_values: sympy.Expr        # compulsory traffic: program inputs + outputs, values
    intermediates: bool = True
    schedule: object = None      # the napkin.schedule.Schedule it folds

    # -- derived ------------------------------------------------------------------------
    @functools.cached_property
    def transfers(self) -> dict:
        """Values moved into or out of each level below the top (loads + stores)."""
        return {lv: sympy.expand(sum(self.loads[lv].values(), ZERO)
                                 + sum(self.stores[lv].values(), ZERO))
                for lv in self.levels[1:]}

    @functools.cached_property
    def transfers_bytes(self) -> dict:
        return {lv: sympy.expand(sum(self.loads_bytes[lv].values(), ZERO)
                                 + sum(self.stores_bytes[lv].values(), ZERO))
                for lv in self.levels[1:]}

    @functools.cached_property
    def flops(self) -> sympy.Expr:
        return sympy.expand(sum(self.flops_by_unit.values(), ZERO))

    @property
    def main_level(self) -> str:
        """The level the two-level read-off is about: the shallowest level below the top that
        holds data (its memory is not zero)."""
        for lv in self.levels[1:]:
            if self.memory[lv] != 0:
                return lv
        return self.levels[1]

    def compute_times(self) -> dict:
        return compute_times(self.flops_by_unit, self.hardware)

    @functools.cached_property
    def kernels(self) -> list:
        """Every kernel of the program (napkin.schedule.resources.kernels), found once."""
        from napkin.schedule.resources import kernels
        return kernels(self.schedule)

    @functools.cached_property
    def time_s(self) -> dict:
        """Roofline: per level, bytes / bandwidth into it; compute = max over units (tensor
        cores, vector ALUs, SFU run concurrently); total = max of all (perfect overlap)."""
        out = {}
        tb = self.transfers_bytes
        for lv in self.levels[1:]:
            bw = self.hardware.level(lv).bandwidth_bytes_per_s
            out[lv] = tb[lv] / sympy.Float(bw)
        ct = self.compute_times()
        units = [v for v in ct.values() if v != 0]
        out["compute"] = (sympy.Max(*units, evaluate=False) if len(units) > 1
                          else units[0] if units else ZERO)
        parts = [v for v in out.values() if v != 0]
        out["total"] = (sympy.Max(*parts, evaluate=False) if len(parts) > 1
                        else parts[0] if parts else ZERO)
        out["serial"] = sum((out[lv] for lv in self.levels[1:]), ZERO) + out["compute"]
        return out

    @property
    def tile_symbols(self) -> list:
        return list(self.tiles)

    # -- numbers ------------------------------------------------------------------------
    def evaluate(self, sizes: Mapping) -> dict:
        """Numbers for given axis and tile sizes ({"q": 4096, "g_q": 128, ...})."""
        ct = {k: value_at(v, sizes) for k, v in self.compute_times().items()}
        times = {lv: value_at(self.time_s[lv], sizes) for lv in self.levels[1:]}
        times["compute"] = max(ct.values(), default=0.0)
        bound = max(times, key=times.get)
        if bound == "compute":
            bound = f"compute:{max(ct, key=ct.get)}"
        total = max(times.values())
        times["serial"] = sum(times.values())
        times["total"] = total
        return {
            "transfers": {lv: value_at(e, sizes) for lv, e in self.transfers.items()},
            "transfers_bytes": {lv: value_at(e, sizes) for lv, e in self.transfers_bytes.items()},
            "memory": {lv: _peak_num(self.memory_candidates[lv], sizes) for lv in self.levels},
            "memory_bytes": {lv: _peak_num(self.memory_bytes_candidates[lv], sizes)
                             for lv in self.levels},
            "flops": value_at(self.flops, sizes),
            "time_s": times,
            "bound_by": bound,
        }

    def fits(self, sizes: Mapping, capacity: Mapping | None = None) -> dict:
        out = {}
        for lv in self.levels[1:]:
            cap = (capacity or {}).get(lv, self.hardware.level(lv).capacity_bytes)
            out[lv] = cap is None or _peak_num(self.memory_bytes_candidates[lv], sizes) <= cap
        return out

def compute_times(flops_by_unit: Mapping, hw: Hardware) -> dict:
    """Seconds per unit for FLOPs by unit: tensor cores at their dtype's peak (or the vector
    units' where the profile has none for it), vector ALUs, SFU (folded into the vector
    units when the profile states no exp throughput)."""
    tensor = ZERO
    for unit, f in flops_by_unit.items():
        if unit.startswith("tensor:"):
            dt = unit.split(":", 1)[1]
            try:
                peak = hw.peak_flops(dt)
            except HardwareError:
                peak = hw.vector_flops_per_s or hw.peak_flops("f32")
            tensor += f / sympy.Float(peak)
    vec_peak = hw.vector_flops_per_s
    vector = flops_by_unit.get("vector", ZERO)
    sfu = flops_by_unit.get("sfu", ZERO)
    if hw.exp_per_s is None:
        vector, sfu = vector + sfu, ZERO
    return {"tensor": tensor,
            "vector": vector / sympy.Float(vec_peak) if vec_peak else ZERO,
            "sfu": sfu / sympy.Float(hw.exp_per_s) if hw.exp_per_s else ZERO}


# --------------------------------------------------------------------------- the fold
_FOLDS = IdentityMemo(20000)  # a shared kernel's totals, folded once


@dataclass
class _Totals:
    """Loads and stores per level and array (values, bytes) and FLOPs per unit."""
    loads: dict
    stores: dict
    loads_b: dict
    stores_b: dict
    flops: dict

    @classmethod
    def empty(cls) -> _Totals:
        return cls(*(defaultdict(lambda: defaultdict(lambda: ZERO)) for _ in range(4)),
                   defaultdict(lambda: ZERO))

    def add(self, other: _Totals, times=1):
        for mine, theirs in ((self.loads, other.loads), (self.stores, other.stores),
                             (self.loads_b, other.loads_b), (self.stores_b, other.stores_b)):
            for lv, table in theirs.items():
                for name, v in table.items():
                    mine[lv][name] += v * times
        for unit, f in other.flops.items():
            self.flops[unit] += f * times


def fold(loop: Loop) -> _Totals:
    """Totals of one execution of ``loop``'s body (its nested loops times their trips);
    memoised for kernels, which programs share."""
    if loop.kind == "kernel" or (loop.kind == "group" and loop.parallel):
        return _FOLDS.get((loop,), lambda: _fold_items(loop))
    return _fold_items(loop)


def _fold_items(loop: Loop) -> _Totals:
    t = _Totals.empty()
    for it in loop.items:
        if isinstance(it, Move):
            tv, tb = (t.loads, t.loads_b) if it.kind == "load" else (t.stores, t.stores_b)
            for lv in it.levels:
                tv[lv][it.array] += it.values
                tb[lv][it.array] += it.bytes
        elif isinstance(it, Step):
            for unit, f in it.flops.items():
                t.flops[unit] += f
        elif isinstance(it, Loop):
            t.add(fold(it), it.trips)
    return t


def cost(program, hardware, dtype=None, *, intermediates: bool = True) -> Cost:
    """The symbolic cost of ``program`` (a diagram, streamed or not) on ``hardware``.

    ``hardware``: a Hardware or a profile name ("h100", "h200", "a100", a TOML path).
    ``dtype``: None = every array's own dtype (accumulators stay f32 as the rules build them);
    a string = every array, accumulators included, priced at that dtype (the paper's single
    q bytes per value); a mapping {array name: dtype} = those arrays at those dtypes.
    ``intermediates``: count values produced inside a body (scores, partial products) in the
    peak memory (default); False = only inputs, chunks, state and outputs (the paper's count).
    """
    s = build(program, hardware, dtype, intermediates=intermediates)
    t = fold(s.root)
    names = s.levels
    memory, memory_b, cand, cand_b = {}, {}, {}, {}
    for lv in names:
        cand[lv], cand_b[lv] = s.memory[lv]
        memory[lv], memory_b[lv] = as_max(cand[lv]), as_max(cand_b[lv])
    io = sum((ob.type.numel for ob in list(program.dom.inside) + list(program.cod.inside)), ZERO)
    return Cost(
        program=program, hardware=s.hardware, dtype=dtype, levels=names,
        loads={lv: dict(t.loads.get(lv, {})) for lv in names},
        stores={lv: dict(t.stores.get(lv, {})) for lv in names},
        loads_bytes={lv: dict(t.loads_b.get(lv, {})) for lv in names},
        stores_bytes={lv: dict(t.stores_b.get(lv, {})) for lv in names},
        memory=memory, memory_bytes=memory_b, memory_candidates=cand,
        memory_bytes_candidates=cand_b,
        flops_by_unit={k: sympy.expand(v) for k, v in t.flops.items()},
        tiles=s.tiles, contractions=s.contractions, streams=s.streams,
        io_values=sympy.expand(io), intermediates=intermediates, schedule=s,
    )


@functools.lru_cache(maxsize=4096)
def _lambdified(free: tuple, expr):
    """Compiled numpy function of an expression (states of a search share many)."""
    return sympy.lambdify(free, expr, "numpy")


def evaluate_on(expr, sizes: Mapping, axis_of: Mapping, n) -> np.ndarray:
    """``expr`` at every one of ``n`` tile points (a count, a grid's shape, or None: the
    shape its terms broadcast to): sizes substituted, each free tile taken from ``axis_of``
    (its value at every point, or a vector along its own dimension of the grid, which numpy
    broadcasts)."""
    n = n if isinstance(n, tuple) or n is None else (n,)
    e = sym_subs(expr, sizes)
    missing = e.free_symbols - set(axis_of)
    if missing:
        raise CostError(f"no size for {', '.join(sorted(map(str, missing)))} "
                        f"(give it in sizes)")
    if not (e.free_symbols & set(axis_of)):
        return np.full(n or (), float(e))
    # term by term: a program's total is a sum over its kernels, and the search
    # meets the same kernels in state after state (each term compiled once)
    # (on a grid, each term on its own few tiles' dimensions, combined at the end)
    terms = e.args if isinstance(e, sympy.Add) else (e,)
    parts = []
    for term in terms:
        syms = tuple(sorted(term.free_symbols, key=str))  # its own: a key states share
        parts.append(np.asarray(_lambdified(syms, term)(*(axis_of[s] for s in syms)) if syms
                                else float(term), dtype=float))
    if n is None:  # at the shape its terms broadcast to (a grid's few dimensions)
        return sum(parts, np.zeros(()))
    return combined(parts, n)


def combined(parts, shape: tuple, op=np.add, start=0.0) -> np.ndarray:
    """``parts`` (arrays that broadcast to ``shape``) combined by ``op`` (a numpy ufunc: add,
    logical_and) into one array of ``shape``.  A part is first folded into a larger one whose
    dimensions cover its own — a kernel of a few tiles into one of more — so only the parts
    no other covers are spread over every point (a grid of millions)."""
    kept: list = []
    for at in sorted(parts, key=lambda a: -a.size):
        into = next((k for k, big in enumerate(kept) if big.ndim == at.ndim and all(
            a == 1 or a == b for a, b in zip(at.shape, big.shape))), None)
        if into is None:
            kept.append(np.array(at))
        else:
            op(kept[into], at, out=kept[into])
    out = np.empty(shape, dtype=np.result_type(start, *kept))
    if not kept:
        out.fill(start)
        return out
    op(start, kept[0], out=out)  # (the largest part spread as the output is filled)
    for at in kept[1:]:
        op(out, at, out=out)
    return out
