"""The cost functor: transfers, peak memory, FLOPs and roofline time of a streamed program.

See the package docstring (``napkin.cost``) for the conventions; this module implements them
with one walk over the nested program (groups and streams are boxes whose bodies are
diagrams, so the walk recurses into ``Group.body`` and ``Stream.init/update/finalize``).
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy

from napkin.arrays import canonical_dtype
from napkin.errors import NapkinError
from napkin.hardware import DTYPE_BYTES, Hardware, HardwareError, get_hardware
from napkin.ir import ops as op_order, view
from napkin.memo import IdentityMemo
from napkin.primitives import TRANSCENDENTAL, merge_axes

ZERO = sympy.Integer(0)
ELEMENTWISE = frozenset({"map", "zip", "cast", "mask"})
CANONICAL_LEVELS = ("gmem", "l2", "smem", "registers")
_EXTRA_BYTES = {"int32": 4, "bool": 1}


class CostError(NapkinError):
    """The cost model cannot price a program (one-line message)."""


def bytes_per_value(dtype: str) -> int:
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    d = canonical_dtype(dtype)
    return DTYPE_BYTES.get(d) or _EXTRA_BYTES[d]


# --------------------------------------------------------------------------- peaks
def _nonneg(expr) -> bool:
    """True when ``expr`` is provably >= 0 (every term has a non-negative coefficient;
    all symbols are positive sizes)."""
    e = sympy.expand(expr)
    if e.is_number:
        return bool(e >= 0)
    return all(c >= 0 for c in e.as_coefficients_dict().values())


@functools.lru_cache(maxsize=65536)
def _expanded(expr):
    return sympy.expand(expr)


@functools.lru_cache(maxsize=262144)
def _dominates(k, c) -> bool:
    """k >= c for every size, for expanded ``k`` and ``c``: every coefficient of k - c
    is non-negative (as :func:`_nonneg`, but term by term instead of expanding the
    difference again; memoised: kernels' peaks meet again in every state)."""
    diff = dict(k.as_coefficients_dict())
    for term, coef in c.as_coefficients_dict().items():
        diff[term] = diff.get(term, 0) - coef
    return all(v >= 0 for v in diff.values())


def prune(cands: list) -> list:
    """Drop candidates that another candidate provably dominates; keep distinct ones."""
    cands = [_expanded(c) for c in cands]
    keep: list = []
    for c in cands:
        if any(_dominates(k, c) for k in keep):
            continue
        keep = [k for k in keep if not _dominates(c, k)]
        keep.append(c)
    return keep or [ZERO]


def as_max(cands: list):
    cands = prune(cands)
    # evaluate=False: the candidates are already pruned, and Max's own
    # simplification (pairwise zero-finding) is the slowest thing in the model
    return cands[0] if len(cands) == 1 else sympy.Max(*cands, evaluate=False)


@dataclass
class _Peak:
    """Candidate peaks (values, bytes) at one level: the peak is the max of the list."""
    vals: list = field(default_factory=list)
    byts: list = field(default_factory=list)

    def add(self, v, b):
        return _Peak([x + v for x in self.vals or [ZERO]], [x + b for x in self.byts or [ZERO]])

    def merge(self, other: "_Peak"):
        self.vals = prune(self.vals + other.vals)
        self.byts = prune(self.byts + other.byts)

    @classmethod
    def of(cls, v, b):
        return cls([v], [b])


def _merge_into(dst: dict, src: dict):
    for lv, pk in src.items():
        if lv in dst:
            dst[lv].merge(pk)
        else:
            dst[lv] = _Peak(list(pk.vals), list(pk.byts))


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class TileInfo:
    """A tile-size symbol of the program: a group size g_a or a stream chunk s_x."""
    symbol: sympy.Symbol
    kind: str                 # "group" | "stream"
    axis: str
    full: sympy.Expr          # the size of the axis it tiles (may hold other symbols)
    level: str                # memory level where the tiles live
    multiples: tuple = ()     # ((reason, multiple), ...): divisibility the hardware asks for

    @property
    def multiple(self) -> int:
        return math.lcm(1, *(m for _, m in self.multiples))

    def to_json(self):
        return {"kind": self.kind, "axis": self.axis, "full": str(self.full), "level": self.level,
                "multiple": self.multiple, "multiples": {r: m for r, m in self.multiples}}


@dataclass(frozen=True)
class ContractionRecord:
    """One contraction of the program, for the lower bounds: its whole iteration space
    (product of every axis, all groups and chunks together), the product of the sizes it
    reduces per execution, and the stream it sits in (rule, axis) if any."""
    name: str
    iterations: sympy.Expr
    reduced: tuple
    reduced_size: sympy.Expr
    stream_rule: str | None
    stream_axis: str | None
    matmul_like: bool = False   # two inputs, each with an output axis of its own, and a sum


def _peak_num(cands, sizes: Mapping) -> float:
    return max(_num(e, sizes) for e in cands)


def _sym_subs(expr, sizes: Mapping):
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


def _num(expr, sizes: Mapping) -> float:
    v = _sym_subs(expr, sizes)
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
        hw = self.hardware
        out = {}
        tensor = ZERO
        for unit, f in self.flops_by_unit.items():
            if unit.startswith("tensor:"):
                dt = unit.split(":", 1)[1]
                try:
                    peak = hw.peak_flops(dt)
                except HardwareError:
                    peak = hw.vector_flops_per_s or hw.peak_flops("f32")
                tensor += f / sympy.Float(peak)
        out["tensor"] = tensor
        vec_peak = hw.vector_flops_per_s
        vector = self.flops_by_unit.get("vector", ZERO)
        sfu = self.flops_by_unit.get("sfu", ZERO)
        if hw.exp_per_s is None:
            vector, sfu = vector + sfu, ZERO
        out["vector"] = vector / sympy.Float(vec_peak) if vec_peak else ZERO
        out["sfu"] = sfu / sympy.Float(hw.exp_per_s) if hw.exp_per_s else ZERO
        return out

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
        ct = {k: _num(v, sizes) for k, v in self.compute_times().items()}
        times = {lv: _num(self.time_s[lv], sizes) for lv in self.levels[1:]}
        times["compute"] = max(ct.values(), default=0.0)
        bound = max(times, key=times.get)
        if bound == "compute":
            bound = f"compute:{max(ct, key=ct.get)}"
        total = max(times.values())
        times["serial"] = sum(times.values())
        times["total"] = total
        return {
            "transfers": {lv: _num(e, sizes) for lv, e in self.transfers.items()},
            "transfers_bytes": {lv: _num(e, sizes) for lv, e in self.transfers_bytes.items()},
            "memory": {lv: _peak_num(self.memory_candidates[lv], sizes) for lv in self.levels},
            "memory_bytes": {lv: _peak_num(self.memory_bytes_candidates[lv], sizes)
                             for lv in self.levels},
            "flops": _num(self.flops, sizes),
            "time_s": times,
            "bound_by": bound,
        }

    def fits(self, sizes: Mapping, capacity: Mapping | None = None) -> dict:
        out = {}
        for lv in self.levels[1:]:
            cap = (capacity or {}).get(lv, self.hardware.level(lv).capacity_bytes)
            out[lv] = cap is None or _peak_num(self.memory_bytes_candidates[lv], sizes) <= cap
        return out

    def to_json(self, sizes: Mapping, **opt) -> dict:
        from napkin.cost.report import cost_json
        return cost_json(self, sizes, **opt)


# --------------------------------------------------------------------------- the walk
_KERNELS = IdentityMemo(20000)  # a kernel's own walk and peaks


class _Walk:
    def __init__(self, hw: Hardware, dtype, intermediates: bool):
        self.hw = hw
        self.names = tuple(lv.name for lv in hw.levels)
        self.n = len(self.names)
        self.dtype = dtype
        self.intermediates = intermediates
        self.loads = [defaultdict(lambda: ZERO) for _ in range(self.n)]
        self.stores = [defaultdict(lambda: ZERO) for _ in range(self.n)]
        self.loads_b = [defaultdict(lambda: ZERO) for _ in range(self.n)]
        self.stores_b = [defaultdict(lambda: ZERO) for _ in range(self.n)]
        self.flops = defaultdict(lambda: ZERO)
        self.tiles: dict = {}
        self.multiples: dict = defaultdict(dict)
        self.contractions: list = []
        self.streams: list = []
        self._stream_ctx: list = []
        self.mma = {}
        for lv in hw.levels:
            for k, m in lv.divisibility.items():
                self.mma[k] = math.lcm(self.mma.get(k, 1), m)

    # -- helpers ------------------------------------------------------------------------
    def level_index(self, name: str) -> int:
        if name in self.names:
            return self.names.index(name)
        if name in CANONICAL_LEVELS:  # the deepest profile level not below the named one
            want = CANONICAL_LEVELS.index(name)
            best = None
            for i, lv in enumerate(self.names):
                if lv in CANONICAL_LEVELS and CANONICAL_LEVELS.index(lv) <= want:
                    best = i
            if best is not None:
                return best
        return self.n - 1

    @property
    def implicit_level(self) -> int:
        return self.level_index("smem")

    def dt(self, ob) -> str:
        d = self.dtype
        if isinstance(d, str):
            return d
        if isinstance(d, Mapping) and ob.name in d:
            return d[ob.name]
        return ob.type.dtype

    def size(self, ob):
        n = ob.type.numel
        return n, n * bytes_per_value(self.dt(ob))

    def _tile_sym(self, size):
        return size if isinstance(size, sympy.Symbol) else None

    def require(self, size, reason: str, multiple: int):
        s = self._tile_sym(size)
        if s is not None and multiple > 1:
            self.multiples[s][reason] = math.lcm(self.multiples[s].get(reason, 1), multiple)

    def move(self, ob, reps, frm: int, to: int):
        """``ob`` moved ``reps`` times between levels ``frm`` and ``to`` (every hop counts)."""
        if frm == to:
            return
        vals, byts = self.size(ob)
        lo, hi = sorted((frm, to))
        table, table_b = (self.loads, self.loads_b) if to > frm else (self.stores, self.stores_b)
        for k in range(lo + 1, hi + 1):
            table[k][ob.name] += vals * reps
            table_b[k][ob.name] += byts * reps
        if ob.type.axes:  # coalescing: the contiguous (last) axis moves in aligned runs
            align = math.lcm(*(self.hw.levels[k].align_bytes for k in range(lo + 1, hi + 1)))
            per = max(1, align // bytes_per_value(self.dt(ob)))
            self.require(ob.type.axes[-1].size, f"coalesce {align}B", per)

    def count_flops(self, box, R):
        spec = box.data
        ins = tuple(ob.type for ob in box.dom.inside)
        outs = tuple(ob.type for ob in box.cod.inside)
        f = sympy.sympify(spec.flops(ins, outs)) * R
        if f == 0:
            return
        if spec.kind == "contract":
            if self._contraction(box, ins, outs, R):  # a matrix product: tensor cores
                dt = max((self.dt(ob) for ob in box.dom.inside), key=bytes_per_value)
                self.flops[f"tensor:{dt}"] += f
            else:  # dot products, outer products, n-ary einsums: vector units
                self.flops["vector"] += f
        elif spec.kind == "map" and spec.fn in TRANSCENDENTAL:
            self.flops["sfu"] += f
        else:
            self.flops["vector"] += f

    def _contraction(self, box, ins, outs, R):
        allaxes = merge_axes(ins, "contract")
        out_names = {n for o in outs for n in o.names}
        reduced = tuple(n for n in allaxes if n not in out_names)
        it = sympy.Mul(*(a.size for a in allaxes.values())) * R
        red = sympy.Mul(*(allaxes[n].size for n in reduced))
        rule, axis = self._stream_ctx[-1] if self._stream_ctx else (None, None)
        m_ax = n_ax = []
        if len(ins) == 2:
            m_ax = [n for n in ins[0].names if n in out_names]
            n_ax = [n for n in ins[1].names if n in out_names and n not in ins[0].names]
        mm = bool(reduced and n_ax and any(n not in ins[1].names for n in m_ax))
        self.contractions.append(ContractionRecord(box.name, sympy.expand(it), reduced, red, rule,
                                                   axis, mm))
        # tensor-core shapes: m = output axes of the first input, n = of the second, k = reduced
        if mm:
            kb = self.mma.get("mma_k_bytes", 1)
            bpv = max(bytes_per_value(self.dt(ob)) for ob in box.dom.inside)
            if m_ax:
                self.require(allaxes[m_ax[-1]].size, "mma_m", self.mma.get("mma_m", 1))
            if n_ax:
                self.require(allaxes[n_ax[-1]].size, "mma_n", self.mma.get("mma_n", 1))
            self.require(allaxes[reduced[-1]].size, "mma_k", max(1, kb // bpv))
        return mm

    def tile(self, kind, axis, size, full, level):
        s = self._tile_sym(size)
        if s is not None and s not in self.tiles:
            self.tiles[s] = (kind, axis, full, self.names[level])

    # -- bodies -------------------------------------------------------------------------
    def top(self, D, R=1):
        """The program at the top level: every box outside a group runs as its own kernel."""
        g = view(D)
        peaks: dict = {}
        for n in op_order(g):
            _merge_into(peaks, self.kernel(g.nodes[n]["box"], R))
        return peaks

    def _kernel(self, box, R):
        spec = box.data
        if spec.kind == "group":
            Lc = self.level_index(spec.level)
            full, N = self._count(spec.axis, box, spec.size)
            self.tile("group", spec.axis, spec.size, full, max(Lc, 1))
            if Lc == 0:
                return self.top(spec.body, R * N)
            return self.body(spec.body, Lc, R * N, [0] * len(box.dom), [0] * len(box.cod))
        return self.body(box, self.implicit_level, R, [0] * len(box.dom), [0] * len(box.cod))

    def kernel(self, box, R):
        """One top-level box (a kernel, or a grid of them), memoised: a rewrite changes one
        kernel of a program and the search prices the unchanged ones again and again.  The
        kernel is walked on its own and its totals are added to this walk's."""
        if not (self.dtype is None or isinstance(self.dtype, str)):
            return self._kernel(box, R)
        def walk():
            sub = _Walk(self.hw, self.dtype, self.intermediates)
            return sub, sub._kernel(box, R)
        sub, peaks = _KERNELS.get((box, self.hw), walk,
                                  (self.dtype, self.intermediates, sympy.sympify(R)))
        self.absorb(sub)
        return {lv: _Peak(list(pk.vals), list(pk.byts)) for lv, pk in peaks.items()}

    def absorb(self, other: "_Walk"):
        """Add another walk's totals (transfers, FLOPs, tiles, records) to this one."""
        for mine, theirs in ((self.loads, other.loads), (self.stores, other.stores),
                             (self.loads_b, other.loads_b), (self.stores_b, other.stores_b)):
            for table, add in zip(mine, theirs):
                for name, v in add.items():
                    table[name] += v
        for unit, f in other.flops.items():
            self.flops[unit] += f
        for s, info in other.tiles.items():
            self.tiles.setdefault(s, info)
        for s, reasons in other.multiples.items():
            for reason, m in reasons.items():
                self.multiples[s][reason] = math.lcm(self.multiples[s].get(reason, 1), m)
        self.contractions += other.contractions
        self.streams += other.streams

    def _count(self, axis, box, size):
        full = next(ob.type.axis(axis).size for ob in box.dom.inside if ob.type.has(axis))
        return full, full / sympy.sympify(size)

    def body(self, D, L, R, in_home, out_home, reusable=()):
        """Walk one execution context: diagram ``D`` running ``R`` times at level ``L``.

        in_home[i]: level where input i lives (== L: resident, held by the caller; above L: a
        view, loaded on first use by a box of this body).  out_home[j]: where output j goes
        (== L: the caller holds the buffer; above L: stored when produced).  ``reusable``:
        input positions whose buffers this body may overwrite once they die (a stream's state
        in its finalizer).  Returns {level: _Peak} of memory beyond what the caller holds.
        """
        g = view(D)
        order = op_order(g)
        pos = {n: i for i, n in enumerate(order)}
        ins, outs = g.graph["inputs"], g.graph["outputs"]
        out_home_of = {}
        for v, h in zip(outs, out_home):
            out_home_of[v] = min(h, out_home_of.get(v, h))
        home = dict(zip(ins, in_home))
        reuse = {ins[i] for i in reusable}
        ob = lambda v: g.nodes[v]["ob"]  # noqa: E731
        cons = {v: sorted(pos[c] for c in g.successors(v)) for v in g.nodes
                if g.nodes[v]["kind"] == "value"}
        nsteps = len(order)

        def last(v):
            end = max(cons[v], default=-1)
            if v in out_home_of and out_home_of[v] < L and v not in ins:
                end = max(end, pos[next(iter(g.predecessors(v)))])
            return end

        items: list = []          # (start, end, vals, bytes) held by this body at L
        owned: set = set()
        child = defaultdict(list)  # step -> list of _Peak extras at L
        deeper: dict = {}

        def hold(v, start, end):
            vals, byts = self.size(ob(v))
            items.append((start, end, vals, byts))
            owned.add(v)

        def ensure(v, i):
            if home[v] < L:
                self.move(ob(v), R, home[v], L)
                home[v] = L
                hold(v, i, last(v))

        def fused(v):
            if v in out_home_of or len(cons[v]) != 1:
                return False
            (c,) = {c for c in g.successors(v)}
            return g.nodes[c]["box"].data.kind in ELEMENTWISE

        def land(v, i):
            """Where an output of a group/stream box at step i goes; held here when a later
            box of this body reads it (and stored on to the caller's home if it is also an
            output of the body)."""
            h_out = out_home_of.get(v)
            home[v] = L
            if cons[v]:
                hold(v, i, last(v))
                if h_out is not None and h_out < L:
                    self.move(ob(v), R, L, h_out)
                return L
            return L if h_out is None else h_out

        for i, n in enumerate(order):
            node = g.nodes[n]
            box, spec = node["box"], node["box"].data
            if spec.kind == "group":
                Lc = max(L, self.level_index(spec.level))
                full, N = self._count(spec.axis, box, spec.size)
                self.tile("group", spec.axis, spec.size, full, Lc)
                if Lc > L >= 1:  # a deeper group reads from this level: stage its inputs here
                    for v in node["ins"]:
                        ensure(v, i)
                c_out = [land(v, i) for v in node["outs"]]
                pk = self.body(spec.body, Lc, R * N, [home[v] for v in node["ins"]], c_out)
                if Lc == L and L in pk:
                    child[i].append(pk.pop(L))
                _merge_into(deeper, pk)
            elif spec.kind == "stream":
                pk_here, pk_deep = self.stream(box, spec, g, node, i, L, R, home, ensure, land)
                child[i].append(pk_here)
                _merge_into(deeper, pk_deep)
            else:
                for v in node["ins"]:
                    ensure(v, i)
                self.count_flops(box, R)
                reused = set()
                for v in node["outs"]:
                    home[v] = L
                    h = out_home_of.get(v)
                    if h is not None and h < L:
                        self.move(ob(v), R, L, h)
                    if h == L or fused(v):
                        continue
                    if not self.intermediates and v not in out_home_of:
                        continue
                    start = i
                    if spec.kind in ELEMENTWISE:
                        vb = self.size(ob(v))[1]
                        for w in node["ins"]:
                            if (w in owned or w in reuse) and w not in reused and last(w) == i \
                                    and w not in out_home_of and _nonneg(self.size(ob(w))[1] - vb):
                                reused.add(w)
                                start = i + 1
                                break
                    hold(v, start, last(v))
        # outputs that are inputs passed straight through
        for v in set(outs) & set(ins):
            if home[v] == L and out_home_of[v] < L:
                self.move(ob(v), R, L, out_home_of[v])

        here = _Peak()
        for i in range(max(nsteps, 1)):
            vals = sum((it[2] for it in items if it[0] <= i <= it[1]), ZERO)
            byts = sum((it[3] for it in items if it[0] <= i <= it[1]), ZERO)
            if child.get(i):
                for pk in child[i]:
                    here.merge(pk.add(vals, byts))
            else:
                here.merge(_Peak.of(vals, byts))
        out = dict(deeper)
        if L in out:
            out[L].merge(here)
        else:
            out[L] = here
        return out

    def stream(self, box, spec, g, node, i, L, R, home, ensure, land):
        axis = spec.axis
        full, N = self._count(axis, box, spec.chunk)
        self.tile("stream", axis, spec.chunk, full, L)
        self.streams.append((spec.rule, axis))
        n_state = spec.n_state
        up_dom = spec.update.dom.inside
        chunk_v, chunk_b = ZERO, ZERO
        for j, v in enumerate(node["ins"]):
            t = g.nodes[v]["ob"].type
            if not t.has(axis):
                ensure(v, i)
            elif home[v] < L:
                ob_chunk = up_dom[n_state + j]
                self.move(ob_chunk, R * N, home[v], L)
                cv, cb = self.size(ob_chunk)
                chunk_v += cv
                chunk_b += cb
        state_v, state_b = ZERO, ZERO
        for ob in spec.init.cod.inside:
            sv, sb = self.size(ob)
            state_v += sv
            state_b += sb
        fin_out = [land(v, i) for v in node["outs"]]
        self._stream_ctx.append((spec.rule, axis))
        try:
            init = self.body(spec.init, L, R, [], [L] * n_state)
            up = self.body(spec.update, L, R * N, [L] * len(up_dom), [L] * n_state)
        finally:
            self._stream_ctx.pop()
        fin = self.body(spec.finalize, L, R, [L] * len(spec.finalize.dom), fin_out,
                        reusable=range(n_state))
        here = _Peak()
        here.merge(up.pop(L).add(chunk_v, chunk_b))
        here.merge(fin.pop(L))
        init.pop(L, None)
        deeper: dict = {}
        _merge_into(deeper, up)
        _merge_into(deeper, fin)
        _merge_into(deeper, init)
        return here.add(state_v, state_b), deeper


def cost(program, hardware, dtype=None, *, intermediates: bool = True) -> Cost:
    """The symbolic cost of ``program`` (a diagram, streamed or not) on ``hardware``.

    ``hardware``: a Hardware or a profile name ("h100", "h200", "a100", a TOML path).
    ``dtype``: None = every array's own dtype (accumulators stay f32 as the rules build them);
    a string = every array, accumulators included, priced at that dtype (the paper's single
    q bytes per value); a mapping {array name: dtype} = those arrays at those dtypes.
    ``intermediates``: count values produced inside a body (scores, partial products) in the
    peak memory (default); False = only inputs, chunks, state and outputs (the paper's count).
    """
    hw = get_hardware(hardware)
    if isinstance(dtype, str):
        bytes_per_value(dtype)
    elif isinstance(dtype, Mapping):
        for d in dtype.values():
            bytes_per_value(d)
    w = _Walk(hw, dtype, intermediates)
    peaks = w.top(program)
    names = w.names
    memory, memory_b, cand, cand_b = {}, {}, {}, {}
    for i, lv in enumerate(names):
        if i == 0:
            vals = sum((ob.type.numel for ob in _top_values(program)), ZERO)
            byts = sum((w.size(ob)[1] for ob in _top_values(program)), ZERO)
            cand[lv], cand_b[lv] = [sympy.expand(vals)], [sympy.expand(byts)]
        else:
            pk = peaks.get(i, _Peak())
            cand[lv], cand_b[lv] = prune(pk.vals or [ZERO]), prune(pk.byts or [ZERO])
        memory[lv], memory_b[lv] = as_max(cand[lv]), as_max(cand_b[lv])
    tiles = {}
    for s, (kind, axis, full, level) in w.tiles.items():
        mult = tuple(sorted(w.multiples.get(s, {}).items()))
        tiles[s] = TileInfo(s, kind, axis, sympy.sympify(full), level, mult)
    io = sum((ob.type.numel for ob in list(program.dom.inside) + list(program.cod.inside)), ZERO)
    return Cost(
        program=program, hardware=hw, dtype=dtype, levels=names,
        loads={lv: dict(w.loads[i]) for i, lv in enumerate(names)},
        stores={lv: dict(w.stores[i]) for i, lv in enumerate(names)},
        loads_bytes={lv: dict(w.loads_b[i]) for i, lv in enumerate(names)},
        stores_bytes={lv: dict(w.stores_b[i]) for i, lv in enumerate(names)},
        memory=memory, memory_bytes=memory_b, memory_candidates=cand,
        memory_bytes_candidates=cand_b,
        flops_by_unit={k: sympy.expand(v) for k, v in w.flops.items()},
        tiles=tiles, contractions=w.contractions, streams=w.streams,
        io_values=sympy.expand(io), intermediates=intermediates,
    )


def _top_values(D):
    """Every array of the top-level diagram (inputs and box outputs): all of it is in GMEM."""
    g = view(D)
    return [g.nodes[v]["ob"] for v in g.nodes if g.nodes[v]["kind"] == "value"]
