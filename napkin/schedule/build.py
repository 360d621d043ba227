"""Building the schedule: the one walk over a streamed program.

The walk decides, once, everything the cost model, the pseudocode and (in time) the
lowering read: where every array lives, when it is loaded and stored, which intermediates are
fused into the box that reads them, which elementwise box writes over an input that dies
there, what each body holds when.  The conventions are those of ``napkin.cost`` (its module
doc): data moves as late as possible, a value enters a group as a view of its home level and
is loaded where a box reads it, outputs are stored when produced, a stream's state stays on
chip, a box outside every group is a kernel of its own at SMEM.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping

import sympy

from napkin.core.arrays import array_types, canonical_dtype
from napkin.core.errors import NapkinError
from napkin.hardware import DTYPE_BYTES, Hardware, get_hardware, resolve_level
from napkin.core.ir import common_view, ops as op_order, view
from napkin.core.memo import IdentityMemo
from napkin.core.primitives import (FLOATING, matmul_axes, merge_axes,
                                    rows_from_second)
from napkin.schedule.nest import (
    ONE, ZERO, Assign, Buffer, ContractionRecord, Loop, Move, Schedule, Step, TileInfo, nonneg,
)
from napkin.schedule.layout import batch_axes, pointwise, staged_operands
from napkin.schedule.overlap import stated

_EXTRA_BYTES = {"int32": 4, "bool": 1}
_SUFFIX = {"smem": "_blk", "registers": "_reg", "l2": "_l2"}
_KERNELS = IdentityMemo(20000)  # a kernel's own nest, shared by every program that holds it


@functools.lru_cache(maxsize=4096)
def _multiply_and_sum_values(m, n, k, batch, least, dot=ZERO):
    """The registers of a contraction written as multiply-and-sum at these extents, else
    ``dot``'s (a tensor-core dot's operands relaid out through registers) — sympy
    expressions: cached by value; building Min over symbolic tiles compares its arguments
    pairwise, a few milliseconds each, and the search meets the same shapes in every state."""
    return sympy.Piecewise((m * n * k * batch, sympy.Or(sympy.Lt(sympy.Min(m, n, k), least),
                                                        sympy.Gt(batch, 1))),
                           (dot, True))


def _relayout_values(ins, out, size) -> sympy.Expr:
    """The values of a tensor-core dot's operands that a kernel transposes before the dot
    (napkin.lower.emit's ``_dot``: an operand whose free and contracted axes interleave — the
    heads of an output projection's (h, t, d) tile, contracted over h and d — is permuted to
    (t, h·d)); a permutation of axes of more than one entry each goes through registers: ptxas
    allocated 255 registers and spilled 1,456 B for a 64 × 8 × 64 tile the model had at 64
    (benchmarks/cpu_proofs.py --block)."""
    la, lb = ([x.name for x in t.axes] for t in ins)
    batch = [c for c in out if c in la and c in lb]
    contracted = [c for c in la if c in lb and c not in out]
    total = ZERO
    for mine, other in ((la, lb), (lb, la)):
        free = [c for c in out if c in mine and c not in other]
        core = [c for c in mine if c not in batch and (c in other or c in out)]  # (an axis
        # only this operand carries, and the output lacks, is summed before the dot)
        order = contracted + free if core == contracted + free else free + contracted
        rank = {c: i for i, c in enumerate(order)}
        swapped = [sympy.Min(size[x].size, size[y].size)
                   for i, x in enumerate(core) for y in core[i + 1:] if rank[x] > rank[y]]
        if swapped:
            values = sympy.Mul(*(size[c].size for c in mine))
            total += sympy.Piecewise((values, sympy.Gt(sympy.Max(*swapped), 1)), (0, True))
    return total


class ScheduleError(NapkinError):
    """A program cannot be scheduled on a profile (one-line message)."""


def bytes_per_value(dtype: str) -> int:
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    d = canonical_dtype(dtype)
    return DTYPE_BYTES.get(d) or _EXTRA_BYTES[d]


class _Builder:
    def __init__(self, hw: Hardware, dtype, intermediates: bool, loops=None, stages: int = 1):
        self.hw, self.dtype, self.intermediates = hw, dtype, intermediates
        self.stages = stages
        self.names = tuple(lv.name for lv in hw.levels)
        self.tiles: dict = {}
        self.multiples: dict = defaultdict(dict)
        self.shared: dict = defaultdict(set)         # size -> {(reason, multiple, cofactor)}
        self.statistics: frozenset = frozenset()     # the kernel's arrays of one value per row
        self.contractions: list = []
        self.streams: list = []
        self.stream_ctx: list = []
        self.loops = defaultdict(int, loops or {})  # axis -> loops over it around here
        self.stack: list = []                        # the loops being filled
        self.mma = {}
        for lv in hw.levels:
            for k, m in lv.divisibility.items():
                self.mma[k] = math.lcm(self.mma.get(k, 1), m)

    # -- levels, sizes, records -------------------------------------------------------------
    def level_index(self, name: str) -> int:
        return resolve_level(self.names, name)

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

    def require(self, size, reason: str, multiple: int, cofactor=ONE):
        """``size`` (times ``cofactor``, the other sides of a merged dimension) must be a
        multiple of ``multiple``.  With a cofactor the demand on the tile itself depends on
        the sizes (a dot's rows (r, q) at r = 4 ask q for 64 / 4): it is kept beside the
        plain multiples and worked out where the sizes are known (``TileInfo.least``)."""
        if not isinstance(size, sympy.Symbol) or multiple <= 1:
            return
        cofactor = sympy.sympify(cofactor)
        if cofactor == 1:
            self.multiples[size][reason] = math.lcm(self.multiples[size].get(reason, 1), multiple)
        else:
            self.shared[size].add((reason, multiple, cofactor))

    def tile(self, kind, axis, size, full, level: int):
        if isinstance(size, sympy.Symbol) and size not in self.tiles:
            self.tiles[size] = (kind, axis, full, self.names[level])

    def buffer(self, ob, L: int, role: str, note: str = "", name: str | None = None) -> Buffer:
        level = self.names[L]
        if name is None:
            # a loaded tile is named after its array (Q -> Q_blk); a computed value keeps its own
            suffix = "" if L == 0 or role == "temp" else _SUFFIX.get(level, "_" + level)
            name = ob.name + suffix
        vals, byts = self.size(ob)
        return Buffer(ob.name, name, tuple((a.name, a.size) for a in ob.type.axes), self.dt(ob),
                      level, vals, byts, role, {a: self.loops[a] for a in ob.type.names}, note)

    def emit(self, item):
        self.stack[-1].items.append(item)
        return item

    def move(self, ob, frm: int, to: int, src: Buffer, dst: Buffer):
        """``ob`` moved between levels ``frm`` and ``to`` (every hop in between counts)."""
        if frm == to:
            return
        vals, byts = self.size(ob)
        lo, hi = sorted((frm, to))
        levels = tuple(self.names[k] for k in range(lo + 1, hi + 1))
        self.emit(Move("load" if to > frm else "store", ob.name, vals, byts, levels, src, dst))
        # coalescing: the contiguous (last) axis of a tile's rows moves in aligned runs (a
        # 1-D block — one logit per head — is one run, whatever its length).  A row
        # statistic of a wider array of the kernel (L[k, r, q] beside Q[k, r, q, d]) moves
        # a d-th of that array's bytes: its short runs must not bind the tile
        if len(ob.type.axes) > 1 and ob.name not in self.statistics:
            align = math.lcm(*(self.hw.levels[k].align_bytes for k in range(lo + 1, hi + 1)))
            per = max(1, align // bytes_per_value(self.dt(ob)))
            self.require(ob.type.axes[-1].size, f"coalesce {align}B", per)

    def flops(self, box, R) -> dict:
        """The box's FLOPs per execution, by the unit its spec says they run on (a matrix
        product on the tensor cores at its widest input dtype)."""
        spec = box.spec
        ins = tuple(ob.type for ob in box.dom.inside)
        outs = tuple(ob.type for ob in box.cod.inside)
        if spec.kind == "contract":
            self._contraction(box, ins, outs, R)
        f = sympy.sympify(spec.flops(ins, outs))
        if f == 0:
            return {}
        unit = spec.unit(ins, outs)
        if unit == "tensor" and self._batched(ins, outs):
            unit = "vector"
        if unit == "tensor":
            unit += ":" + max((self.dt(ob) for ob in box.dom.inside), key=bytes_per_value)
        return {unit: f}

    def _batched(self, ins, outs) -> bool:
        """Whether a matrix product carries a batch axis (in both operands and the output)
        longer than one tile of 1: tensor cores take one 2-D product at a time, so a kernel
        runs a batched one as multiply-and-sum on the CUDA cores (a grouped axis's tile of 1
        leaves the kernel's body, so a tile is no batch)."""
        if len(ins) != 2:
            return False
        out = {a.name for o in outs for a in o.axes}
        for a in ins[0].axes:
            if a.name in out and ins[1].has(a.name) and a.size not in self.tiles \
                    and a.size != 1:
                return True
        return False

    def _product_registers(self, box):
        """The values a contraction holds while a kernel writes it as multiply-and-sum —
        a broadcast product over all its axes, in f32 registers, then a sum — where a side
        of it is below the smallest dot (``dot_min``: a decoding query's one row, four
        grouped heads) or it carries a batch axis; None for a tensor-core dot (its operands
        are staged and counted as chunks) or another box.  At q = 1, x chunks of 128 and
        d = 128, GQA's four heads hold 4·128·128 values per block: 512 registers a thread,
        which ptxas spills (benchmarks/cpu_proofs.py)."""
        spec, ins = box.spec, array_types(box.dom)
        if getattr(spec, "kind", None) != "contract" or len(ins) != 2 \
                or not all(self.dt(o) in FLOATING for o in box.dom.inside):
            return None
        out = set(spec.out)
        a, b = ({x.name for x in t.axes} for t in ins)
        size = merge_axes(ins, "contract")
        prod = lambda names: sympy.Mul(*(size[n].size for n in names))  # noqa: E731
        m, n, k = prod(a - b), prod(b - a), prod((a & b) - out)
        batch = prod((a & b) & out)
        if not (a & b) - out:
            return None  # an outer product: elementwise, no transient beyond its output
        moved = _relayout_values(ins, spec.out, size)
        return _multiply_and_sum_values(m, n, k, batch, self.mma.get("dot_min", 1), moved)

    def _contraction(self, box, ins, outs, R):
        """Record a contraction for the lower bounds, and the tensor-core multiples its
        tiles need."""
        allaxes = merge_axes(ins, "contract")
        mm, m_ax, n_ax, reduced = matmul_axes(ins, outs)
        it = sympy.Mul(*(a.size for a in allaxes.values())) * R
        red = sympy.Mul(*(allaxes[n].size for n in reduced))
        rule, axis = self.stream_ctx[-1] if self.stream_ctx else (None, None)
        self.contractions.append(ContractionRecord(box.name, sympy.expand(it), reduced, red, rule,
                                                   axis, mm))
        # tensor-core shapes: m = output axes of the row operand the other lacks (an axis
        # both carry is a batch: one product per index), n = of the other, k = reduced
        if len(ins) == 2:
            other = ins[0] if rows_from_second(ins, outs) else ins[1]
            m_ax = [a for a in m_ax if not other.has(a)]
        if mm:
            kb = self.mma.get("mma_k_bytes", 1)
            bpv = max(bytes_per_value(self.dt(ob)) for ob in box.dom.inside)
            # the kernel writer merges each side's axes into one dot dimension: the
            # instruction's shape is asked of their product (the last axis's tile times
            # the others' sizes)
            def side(axes, reason, m):
                rest = sympy.Mul(*(allaxes[a].size for a in axes[:-1]))
                self.require(allaxes[axes[-1]].size, reason, m, rest)
            if m_ax:
                side(m_ax, "mma_m", self.mma.get("mma_m", 1))
            if n_ax:
                side(n_ax, "mma_n", self.mma.get("mma_n", 1))
            side(reduced, "mma_k", max(1, kb // bpv))
            # the least dot dimension: each of the product's three sides, its axes merged
            # (MQA's rows (h, q): 32 heads leave a query chunk of 2 its 64 rows)
            least = self.mma.get("dot_min", 1)
            for axes in (m_ax, n_ax, reduced):
                if axes:
                    side(axes, "dot_min", least)

    def where(self, Lc: int, L: int) -> str:
        """How a group's iterations are spread, in words."""
        lv = self.names[Lc]
        n = self.hw.levels[Lc].count
        if Lc == L:
            return "one more axis of the enclosing grid"
        unit = {"smem": "SMs", "registers": "register files (one per SM sub-partition)",
                "l2": "L2 slices"}.get(lv, f"{lv} instances")
        if L == 0:
            n = self.hw.instances(lv)
        if n == 1:
            return f"one at a time (one {lv})"
        parent = {"smem": "SM", "l2": "L2"}.get(self.names[L], self.names[L])
        per = f" per {parent}" if L >= 1 and self.hw.instances(self.names[L]) > 1 else ""
        return f"grid, parallel over {n} {unit}{per}"

    # -- loops -------------------------------------------------------------------------------
    def open(self, loop: Loop) -> Loop:
        self.emit(loop)
        self.stack.append(loop)
        if loop.axis and loop.kind in ("group", "stream"):
            self.loops[loop.axis] += 1
        return loop

    def close(self, loop: Loop):
        self.stack.pop()
        if loop.axis and loop.kind in ("group", "stream"):
            self.loops[loop.axis] -= 1

    @staticmethod
    def _count(axis, box, size):
        full = next(ob.type.axis(axis).size for ob in box.dom.inside if ob.type.has(axis))
        return full, full / sympy.sympify(size)

    # -- the top level -----------------------------------------------------------------------
    def top(self, D, R, refs: dict) -> list:
        """The boxes of a top-level diagram, each a kernel (or a grid of them); returns the
        loops whose memory sits side by side."""
        g = view(D)
        kernels = []
        for n in op_order(g):  # values between kernels inside a GMEM group live in GMEM
            for v in g.nodes[n]["outs"]:
                if v not in refs:
                    refs[v] = self.emit(self.buffer(g.nodes[v]["ob"], 0, "array", "intermediate"))
        for n in op_order(g):
            node = g.nodes[n]
            irefs = [refs[v] for v in node["ins"]]
            orefs = [refs[v] for v in node["outs"]]
            kernels.append(self.kernel(node["box"], R, irefs, orefs))
        return kernels

    def kernel(self, box, R, irefs, orefs) -> Loop:
        """One top-level box, memoised (a rewrite changes one kernel of a program and the
        search prices the unchanged ones again and again): built on its own, its records
        added to this walk's.  The memo is by box; the buffers it reads and writes are the
        GMEM arrays of whichever program holds it."""
        if not (self.dtype is None or isinstance(self.dtype, str)):
            return self._kernel(box, R, irefs, orefs)
        loops = tuple(sorted((a, k) for a, k in self.loops.items() if k))

        def build():
            sub = _Builder(self.hw, self.dtype, self.intermediates, dict(loops), self.stages)
            holder = Loop("program", self.names[0])
            sub.stack.append(holder)
            ins = [Buffer(ob.name, ob.name, (), "", self.names[0], ZERO, ZERO, "array", {})
                   for ob in box.dom.inside]
            outs = [Buffer(ob.name, ob.name, (), "", self.names[0], ZERO, ZERO, "array", {})
                    for ob in box.cod.inside]
            loop = sub._kernel(box, R, ins, outs)
            return sub, loop, ins + outs
        sub, loop, placeholders = _KERNELS.get((box, self.hw), build,
                                               (self.dtype, self.intermediates,
                                                sympy.sympify(R), loops, self.stages))
        self.absorb(sub)
        return self.emit(Loop("use", self.names[0], items=[loop], children=[(0, loop)],
                              merge_only=True,
                              aliases=dict(zip(placeholders, [*irefs, *orefs]))))

    def _kernel(self, box, R, irefs, orefs) -> Loop:
        spec = box.spec
        self.statistics = _row_statistics(box)
        if spec.kind == "group":
            Lc = self.level_index(spec.level)
            full, N = self._count(spec.axis, box, spec.size)
            self.tile("group", spec.axis, spec.size, full, max(Lc, 1))
            if Lc == 0:
                loop = self.open(Loop("group", self.names[0], spec.axis, spec.size, full, N,
                                      False, "sequential launches", merge_only=True))
                refs = dict(zip(_graph_io(spec.body), [*irefs, *orefs]))
                loop.children = [(0, k) for k in self.top(spec.body, R * N, refs)]
                self.close(loop)
                return loop
            loop = self.open(Loop("group", self.names[Lc], spec.axis, spec.size, full, N, True,
                                  self.where(Lc, 0)))
            self.body(loop, spec.body, Lc, R * N, irefs, [0] * len(box.dom), orefs,
                      [0] * len(box.cod))
            self.close(loop)
            return loop
        L = self.implicit_level
        loop = self.open(Loop("kernel", self.names[L], name=box.name,
                              note=f"a box outside every group: one kernel, whole arrays "
                                   f"@{self.names[L]}"))
        self.body(loop, box, L, R, irefs, [0] * len(box.dom), orefs, [0] * len(box.cod))
        self.close(loop)
        return loop

    def absorb(self, other: _Builder):
        """Add another walk's records (tiles, multiples, contractions, streams)."""
        for s, info in other.tiles.items():
            self.tiles.setdefault(s, info)
        for s, reasons in other.multiples.items():
            for reason, m in reasons.items():
                self.multiples[s][reason] = math.lcm(self.multiples[s].get(reason, 1), m)
        for s, demands in other.shared.items():
            self.shared[s] |= demands
        self.contractions += other.contractions
        self.streams += other.streams

    # -- bodies ------------------------------------------------------------------------------
    def body(self, loop: Loop, D, L, R, in_refs, in_home, out_refs, out_home, reusable=(),
             held=(), spec=None):
        """Fill ``loop`` with diagram ``D`` running at level ``L`` (``R`` times in all).

        in_home[i]: level where input i lives (== L: resident, held by the caller; above L: a
        view, loaded on first use by a box of this body).  out_home[j]: where output j goes
        (== L: the caller holds the buffer; above L: stored when produced).  ``reusable``:
        input positions whose buffers this body may overwrite once they die (a stream's
        state in its finalizer).  ``held``: input positions whose registers the caller counts
        (a stream's chunks only elementwise boxes read): a value an elementwise box writes over
        one of them where it dies takes no registers of its own (gate·silu·up before the
        down projection, a norm's x·r·g before its GEMM: in place, as a compiler writes it).
        ``spec``: the stream whose update ``D`` is (its states may be carried transposed).
        The liveness goes into ``loop.holds`` / ``loop.children``."""
        g = common_view(D)
        order = op_order(g)
        pos = {n: i for i, n in enumerate(order)}
        # the operands a product reads from shared memory that this body computes, stored
        # there at the product's step and dead after it (napkin.schedule.layout); a
        # product's batch axis a group tiles is taken at a tile of 1, as _batched does: it
        # leaves the kernel (napkin.lower.plan), and the products are matrices
        size = {a.name: a.size for v in g.nodes if g.nodes[v]["kind"] == "value"
                for a in g.nodes[v]["ob"].type.axes}
        squeezed = frozenset(n for n in batch_axes(g)
                             if self.tiles.get(size.get(n), ("",))[0] == "group")
        for v, n in staged_operands(g, squeezed, spec):
            loop.holds.append((*self.size(g.nodes[v]["ob"]), pos[n], pos[n], "smem"))
        ins, outs = g.graph["inputs"], g.graph["outputs"]
        out_home_of, out_ref_of = {}, {}
        for v, h, r in zip(outs, out_home, out_refs):
            if v not in out_home_of or h < out_home_of[v]:
                out_home_of[v], out_ref_of[v] = h, r
        home = dict(zip(ins, in_home))
        ref = dict(zip(ins, in_refs))
        fused_step: dict = {}                 # value -> the fused Step computing it
        fused_need: dict = {}                 # value -> values live while its tree computes
        # value -> [(values, step)]: the tiles a fused tree holds from the step that made
        # them until its root reads them (a product's result in registers, computed before)
        fused_leaves: dict = {}
        reuse = {ins[i] for i in reusable}
        free = {ins[i] for i in held}
        reuse |= free
        ob = lambda v: g.nodes[v]["ob"]  # noqa: E731
        cons = {v: sorted(pos[c] for c in g.successors(v)) for v in g.nodes
                if g.nodes[v]["kind"] == "value"}
        loop.at, loop.steps = L, len(order)


        def last(v):
            end = max(cons[v], default=-1)
            if v in out_home_of and out_home_of[v] < L and v not in ins:
                end = max(end, pos[next(iter(g.predecessors(v)))])
            return end

        owned: set = set()

        def hold(v, buf, start, end, staged=False):
            loop.holds.append((buf.values, buf.bytes, start, end, staged))
            owned.add(v)

        def ensure(v, i):
            if home[v] < L:
                buf = self.emit(self.buffer(ob(v), L, "tile"))
                self.move(ob(v), home[v], L, ref[v], buf)
                home[v], ref[v] = L, buf
                hold(v, buf, i, last(v), staged=_feeds_contraction(g, v))

        def fused(v):
            if v in out_home_of or len(cons[v]) != 1:
                return False
            (c,) = set(g.successors(v))
            return g.nodes[c]["box"].spec.elementwise

        # a fused value is computed inside the box that reads it: what its producer read
        # (and where) dies there too, so the reader may write over it (a cast of the
        # finalize's product writes over the accumulator)
        fused_reads: dict = {}

        def read_here(vs, i):
            return [(w, i) for w in vs] + [r for w in vs for r in fused_reads.get(w, ())]

        pending = []   # stores of landed outputs, made after the loop that produces them

        def land(v, i, after=False):
            """Where an output of a group/stream box at step i goes: held here when a later
            box of this body reads it (stored on to the caller's home if it is also an output
            of the body).  ``after``: live from the next step on — a stream's finalize writes
            it over the state, which the stream's own peak counts at step i."""
            h_out = out_home_of.get(v)
            home[v] = L
            if cons[v]:
                buf = self.emit(self.buffer(ob(v), L, "temp", "held for a later box"))
                ref[v] = buf
                hold(v, buf, i + after, last(v))
                if h_out is not None and h_out < L:
                    pending.append((ob(v), L, h_out, buf, out_ref_of[v]))
                return L, buf
            if h_out is None:  # nobody reads it: the child keeps it at L
                buf = self.buffer(ob(v), L, "temp")
                buf.declared = False
                ref[v] = buf
                return L, buf
            ref[v] = out_ref_of[v]
            return h_out, out_ref_of[v]

        def flush():
            for args in pending:
                self.move(*args)
            pending.clear()

        for i, n in enumerate(order):
            node = g.nodes[n]
            box, spec = node["box"], node["box"].spec
            if spec.kind == "group":
                Lc = max(L, self.level_index(spec.level))
                full, N = self._count(spec.axis, box, spec.size)
                self.tile("group", spec.axis, spec.size, full, Lc)
                if Lc > L >= 1:  # a deeper group reads from this level: stage its inputs here
                    for v in node["ins"]:
                        ensure(v, i)
                landed = [land(v, i) for v in node["outs"]]
                # a group is one more axis of the grid when it is all its enclosing grid's
                # body (or a deeper level's); beside other boxes of a kernel's body it is a
                # loop the kernel runs, one tile after another
                grid = Lc > L or (len(order) == 1 and loop.kind == "group" and loop.parallel)
                child = self.open(Loop("group", self.names[Lc], spec.axis, spec.size, full, N,
                                       grid, self.where(Lc, L) if grid else
                                       "sequential, a loop inside the kernel"))
                self.body(child, spec.body, Lc, R * N, [ref[v] for v in node["ins"]],
                          [home[v] for v in node["ins"]], [r for _, r in landed],
                          [h for h, _ in landed])
                self.close(child)
                flush()
                loop.children.append((i, child))
            elif spec.kind == "stream":
                self.stream(loop, box, spec, g, node, i, L, R, home, ref, ensure, land, flush)
            else:
                for v in node["ins"]:
                    ensure(v, i)
                args = tuple(fused_step.get(v) or ref[v] for v in node["ins"])
                step = Step(box, args, [], self.flops(box, R))
                product = self._product_registers(box)
                if product is not None:  # a contraction written as multiply-and-sum
                    # registers only: no level's memory (the paper's model) holds it
                    loop.holds.append((product, 4 * product, i, i, "registers"))
                need, tile = _tree_need(node["ins"], fused_need, self.size(ob(node["outs"][0]))[0]
                                        if node["outs"] else ZERO,
                                        getattr(spec, "temporaries", 0))
                reused, stores = set(), []
                for v in node["outs"]:
                    home[v] = L
                    h = out_home_of.get(v)
                    if h == L:                      # the caller's buffer (e.g. the state)
                        ref[v] = out_ref_of[v]
                        step.outs.append(ref[v])
                        continue
                    if fused(v):
                        fused_step[v] = step
                        fused_reads[v] = read_here(node["ins"], i)
                        fused_need[v] = (need, tile)
                        fused_leaves[v] = _leaves(node["ins"], fused_leaves) \
                            if spec.elementwise else [] if _accumulated(g, v) \
                            else [(self.size(ob(v))[0], i)]
                        step.fused = True
                        step.outs.append(None)
                        continue
                    counted = self.intermediates or v in out_home_of
                    start, inplace = i, None
                    if counted and spec.elementwise:
                        vb = self.size(ob(v))[1]
                        for w, at in read_here(node["ins"], i):
                            if (w in owned or w in reuse) and w not in reused and last(w) == at \
                                    and w not in out_home_of and nonneg(self.size(ob(w))[1] - vb):
                                reused.add(w)
                                start, inplace = i + 1, ref[w]
                                counted = counted and w not in free
                                break
                    buf = self.buffer(ob(v), L, "temp" if v not in out_home_of else "tile")
                    buf.counted, buf.in_place_of = counted, inplace
                    ref[v] = buf
                    if counted:
                        hold(v, buf, start, last(v))
                    step.outs.append(buf)
                    if h is not None and h < L:
                        stores.append((ob(v), L, h, buf, out_ref_of[v]))
                if not step.fused:
                    # the tiles of its fused tree made at earlier steps (a product's result,
                    # exponentiated in place) live until here: dQ's P beside dP
                    own = sum((b.values for b in step.outs if b is not None and b.counted),
                              ZERO)
                    self._leaf_holds(loop, _leaves(node["ins"], fused_leaves), i,
                                     own if need == tile else None)
                if not step.fused and need != tile and not _zero(need - tile):
                    # a fused elementwise tree: a kernel computes it op by op over the whole
                    # tile, so the results of its branches are live at once (beside the
                    # output, counted as its buffer) — registers only, as the product above
                    extra = need - tile
                    loop.holds.append((extra, 4 * extra, i, i, "registers"))
                self.emit(step)
                for args in stores:
                    self.move(*args)
        for v in set(outs) & set(ins):  # outputs that are inputs passed straight through
            if home[v] == L and out_home_of[v] < L:
                self.move(ob(v), L, out_home_of[v], ref[v], out_ref_of[v])

    @staticmethod
    def _leaf_holds(loop, leaves, i, own):
        """Hold each tile a fused tree made at an earlier step until step ``i``, where its
        root reads them and writes its result over them: at ``i`` only what exceeds the
        root's ``own`` counted output (None: the tree's own need counts step ``i``)."""
        for vals, s in leaves:
            if s >= i:
                continue
            loop.holds.append((vals, 4 * vals, s, i - 1, "registers"))
        if own is not None and len(leaves) > 1:
            rest = sum((vals for vals, _ in leaves), ZERO) - own
            if _value(rest) > 0:
                loop.holds.append((rest, 4 * rest, i, i, "registers"))

    def stream(self, loop, box, spec, g, node, i, L, R, home, ref, ensure, land, flush):
        axis = spec.axis
        full, N = self._count(axis, box, spec.chunk)
        self.tile("stream", axis, spec.chunk, full, L)
        self.streams.append((spec.rule, axis))
        n_state = spec.n_state
        up_dom = spec.update.dom.inside
        chunk_v, chunk_b, chunked, staged = ZERO, ZERO, [], set()
        staged_v, staged_b = ZERO, ZERO     # the chunks a contraction reads
        scratch = ZERO                      # the largest chunk converted to a dot's layout
        pipelined = ZERO                    # chunks read elementwise into a product
        up_graph = view(spec.update)
        up_ins = up_graph.graph["inputs"]
        late = spec.finalize_only  # loaded by the finalize, after the loop
        for j, v in enumerate(node["ins"]):
            if not g.nodes[v]["ob"].type.has(axis):
                if j not in late:
                    ensure(v, i)
            elif home[v] < L:
                chunked.append(j)
                cv, cb = self.size(up_dom[n_state + j])
                chunk_v += cv * self.stages  # software pipelining: `stages` chunks in flight
                chunk_b += cb * self.stages
                if _feeds_contraction(up_graph, up_ins[n_state + j]):
                    staged.add(j)
                    staged_v += cv * self.stages
                    staged_b += cb * self.stages
                    # (a chunk a product reads with two of its axes as one side, GQA's rows
                    # r·q, is loaded as rows and staged as any other: the Triton backend's
                    # _Spelling.rows_access)
                else:
                    if _meets_product(up_graph, up_ins[n_state + j]):
                        scratch = cb if scratch == ZERO else sympy.Max(scratch, cb)
                    if _reaches_product(up_graph, up_ins[n_state + j]):
                        pipelined += cb
        state, nexts = [], []
        for o in spec.init.cod.inside:
            buf = self.buffer(o, L, "state", "state", name=o.name)
            state.append(buf)
            nxt = self.buffer(o, L, "next", name=o.name + "'")
            nxt.declared, nxt.in_place_of = False, buf  # the next value, in the state's buffer
            nexts.append(nxt)
        landed = [land(v, i, after=True) for v in node["outs"]]
        self.stream_ctx.append((spec.rule, axis))
        try:
            init = self.open(Loop("section", self.names[L], note=f"init: state of {spec.rule} "
                                  f"({', '.join(b.name for b in state)}), on chip for the "
                                  f"whole stream"))
            self.body(init, spec.init, L, R, [], [], state, [L] * n_state)
            self.close(init)
            up = self.open(Loop("stream", self.names[L], axis, spec.chunk, full, N, False,
                                f"stream {axis} [{spec.rule}], sequential"))
            up.overlap = stated(spec.update, n_state)
            refs = list(state)
            for j, v in enumerate(node["ins"]):
                if j in chunked:
                    o = up_dom[n_state + j]
                    buf = self.emit(self.buffer(o, L, "chunk"))
                    buf.stages = self.stages
                    self.move(o, home[v], L, ref[v], buf)
                    refs.append(buf)
                else:
                    refs.append(ref[v])
            self.body(up, spec.update, L, R * N, refs, [L] * len(up_dom), nexts, [L] * n_state,
                      held=[n_state + j for j in chunked if j not in staged], spec=spec)
            written = {id(b) for it in up.items if isinstance(it, Step) for b in it.outs if b}
            moved = tuple((s, nx) for s, nx in zip(state, nexts) if id(nx) in written)
            if moved:
                self.emit(Assign(moved))
            self.close(up)
        finally:
            self.stream_ctx.pop()
        fin = self.open(Loop("section", self.names[L], note=f"finalize {spec.rule}"))
        fixed = [v for v in node["ins"] if not g.nodes[v]["ob"].type.has(axis)]
        self.body(fin, spec.finalize, L, R, state + [ref[v] for v in fixed],
                  [L] * n_state + [home[v] for v in fixed],
                  [r for _, r in landed], [h for h, _ in landed], reusable=range(n_state))
        self.close(fin)
        flush()
        up.state = (sum((b.values for b in state), ZERO), sum((b.bytes for b in state), ZERO))
        up.chunk = (chunk_v, chunk_b)
        up.staged = (staged_v, staged_b)
        up.scratch = scratch
        up.pipelined = sympy.expand(pipelined)
        up.init, up.finalize = init, fin
        loop.children.append((i, up))


def _feeds_contraction(g, v) -> bool:
    """Whether a matrix product reads value ``v`` of graph ``g``, here or inside a group or
    stream that takes it (a GPU stages a tensor-core product's operands in shared memory;
    what only elementwise boxes and plain sums read, it loads to registers)."""
    for c in g.successors(v):
        node = g.nodes[c]
        spec = node["box"].spec
        if spec.kind == "contract":
            if _is_matmul(node):
                return True
        elif spec.kind in ("group", "stream"):
            body = spec.body if spec.kind == "group" else spec.update
            skip = 0 if spec.kind == "group" else spec.n_state
            inner = view(body)
            for j, u in enumerate(node["ins"]):
                if u == v and _feeds_contraction(inner, inner.graph["inputs"][skip + j]):
                    return True
    return False


def _meets_product(g, v) -> bool:
    """Whether an elementwise box or a plain sum reads value ``v`` of graph ``g`` beside a
    matrix product's result (or a value made from one elementwise): a GPU holds the product
    in its tensor-core layout and converts ``v`` to it through shared memory."""
    product, seen = set(), set()
    for n in op_order(g):
        node = g.nodes[n]
        spec = node["box"].spec
        made = spec.kind == "contract" and _is_matmul(node)
        if made or (spec.elementwise and any(u in product for u in node["ins"])):
            product.update(node["outs"])
        if v in node["ins"] and not made and any(u in product for u in node["ins"] if u != v):
            seen.add(n)
    return bool(seen)


def _reaches_product(g, v) -> bool:
    """Whether value ``v`` of graph ``g`` reaches a matrix product's operand through
    elementwise boxes alone (RMSNorm's x on its way to x̂·W, P's L): a compiler's software
    pipeline copies such a load to shared memory ahead of its step (Triton's, one buffer)."""
    todo, seen = [v], set()
    while todo:
        u = todo.pop()
        for c in g.successors(u):
            node = g.nodes[c]
            if node["box"].spec.kind == "contract" and _is_matmul(node):
                return True
            if pointwise(node["box"]) and c not in seen:
                seen.add(c)
                todo += node["outs"]
    return False


def _is_matmul(node) -> bool:
    ins = tuple(ob.type for ob in node["box"].dom.inside)
    outs = tuple(ob.type for ob in node["box"].cod.inside)
    return bool(matmul_axes(ins, outs)[0])


def _graph_io(D) -> list:
    g = view(D)
    return [*g.graph["inputs"], *g.graph["outputs"]]


def build(program, hardware, dtype=None, *, intermediates: bool = True,
          stages: int = 1) -> Schedule:
    """The schedule of ``program`` on ``hardware`` (see :mod:`napkin.schedule`).

    ``dtype``: None = every array's own dtype (accumulators stay f32 as the rules build them);
    a string = every array, accumulators included, at that dtype (the paper's single q bytes
    per value); a mapping {array name: dtype} = those arrays at those dtypes.
    ``intermediates``: count values produced inside a body in the peak memory (default);
    False = only inputs, chunks, state and outputs (the paper's count).
    ``stages``: chunk buffers of a stream in flight at once (a backend's software pipelining,
    Triton's num_stages); 1 is the paper's count, which the search prices."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages must be a positive integer, got {stages!r}")
    hw = get_hardware(hardware)
    if isinstance(dtype, str):
        bytes_per_value(dtype)
    elif isinstance(dtype, Mapping):
        for d in dtype.values():
            bytes_per_value(d)
    b = _Builder(hw, dtype, intermediates, stages=stages)
    root = Loop("program", b.names[0], merge_only=True)
    b.stack.append(root)
    g = view(program)
    refs, values = {}, []
    for v in g.graph["inputs"]:
        refs[v] = b.emit(b.buffer(g.nodes[v]["ob"], 0, "array", "input"))
    for v in g.graph["outputs"]:
        if v not in refs:
            refs[v] = b.emit(b.buffer(g.nodes[v]["ob"], 0, "array", "output"))
    for n in op_order(g):
        for v in g.nodes[n]["outs"]:
            if v not in refs:
                refs[v] = b.emit(b.buffer(g.nodes[v]["ob"], 0, "array", "intermediate"))
    for v in g.nodes:
        if g.nodes[v]["kind"] == "value":
            values.append(refs.get(v) or b.buffer(g.nodes[v]["ob"], 0, "array"))
    root.children = [(0, k) for k in b.top(program, ONE, refs)]
    tiles = {}
    for s, (kind, axis, full, level) in b.tiles.items():
        mult = tuple(sorted(b.multiples.get(s, {}).items()))
        shared = tuple(sorted(b.shared.get(s, ()), key=str))
        tiles[s] = TileInfo(s, kind, axis, sympy.sympify(full), level, mult, shared)
    return Schedule(program, hw, dtype, intermediates, b.names, root, tiles, b.contractions,
                    b.streams, tuple(values), stages)


def _row_statistics(box) -> frozenset:
    """Names of a kernel's arrays whose axes are a proper subset of another of its arrays'
    (a row's statistic: L[k, r, q] beside Q[k, r, q, d])."""
    arrays = [ob for ob in (*box.dom.inside, *box.cod.inside)]
    names = [set(ob.type.names) for ob in arrays]
    return frozenset(ob.name for ob, n in zip(arrays, names) if any(n < m for m in names))


def _accumulated(g, v) -> bool:
    """Whether value ``v`` (a product's result) is added straight into another value: the
    dot accumulates into that addend (a state's ``acc + a·b``), no tile of its own."""
    (c,) = set(g.successors(v))
    return getattr(g.nodes[c]["box"].spec, "fn", None) == "add"


def _leaves(ins, fused_leaves: dict) -> list:
    """The tiles the fused values among ``ins`` were made from (see ``body``)."""
    return [leaf for v in dict.fromkeys(ins) for leaf in fused_leaves.get(v, ())]


def _tree_need(ins, fused_need: dict, tile, temporaries: int = 0):
    """(values live at once while a box computes, its own result's values) where its inputs
    that are fused values are computed inside it: each branch in turn, the hungriest first
    (Sethi–Ullman) — what the finished branches hold plus what the next one needs — and at
    the end the branches' results beside the box's own and the temporaries it keeps
    (``Map.temporaries``: erf's).  Only a tree with such a box is counted so (the rest of
    the launch model, without it, agrees with ptxas: benchmarks/cpu_proofs.py)."""
    branches = sorted((fused_need[v] for v in dict.fromkeys(ins) if v in fused_need),
                      key=lambda nt: -_value(nt[0]))
    if not temporaries and all(need == result for need, result in branches):
        return tile, tile
    held, peak = ZERO, ZERO
    for need, result in branches:
        peak = _larger(peak, held + need)
        held = held + result
    return _larger(_larger(peak, held), tile * (1 + temporaries)), tile


def _value(e) -> float:
    """A size-independent order of expressions: their value with every size at 1024."""
    e = sympy.sympify(e)
    return float(e.xreplace({s: 1024 for s in e.free_symbols}))


def _larger(a, b):
    return a if _value(a) >= _value(b) else b


def _zero(e) -> bool:
    return _value(e) == 0

