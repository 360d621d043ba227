"""The Mosaic GPU backend: a :class:`~napkin.lower.plan.KernelPlan` spelled with ``plgpu.kernel``
for Hopper — TMA copies, warp specialisation, wgmma.

The plan decides the grid, the blocks and the stream, as for Triton; this module spells them
the way FlashAttention-3 runs on Hopper (the paper's §5 configuration):

* **the grid** — the plan's grid dimensions as ``plgpu.kernel``'s grid (``lax.axis_index``),
  or, with more tiles than the chip has SMs, a persistent grid of one program an SM looping
  over them in the same order (``plgpu.nd_loop``), each tile's stores left in flight;
* **consumer warpgroups** — a program's rows are split over ``W`` consumer warpgroups of
  64 rows or more each (wgmma's M is 64 per warpgroup): a grid axis whose tile is a multiple of
  128 is cut into W slices (:class:`Split` ``slice``), or one of a few indices (GQA's query
  heads per KV head) gives each warpgroup one index (``index``, the axis unwoven from the
  body); W is derived from the plan's tiles, and the registers a consumer's state needs must
  fit what ``setmaxnreg`` leaves it beside the producer (:func:`consumer_registers`);
* **a stream** — ``plgpu.emit_pipeline_warp_specialized``: a producer warpgroup issues the
  TMA copies of every streamed input's chunks (``BlockSpec`` with ``TilingTransform`` /
  ``SwizzleTransform``), ``max_concurrent_steps`` = the schedule's pipeline stages, and the
  accumulator's state is the consumers' carry; ``set_max_registers`` moves registers from the
  producer to the consumers;
* **inputs loaded once** (a query tile) — one TMA copy per consumer into shared memory;
* **contractions** — ``plgpu.wgmma`` into an ``ACC``: operands in shared memory in place
  (Kᵀ as a transposed view), a first operand computed in the kernel (P) from registers;
* **turns on the tensor cores** (FlashAttention-3's ping-pong) — where a step has a product
  of a value it computed or carries (P·V after the softmax: :func:`waits_on_its_step`, read
  off the step's diagram, not a template), two consumers alternate through a barrier of two
  arrivals: a turn once the step's first product is issued, one before each product of a
  computed value, the second consumer a turn behind — so one's products run while the other
  works on its last results.  Every consumer runs the same step the same number of times
  (the pipeline's steps are the program's), so each takes as many turns; none is taken
  inside a mask's ``lax.cond`` (its branch differs per consumer);
* **every other box** through its primitive's ``evaluate`` with a recording namespace
  (:class:`MosaicRecorder`), as the Triton backend does: the kernel's code is the semantics'
  own box mapping; broadcasts are written as ``lax.broadcast_in_dim`` (Mosaic's layouts need
  them explicit) and positions as ``broadcasted_iota``;
* **the epilogue** — each output through shared memory and a TMA store.

What it refuses, in one line each (:func:`refusal`): f32 kernels (wgmma here runs bf16 / f16),
sizes its tiles do not divide (no masked tails yet), padded axes, loops inside the body,
more than one stream, rows that do not split into 64-row warpgroups, a state that does not fit
a consumer's registers; and, while writing, a contraction whose second operand is computed
in the kernel (wgmma reads it from shared memory).  ``backend="auto"`` then falls back to
Triton with that reason.  Tile skipping (causal, sliding windows) is the pipeline's number of
steps per program (a dynamic grid), with the chunk index offset by the first kept chunk, and
the masks run only in chunks they do not keep whole for the consumer's rows (``lax.cond``).

Interpret mode (``plgpu.InterpretGPUParams``, jax >= 0.11) runs the same module on a CPU,
~100x slower than Triton's; its wgmma reads shared memory only and takes no accumulator
initialised from registers, so there a contraction whose first operand is in registers is a
``lax.dot_general``, and an accumulation into the state is a fresh accumulator and an add
(the two differences).
"""
from __future__ import annotations

import functools
import inspect
import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin.core.arrays import array_types
from napkin.core.errors import NapkinError
from napkin.lower.backends import VARYING, Written, forward_params, load_module, varying_of
from napkin.lower.backends.mosaic_emit import (HELPERS, DeferredProduct, Issuing, MosaicRecorder,
                                               MosaicWriter, NotDeferred, SmemRef)
from napkin.lower.emit import LOW_PRECISION, Var, dtype_name
from napkin.core.ir import to_graph
from napkin.lower.plan import BlockRules, KernelPlan, loop_boxes, tile_indices
from napkin.core.primitives import EvalContext, matmul_sides
from napkin.core.semantics import fold_boxes
from napkin.frontend.weave import unweavable, unweave
from napkin.schedule.overlap import Deferral, deferred_product

SMEM_LIMIT = 232448         # bytes of shared memory a Hopper block may use (227 KiB)
EPILOGUE_BYTES = 16384      # an output block per consumer above this is stored in slices
EPILOGUE_COLUMNS = 64       # of this many columns, through two shared-memory slots
TMA_BOX = 256               # a TMA copy's box: at most this many elements per dimension
SMEM_ALIGNMENT = 1024       # Mosaic GPU aligns every shared-memory buffer to this
ROWS = 64                   # wgmma's M: rows one warpgroup's matrix product covers
THREADS = 128               # threads per warpgroup
PRODUCER_REGISTERS = 40     # what the TMA-issuing warpgroup keeps (FA3, JAX's examples)
MAX_CONSUMERS = 3           # the paper's derivation: at most 3 consumer warpgroups fit
SMS = 132                   # [H100-DS] SMs of an H100 / H200 SXM: a persistent kernel's programs
I32 = jax.ShapeDtypeStruct((), jnp.int32)


def consumer_registers(consumers: int) -> int:
    """Registers per thread ``setmaxnreg`` gives each consumer warpgroup (as
    ``emit_pipeline_warp_specialized`` does): the SM's file less the producer's, shared, in
    multiples of 8, at most 256 (a block holds W + 1 warpgroups of 128 threads) — the
    launch model's own formula, on Hopper as Mosaic runs it."""
    from napkin.cost.launch import consumer_registers as shared
    return int(shared(_hopper(), consumers))


@functools.cache
def _hopper():
    """Hopper as Mosaic runs it (built once: the writer asks per kernel)."""
    from napkin.hardware import H100_SXM
    return profile(H100_SXM)


# [EST] registers of data (the schedule's count) one lone consumer thread may hold, scaled
# for W consumers by what setmaxnreg leaves each (152 · 232/256 = 137 for two).  The
# schedule counts a tile once where the consumer holds it beside its predecessor while it
# is computed (scores in f32 beside P): ~60 % of setmaxnreg's 256, set against this
# writer's own count (check_registers: state plus twice the largest tile) on attention at
# d = 64 and 128 — 64 x 128, 128 x 128 taken, x 256 not.  The writer's count stays the gate.
REGISTER_BUDGET = 152
SWIZZLE_BYTES = 128  # wgmma reads a chunk's operands through a 128-B swizzle (d >= 64 at bf16)
MAX_STAGES = 4       # the deepest pipeline the model may choose (JAX's Hopper matmul runs 4)


def profile(hw):
    """``hw`` as a Mosaic GPU kernel runs on it (the launch model's terms): a producer
    warpgroup that only issues TMA copies (40 registers), 1 to 3 consumer warpgroups sharing
    the rest of the register file, a pipeline of 2 to 4 stages (the fewest that hide a
    load's latency), the contraction's K in multiples of the 128-B swizzle, tiles no larger
    than a TMA box.  A profile with no launch model stays one."""
    import dataclasses

    from napkin.hardware import FrozenMap, Level
    if hw.register_budget is None:
        return hw

    def level(lv: Level) -> Level:
        if "mma_k_bytes" not in lv.divisibility:
            return lv
        div = {**lv.divisibility, "mma_k_bytes": max(lv.divisibility["mma_k_bytes"],
                                                     SWIZZLE_BYTES)}
        return dataclasses.replace(lv, divisibility=FrozenMap(div))
    return dataclasses.replace(
        hw, name=f"{hw.name} (Mosaic GPU)", levels=tuple(level(lv) for lv in hw.levels),
        warps_per_block=tuple(4 * w for w in range(1, MAX_CONSUMERS + 1)),
        producer_warps=4, producer_registers=PRODUCER_REGISTERS, pipeline_stages=MAX_STAGES,
        register_budget=REGISTER_BUDGET, tile_max=TMA_BOX)


@dataclass(frozen=True)
class Split:
    """How a program's rows go to its consumer warpgroups: ``slice`` — grid axis ``axis``'s
    tile cut into ``consumers`` slices of ``rows``; ``index`` — each warpgroup takes one
    index of ``axis`` (unwoven from the body); None axis: one warpgroup takes it all."""
    kind: str | None
    axis: str | None
    consumers: int
    rows: int | None = None

    def describe(self) -> str:
        if self.kind == "slice":
            return f"{self.consumers} consumer warpgroups of {self.rows} {self.axis} each"
        if self.kind == "index":
            return f"{self.consumers} consumer warpgroups, one {self.axis} each"
        return "one consumer warpgroup"


def split_rows(plan: KernelPlan) -> Split | str:
    """The consumers' split of a program's rows (a reason string when there is none)."""
    grid = [g for g in plan.grid if g.axis not in _squeezed(plan)]
    # the rows are what wgmma's M runs over: grid axes that lead the outputs' blocks first
    leading = {ap.names[0] for ap in plan.outputs if ap.names}
    grid.sort(key=lambda g: g.axis not in leading)
    split = Split(None, None, 1)
    for g in grid:  # a tile of 128 or more rows: W slices of a multiple of 64 each, the
        if g.tile % ROWS == 0 and g.tile >= 2 * ROWS:  # most consumers that divide it
            w = max(w for w in range(1, MAX_CONSUMERS + 1) if (g.tile // ROWS) % w == 0)
            if w > 1:
                return Split("slice", g.axis, w, g.tile // w)
    for g in grid:  # a few indices (query heads of one KV head): one per warpgroup
        if 2 <= g.tile <= MAX_CONSUMERS and not unweavable(plan.body, g.axis):
            split = Split("index", g.axis, g.tile)
            break
    for ap in plan.outputs:  # a consumer's rows: the first axis of its output blocks
        rows = [(a, n) for a, n in zip(ap.names, ap.kernel_block) if a != split.axis]
        if not rows or rows[0][1] % ROWS:
            what = f"{rows[0][1]} {rows[0][0]}" if rows else "one"
            return (f"{ap.name}: a program's rows ({what}) are not a multiple of a "
                    f"warpgroup's {ROWS} (wgmma's M; Mosaic's register layouts)")
    return split


def _squeezed(plan: KernelPlan) -> set:
    return {a for ap in plan.inputs + plan.outputs for a in ap.squeezed}


def refusal(plan: KernelPlan) -> str:
    """Why this backend cannot write ``plan`` ("" when it can): the module doc's list."""
    for ap in plan.inputs + plan.outputs:
        dt = np.dtype(ap.dtype)
        rows_only = len([a for a in ap.type.names if a not in ap.squeezed]) <= 1
        # an f32 vector per row (a backward's saved L, its row term D) feeds no wgmma: it is
        # loaded and stored like an int32 segment id
        if jnp.issubdtype(dt, jnp.floating) and dt not in LOW_PRECISION and \
                not (rows_only and dt == np.dtype(np.float32)):
            return (f"{ap.name} is {dt.name}: the Mosaic GPU backend writes bf16 / f16 kernels "
                    f"(wgmma; FP8 e4m3 inputs too): run it at dtype bf16")
        if not jnp.issubdtype(dt, jnp.floating) and dt != np.dtype(np.int32):
            return (f"{ap.name} is {dt.name}: the Mosaic GPU backend takes floating arrays and "
                    f"int32 ones (segment ids, positions) only")
    if plan.padded:
        a = next(iter(plan.padded))
        return f"axis {a}={plan.sizes.get(a)} would be padded; the Mosaic GPU backend has no masks"
    for g in plan.grid:
        if g.stacked:
            return (f"split {g.axis}: a stream split in parts (split-K) is written by the Triton "
                    f"backend")
        if g.ragged:
            return (f"group {g.axis}: {g.size} is not a multiple of its tile {g.tile} (no masked "
                    f"tails in the Mosaic GPU backend)")
    if plan.inner:
        return "a loop over a group inside the kernel body (the Mosaic GPU backend writes none)"
    loops = loop_boxes(plan.body)
    if len(loops) > 1:
        return "more than one stream in a kernel (the Mosaic GPU backend pipelines one)"
    if loops and loops[0] not in plan.body.boxes:
        return "a stream nested in another box"
    chunks = {sp.axis: sp.chunk for sp in plan.streams.values()}
    for ap in plan.inputs + plan.outputs:
        names = [a for a in ap.type.names if a not in ap.squeezed]
        if not names:
            continue  # one value per program (a head's slope, a sink logit): read from HBM
        block = [chunks.get(a, n) for a, n in zip(names, ap.kernel_block)]
        if max(block) > TMA_BOX:
            a = names[block.index(max(block))]
            return (f"{ap.name}: its blocks hold {max(block)} along {a}; TMA copies at most "
                    f"{TMA_BOX} along each dimension (choose a tile or chunk of {a})")
        last = chunks.get(names[-1], ap.kernel_block[-1]) * np.dtype(ap.dtype).itemsize
        if last % 16:
            return (f"{ap.name}: its blocks' rows ({names[-1]}) are {last} B; TMA copies rows "
                    f"of a multiple of 16 B")
        if len(names) > 1 and (last < 32 or last % 32):
            return (f"{ap.name}: its blocks' rows ({names[-1]}) are {last} B; shared memory "
                    f"for wgmma is swizzled in rows of 32, 64 or 128 B")
    g = to_graph(plan.body)
    for v, ap in zip(g.graph["inputs"], plan.inputs):
        readers = {g.nodes[n]["box"].spec.kind for n in g.successors(v)}
        if ap.streamed and (readers != {"stream"} or v in g.graph["outputs"]):
            return f"{ap.name} is both streamed and read whole"
    for sp in plan.streams.values():
        if sp.tail:
            return (f"stream {sp.axis}: {sp.size} is not a multiple of its chunk {sp.chunk} "
                    f"(no masked tails in the Mosaic GPU backend)")
        if sp.chunk % 16:
            return f"stream {sp.axis}: chunk {sp.chunk} is not a multiple of 16 (wgmma's K)"
    if len(plan.launch_shape) > 3:
        return f"a grid of {len(plan.launch_shape)} dimensions (CUDA launches 3)"
    split = split_rows(plan)
    if isinstance(split, str):
        return split
    return ""


def waits_on_its_step(update, args) -> bool:
    """Whether a stream's step (its ``update`` diagram, read with ``args``) has a matrix
    product of a value held in registers — one the step computed (P in P·V) or carries —,
    so that the tensor cores wait on the step's own work: then two consumers can take
    turns, one's products running while the other computes."""
    waits = []

    def apply(box, ins):
        if matmul_sides(box) is not None and any(ins):
            waits.append(box)
        return [True] * len(box.cod)
    fold_boxes(update, [not isinstance(a, SmemRef) for a in args], apply)
    return bool(waits)


@dataclass(frozen=True)
class _Later:
    """A value of a deferred step's second phase, before it is written (box place, port)."""
    at: int
    port: int


# ------------------------------------------------------------------ the spelling
class _Spelling:
    def __init__(self, kernel, plan: KernelPlan, stages: int, defer: bool = True):
        self.k, self.plan, self.stages = kernel, plan, stages
        self.defer = defer  # a product may run a step late (deferred_product)
        self.deferred = None  # the DeferredProduct, once a step defers one
        self.done = None  # the name of the state completed by the late product, in the step
        self.w = MosaicWriter()
        self.xp = MosaicRecorder(self.w, kernel.f32_precision, dot_min=16)
        split = split_rows(plan)
        self.split = split
        self.body = plan.body
        if split.kind == "index":
            self.body = unweave(self.body, split.axis)
        self.arrays = plan.inputs + plan.outputs
        self.gmem = [self.w.reserve(f"{a.name}_gmem") for a in self.arrays]
        self.stream_box = next((b for b in loop_boxes(self.body)), None)
        # the plan's StreamPlan (keyed by the plan's own stream box, before any unweave)
        self.stream_plan = next((plan.streams[id(b.spec)] for b in loop_boxes(plan.body)), None)
        self.streamed = {i for i, a in enumerate(plan.inputs) if a.streamed}
        # inputs loaded once: by TMA into shared memory, or — one value per program (a
        # head's ALiBi slope, a sink logit: TMA copies rows of 16 B) — read from HBM
        self.scalars = {i for i, a in enumerate(plan.inputs)
                        if i not in self.streamed and not a.kernel_block}
        self.fixed = [i for i in range(len(plan.inputs))
                      if i not in self.streamed and i not in self.scalars]
        self.notes = [f"rows: {split.describe()}"]
        if self.stream_plan is not None and self.stream_plan.guards:
            self.notes.append(f"stream {self.stream_plan.axis}: every chunk computed (no "
                              f"per-chunk skip of data masks in the Mosaic GPU backend yet)")
        # what the kernel allocates in shared memory, bytes by purpose: "staged" is what the
        # schedule counts (tiles loaded once, a chunk per stage); Mosaic aligns every buffer
        # to SMEM_ALIGNMENT and reserves scratch for cross-warp reductions
        self.smem = {"staged": 0, "epilogue": 0, "operand staging": 0, "alignment": 0,
                     "reduction scratch": 0,
                     "barriers": 0}
        self.turns = None  # the consumers' ping-pong barrier, where the stream's step takes turns
        # the pipeline's stages, buffer slots and steps (pipeline())
        self.stages_in_flight = self.slots = self.steps = None

    # -------------------------------------------------------------- shapes and windows
    def consumer_shape(self, ap) -> tuple:
        """An array's block as one consumer warpgroup sees it."""
        out = []
        for a, b in zip(ap.names, ap.kernel_block):
            if self.split.kind == "index" and a == self.split.axis:
                continue
            out.append(self.split.rows if self.split.kind == "slice" and a == self.split.axis
                       else b)
        return tuple(out)

    def gmem_window(self, ap, ref, consumer: bool, keep=(), cut=None) -> str:
        """``ref`` cut to this program's block (``consumer``: to one warpgroup's part); axes
        in ``keep`` stay whole (a stream's axis, which the pipeline cuts); ``cut``: (axis,
        offset, size) — that axis cut further to a slice of the block (an epilogue's)."""
        idx = []
        for a, n, b in zip(ap.type.names, ap.shape, ap.block):
            start = self.starts.get(a)
            if cut is not None and a == cut[0]:
                at = cut[1] if start is None else f"{start} + {cut[1]}"
                idx.append(f"pl.ds({at}, {cut[2]})")
            elif a in ap.squeezed:
                idx.append(str(start))
            elif a in keep or start is None:
                idx.append(":")
            elif consumer and self.split.axis == a and self.split.kind == "index":
                idx.append(f"{start} + wg")
            elif consumer and self.split.axis == a:
                idx.append(f"pl.ds({start} + wg * {self.split.rows}, {self.split.rows})")
            else:
                idx.append(f"pl.ds({start}, {b})")
        if all(i == ":" for i in idx):
            return ref
        return f"{ref}.at[{', '.join(idx)}]"

    def consumer_view(self, ap, ref: str) -> str:
        """A shared-memory block holding the whole program's tile, cut to this warpgroup's."""
        if self.split.axis not in ap.names:
            return ref
        d = ap.names.index(self.split.axis)
        idx = [":"] * d + (["wg"] if self.split.kind == "index" else
                           [f"pl.ds(wg * {self.split.rows}, {self.split.rows})"])
        return f"{ref}.at[{', '.join(idx)}]"

    def buffer(self, purpose: str, nbytes: int) -> None:
        self.smem[purpose] += nbytes
        self.smem["alignment"] += -nbytes % SMEM_ALIGNMENT

    def nbytes(self, shape, dtype) -> int:
        return int(math.prod(shape)) * np.dtype(dtype).itemsize

    # -------------------------------------------------------------- the body
    def run(self, diagram, ctx, wires, step=False):
        """Evaluate ``diagram`` box by box, writing code (``step``: the stream's update)."""
        def apply(box, args):
            if getattr(box.spec, "kind", None) == "stream":
                return self.stream(box, ctx, args)
            return self.box(box, ctx, args, step)
        return fold_boxes(diagram, wires, apply)

    def skippable(self, box) -> bool:
        """A causal / window mask over the stream's axis whose tile skipping the plan knows
        (its kept keys per row are the SkipPlan's [row + low, row + high))."""
        skip = self.stream_plan.skip
        return skip is not None and box.spec.kind_ in ("causal", "window") and \
            box.spec.k == self.stream_plan.axis and box.spec.q == skip.query

    def mask_where_needed(self, box, ctx, args):
        """The mask applied only in a chunk it does not keep whole for every row of this
        consumer (``lax.cond``): most chunks of a long causal row are below the diagonal,
        where the mask is the identity (Triton's spelling runs them in a loop of their own)."""
        skip, sp, w = self.stream_plan.skip, self.stream_plan, self.w
        x, ins = args[0], array_types(box.dom)
        names = ins[0].names
        rows, keys = x.shape[names.index(skip.query)], x.shape[names.index(sp.axis)]
        r0, k0 = ctx.offsets.get(skip.query, 0), ctx.offsets[sp.axis]
        size = skip.tile.size if skip.tile is not None else self.plan.sizes[skip.query]
        kept = f"({k0} + {keys - 1} < {r0} + {skip.high})"
        if skip.low is not None:
            kept += f" & ({k0} >= jnp.minimum({r0} + {rows - 1}, {size - 1}) + {skip.low})"
        w.ready(*args)  # (chunks are waited for outside the branch: every consumer waits)
        fn = w.fresh(f"{box.spec.kind_}_mask")
        inner = Var(w, w.fresh(getattr(x, "name", "x")), x.aval, temp=False)
        w.line(f"def {fn}({inner.name}):")
        w.indent()
        (out,) = box.spec.evaluate(ctx, tuple(ins), tuple(array_types(box.cod)), inner,
                                   *args[1:])
        w.line(f"return {out}")
        w.dedent()
        return w.let(f"lax.cond({kept}, lambda v: v, {fn}, {{0}})", x, aval=x.aval,
                     name=box.cod.inside[0].name)

    def stream(self, box, ctx, args):
        spec, sp = box.spec, self.stream_plan
        w = self.w
        ax, s = sp.axis, sp.chunk
        ins = array_types(box.dom)
        streamed = [i for i, t in enumerate(ins) if t.has(ax)]
        if any(not isinstance(args[i], SmemRef) or args[i].ref not in self.chunk_refs
               for i in streamed):
            raise NapkinError(f"stream {ax}: a streamed input computed in the kernel (the "
                              f"Mosaic GPU backend streams loaded arrays only)")
        fixed = [a for i, a in enumerate(args) if i not in streamed]
        env = dict(ctx.env)
        if isinstance(spec.chunk, sympy.Symbol):
            env[spec.chunk] = s
        w.line()
        w.comment(f"stream {ax}: {sp.size} in chunks of {s}, accumulator {sp.rule}; a producer "
                  f"warpgroup copies the chunks in ({self.stages} in flight)")
        state = self.run(spec.init, EvalContext(env, ctx.offsets, self.xp), [])
        for var, ob in zip(state, spec.init.cod.inside):
            w.rename(var, ob.name)
        n_state = len(state)
        defer = deferred_product(spec.update, n_state) if self.defer and self.slots >= 2 \
            else None
        carried = [a for a in fixed if not isinstance(a, SmemRef)]
        fn, idx = w.fresh(f"{ax}_chunk"), w.fresh("idx")
        chunk_names = [self.chunk_refs[args[i].ref] for i in streamed]
        ready = [w.fresh(f"{ap.name}_ready") for _, ap in chunk_names]  # a barrier each
        free = [w.fresh(f"{ap.name}_free") for _, ap in chunk_names] if defer else []
        w.line(f"def {fn}({idx}, {', '.join([c for c, _ in chunk_names] + ready + free)}, "
               f"carry):")
        w.indent()
        st_in = [Var(w, w.fresh(ob.name), v.aval, temp=False)
                 for v, ob in zip(state, spec.init.cod.inside)]
        kept = [Var(w, w.fresh(v.name), v.aval, temp=False) for v in carried]
        held = w.fresh("held") if defer else None  # A_{j-1}'s name
        names = [v.name for v in st_in + kept] + ([held] if defer else [])
        w.line(f"{', '.join(names)}{',' if len(names) == 1 else ''} = carry")
        first = f"({idx}[0] + {self.lo})" if self.lo != 0 else f"{idx}[0]"
        start = w.let(f"{first} * {s}", name=f"{ax}0", aval=I32)
        chunk_args, chunks, it_c, it_k, it_r = [], [], iter(chunk_names), iter(kept), iter(ready)
        for i, a in enumerate(args):
            if i in streamed:
                ref, ap = next(it_c)
                view = w.fresh(f"{ap.name}_wg")
                w.line(f"{view} = {self.consumer_view(ap, ref)}")
                shape = tuple(s if a == ax else n for a, n in
                              zip(ins[i].names, args[i].shape))
                chunk_args.append(SmemRef(w, view, jax.ShapeDtypeStruct(shape, args[i].dtype)))
                chunk_args[-1].origin_ref = ref  # (its pipeline buffer: previous_chunk)
                chunk_args[-1].pending = next(it_r)  # waited for where the step first reads it
                chunks.append(chunk_args[-1])
            elif isinstance(a, SmemRef):
                chunk_args.append(a)
            else:
                chunk_args.append(next(it_k))
        offsets = dict(ctx.offsets)
        offsets[ax] = start
        first = len(w.lines)
        turns = self.split.consumers == 2 and waits_on_its_step(spec.update,
                                                                st_in + chunk_args)
        if turns:
            self.turns = w.reserve("turns")
            self.notes.append(f"stream {ax}: the two consumers take turns on the tensor cores "
                              f"(ping-pong): one's products run while the other works on "
                              f"its last ones' results")
        step_ctx = EvalContext(env, offsets, self.xp)
        if defer:
            new = self.deferred_step(spec, step_ctx, st_in + chunk_args, defer, idx, held,
                                     free, turns)
        else:
            self.xp.take_turns(self.turns if turns else None)
            new = self.run(spec.update, step_ctx, st_in + chunk_args, step=True)
            self.xp.take_turns(None)
        w.ready(*chunks)  # (a chunk the step never read: its barrier's phase still moves on)
        outs = []
        for var, init in zip(new, state):
            if var.dtype != init.dtype:
                var = w.let(f"{{0}}.astype({dtype_name(init.dtype)})", var)
            outs.append(var)
        # the step's temporaries, less the new state (updated in place): the register estimate
        carry = {v.name: v.aval.shape for v in st_in}
        if defer:  # the state the late product completed is updated in place too
            carry[self.done] = st_in[defer.state].shape
        self.step_lines = (first, len(w.lines), {getattr(v, "line", -1) for v in outs}, carry)
        back = [v.name for v in outs + kept] + ([self.deferred.a.name] if defer else [])
        w.line(f"return ({', '.join(back)}{',' if len(back) == 1 else ''})")
        w.dedent()
        w.line(f"steps[{ax!r}] = {fn}")
        init = [v.name for v in state + carried]
        if defer:  # A_{-1} = 0: the first step's late product adds nothing
            a = self.deferred.a
            init.append(w.let(f"jnp.zeros({a.shape}, {dtype_name(a.dtype)})", aval=a.aval).name)
        final = [Var(w, w.fresh(ob.name), v.aval, temp=False)
                 for v, ob in zip(state, spec.init.cod.inside)]
        rest = [w.fresh("_") for _ in carried]
        lhs = [v.name for v in final] + rest
        if defer:
            last = Var(w, w.fresh("held"), self.deferred.a.aval, temp=False)
            lhs.append(last.name)
        if turns:  # the second consumer starts a turn behind; the first ends with one more
            w.line(f"pl.when(wg == 1)(lambda: _turn({self.turns}))")
        w.line(f"{', '.join(lhs)}{',' if len(lhs) == 1 else ''} = run(({', '.join(init)}"
               f"{',' if len(init) == 1 else ''}))")
        if turns:
            w.line(f"pl.when(wg == 0)(lambda: _turn({self.turns}))")
        if defer:  # the last step's product, late: its chunk is still in its slot
            b = self.previous_chunk(self.deferred, f"lax.rem({self.steps} - 1, {self.slots})")
            k = defer.state
            final[k] = w.let(f"_mma_into_registers({final[k].name}, {last.name}, {b}"
                             f"{self.deferred.keywords})",
                             aval=final[k].aval, name=spec.init.cod.inside[k].name)
        fin = EvalContext(env, ctx.offsets, self.xp)
        return self.run(spec.finalize, fin, final + fixed)

    def pipeline_input(self, b: SmemRef) -> int | None:
        """The place among the pipeline's inputs of the chunk ``b`` views (None: a tile
        loaded once)."""
        refs = list(self.chunk_refs)
        origin = getattr(b, "origin_ref", None)
        return refs.index(origin) if origin in refs else None

    def previous_chunk(self, deferred, slot: str) -> str:
        """The late product's B as it reads it (as stored or transposed), in pipeline slot
        ``slot`` (the consumer's view of the pipeline's allocation, all its slots), or the
        tile itself where B is loaded once."""
        b = deferred.b
        pos = self.pipeline_input(b)
        if pos is None:
            return b.ref + deferred.b_view
        _, ap = self.chunk_refs[b.origin_ref]
        return self.consumer_view(ap, f"allocs['flat_in_smem_refs'][{pos}].at[{slot}]") + \
            deferred.b_view

    def deferred_step(self, spec, ctx, wires, defer: Deferral, idx, held, free, turns):
        """The step with its product A·B run a step late (:class:`Deferral`), as FA3 writes
        its main loop: one function over the step's accumulators issues the step's
        products and then A_{j-1}·B_{j-1} (into the state's accumulator, from Õ), works on
        the step's results while the latter runs (one ``wgmma.wait_group 1``), waits for it
        (``wait_group 0``) only where the boxes that read the state start, and returns the
        new state with this step's A.  It is written twice (``late``: a ``lax.cond``), as
        the first step has no late product.  The chunks its products read are waited for
        before it (never in a branch), B's chunk after it (read only a step later); the
        previous step's chunks are released when nothing reads them any more: B's once its
        late product is done, the others' at once."""
        w, xp, k = self.w, self.xp, defer.state
        fn, acc_o = w.fresh(f"{self.stream_plan.axis}_products"), w.fresh("acc_state")
        releases = len(w.lines)
        w.line("")  # the chunks the late product does not read, released (once known)
        waits = len(w.lines)
        w.line("")  # the waits for the chunks the step reads (once known)
        head = len(w.lines)
        w.line("")  # the function's header, once its accumulators are known
        w.indent()
        issues = len(w.lines)
        w.line("")  # the issues, once the step's products are known
        xp.issuing, w.hoisted, later, count = Issuing(), [], [], [0]

        def apply(box, args):  # phase 1: everything that does not read the state
            at, count[0] = count[0], count[0] + 1
            if at in defer.later:
                later.append((at, box, args))
                return [_Later(at, p) for p in range(len(box.cod))]
            xp.issuing.defer_next = at == defer.product
            out = self.box(box, ctx, args)
            if at == defer.product and not isinstance(out[0], DeferredProduct):
                raise NotDeferred("the late product was not written as one")
            return out
        state = wires[k]
        wires = list(wires)
        wires[k] = _Later(-1, 0)
        try:
            new = fold_boxes(spec.update, wires, apply)
        finally:
            (issuing, xp.issuing), (hoisted, w.hoisted) = (xp.issuing, None), (w.hoisted, None)
        deferred = next(v for _, _, args in later for v in args
                        if isinstance(v, DeferredProduct))
        self.deferred = deferred
        issued = w.fresh("issued")
        done = w.let(f"_load_into({acc_o}, {issued}, late)", aval=state.aval,
                     name=f"{state.name}_done")
        self.done = done.name
        values = {(-1, 0): done}
        for at, box, args in later:  # phase 2: the boxes that read the state
            args = [values[(v.at, v.port)] if isinstance(v, _Later) else v for v in args]
            if at == defer.add:
                e = next(v for v in args if not isinstance(v, DeferredProduct))
                if e.shape != deferred.shape:
                    raise NotDeferred("the late product's sum broadcasts")
                out = [e]
            else:
                out = self.box(box, ctx, args)
            values.update({(at, p): v for p, v in enumerate(out)})
        new = [values[(v.at, v.port)] if isinstance(v, _Later) else v for v in new]
        back = [v.name for v in new] + [deferred.a.name]
        w.line(f"return ({', '.join(back)},)")
        w.dedent()
        accs = [f"acc_{i}" for i in range(len(issuing.accumulators))] + [acc_o]
        w.lines[head] = "    " * w.depth + f"def {fn}({', '.join(accs)}, late):"
        w.lines[waits] = "\n".join("    " * w.depth + f"plgpu.barrier_wait({b})"
                                    for b in hoisted)
        b = self.previous_chunk(deferred, f"lax.rem({idx}[0] + {self.slots - 1}, "
                                            f"{self.slots})")
        turn = [f"_turn({self.turns})"] if turns else []  # (both branches take both turns)
        lines = turn + issuing.lines + [f"{issued} = _issue_into({acc_o}, {state.name}, "
                                        f"{held}, {b}, late{deferred.keywords})"] + turn
        w.lines[issues] = "\n".join("    " * (w.depth + 1) + ln for ln in lines)
        shapes = issuing.accumulators + [state.shape]
        w.line(f"{', '.join(back)}, = _first_or_late({fn}, {idx}[0] == 0, "
               + ", ".join(f"plgpu.ACC({sh}, jnp.float32)" for sh in shapes) + ")")
        read = self.pipeline_input(deferred.b)  # released once its late product is done
        now = [f for pos, f in enumerate(free) if pos != read]
        if now:
            w.lines[releases] = "    " * w.depth + \
                f"pl.when({idx}[0] > 0)(lambda: _release({', '.join(now)}))"
        if read is not None:
            w.line(f"pl.when({idx}[0] > 0)(lambda: _release({free[read]}))")
        self.notes.append(
            f"stream {self.stream_plan.axis}: {deferred.a.name}·{deferred.b.ref} runs a step "
            f"late, beside the next step's products (intra-warpgroup pipelining): one "
            f"wgmma.wait_group 1 and one wait_group 0 a step")
        out = []
        for v in new:  # the same names, bound outside the function
            out.append(Var(w, v.name, v.aval, temp=False))
            out[-1].line = getattr(v, "line", -1)
        return out

    def box(self, box, ctx, args, step=True):
        """One box, its code written (``step``: of a stream's update — a mask there runs only
        in the chunks it does not keep whole)."""
        if step and box.spec.kind == "mask" and self.skippable(box):
            return [self.mask_where_needed(box, ctx, args)]
        out = list(box.spec.evaluate(ctx, tuple(array_types(box.dom)),
                                     tuple(array_types(box.cod)), *args))
        for var, ob in zip(out, box.cod.inside):
            self.w.rename(var, ob.name)
        return out

    # -------------------------------------------------------------- the module
    def write(self) -> Written:
        """The kernel: each program's tile starts, its shared memory, the stream's pipeline,
        and the consumers' work (inputs in, the body, the epilogue), all inside one
        ``run_scoped`` of the warpgroups' shared allocations."""
        k, w = self.k, self.w
        w.line(f"def {k.symbol('kernel')}({', '.join(self.gmem)}):")
        w.indent()
        tiles = math.prod(self.plan.launch_shape)
        self.persistent = tiles > SMS
        if self.persistent:  # one program an SM, looping over the tiles in the grid's order
            self.loop_info = w.fresh("info")
            w.line(f"@plgpu.nd_loop({self.plan.launch_shape}, collective_axes='sm')")
            w.line(f"def {w.fresh('tile')}({self.loop_info}):")
            w.indent()
            self.notes.append(f"persistent: {SMS} programs, one an SM, loop over the {tiles} "
                              f"tiles; a tile's output store overlaps the next tile's work")
        self.grid_starts()
        scratch, scratch_names = self.allocate()
        windows = self.pipeline() if self.stream_box else []
        w.line()
        params = (["allocs"] if self.stream_box else []) + scratch_names
        scoped = len(w.lines)
        w.line(f"def scoped({', '.join(params)}):")
        w.indent()
        w.line("wg = lax.axis_index('wg')")
        w.line("steps = {}")
        w.line("def consumer(run=None):")
        w.indent()
        wires = self.consumer_inputs()
        outs = self.run(self.body, self.consumer_context(), wires)
        self.epilogue(outs)
        w.dedent()
        if self.stream_box:
            w.line(f"pipeline(lambda *a: steps[{self.stream_box.spec.axis!r}](*a), consumer)("
                   f"{', '.join(windows)}, allocations=allocs)")
        else:
            w.line("consumer()")
        w.dedent()
        for name, (shape, dtype) in self.xp.staging.items():  # FP8 first operands' buffers
            shape = (self.split.consumers,) + shape
            w.lines[scoped] = w.lines[scoped].replace("):", f", {name}):")
            scratch.append(f"plgpu.SMEM({shape}, {dtype_name(dtype)}, "
                           f"transforms=_transforms({shape[1:]}, {dtype_name(dtype)}))")
            self.buffer("operand staging", self.nbytes(shape, dtype))
        if self.turns:  # the step asked for turns: their barrier, one arrival per consumer
            w.lines[scoped] = w.lines[scoped].replace("):", f", {self.turns}):")
            scratch.append(f"plgpu.Barrier(num_arrivals={self.split.consumers})")
            self.smem["barriers"] += 8
        self.late_release()
        allocs = ([f"pipeline(_ignore, _ignore).get_allocations({', '.join(windows)})"]
                  if self.stream_box else [])
        w.line(f"pl.run_scoped(scoped, {', '.join(allocs + scratch)}, collective_axes='wg')")
        if self.persistent:  # the last tile's stores land before the kernel ends
            w.dedent()
            w.line("plgpu.wait_smem_to_gmem(0)")
        w.dedent()
        self.check_registers()
        self.reduction_scratch()
        self.check_shared_memory()
        return self.module(self.split.consumers + bool(self.stream_box))

    def late_release(self) -> None:
        """The pipeline as the step needs it: where a product runs a step late, its chunks
        are released a step late (``delay_release``), by the step itself (its consumed
        barriers: the previous step's chunks once the late product is done)."""
        late = self.deferred is not None
        delay, consumed = (", delay_release=1", ", manual_consumed_barriers=True") if late \
            else ("", "")
        self.w.lines[:] = [line.replace("<delay>", delay).replace("<consumed>", consumed)
                           for line in self.w.lines]
        if late:  # a consumed barrier per input and slot, not one for all
            self.smem["barriers"] += 8 * (len(self.streamed) - 1) * self.stages_in_flight

    def grid_starts(self) -> None:
        """Per grid axis, where this program's tile starts (``self.starts``: axis -> name)."""
        plan, w = self.plan, self.w
        ids = [f"{self.loop_info}.index[{i}]" if self.persistent else f"lax.axis_index('g{i}')"
               for i in range(len(plan.launch_dims))]
        self.starts = {}
        for g, pid in zip(plan.grid, tile_indices(plan, ids)):
            expr = f"({pid})" if " " in pid else pid
            self.starts[g.axis] = w.reserve(f"{g.axis}0")
            w.line(f"{self.starts[g.axis]} = {expr}" + (f" * {g.tile}" if g.tile != 1 else "")
                   + f"  # group {g.axis}: this program's tile starts here")

    def allocate(self) -> tuple[list, list]:
        """The warpgroups' shared allocations (their ``plgpu`` types and names): inputs
        loaded once (one buffer per consumer), outputs staged for their TMA stores, and the
        barriers the loads signal."""
        plan, w, W = self.plan, self.w, self.split.consumers
        scratch, names = [], []

        def smem(name, shape, dtype, tiled):
            scratch.append(f"plgpu.SMEM({shape}, {dtype_name(dtype)}, "
                           f"transforms=_transforms({tiled}, {dtype_name(dtype)}))")
            names.append(w.reserve(name))
            return names[-1]
        self.fixed_smem = {}
        for i in self.fixed:
            ap = plan.inputs[i]
            shape = (W,) + self.consumer_shape(ap)
            self.fixed_smem[i] = smem(f"{ap.name}_smem", shape, ap.dtype, shape[1:])
            self.buffer("staged", self.nbytes(shape, ap.dtype))
        self.out_smem, self.tiled_epilogue = [], set()
        free = {i: ((W,) + self.consumer_shape(plan.inputs[i]), np.dtype(plan.inputs[i].dtype))
                for i in self.fixed}
        for ap in plan.outputs:
            shape = (W,) + self.consumer_shape(ap)
            # an input loaded once of the output's shape and dtype (Q for O) is read for the
            # last time before the epilogue: the output is staged in its buffer (as FA3 does)
            reuse = next((i for i, sd in free.items() if sd == (shape, np.dtype(ap.dtype))),
                         None)
            if reuse is not None:
                del free[reuse]
                self.out_smem.append(self.fixed_smem[reuse])
                self.notes.append(f"{ap.name} is staged for its store in "
                                  f"{plan.inputs[reuse].name}'s shared memory")
                continue
            if len(shape) > 2 and self.nbytes(shape[1:], ap.dtype) > EPILOGUE_BYTES and \
                    shape[-1] % EPILOGUE_COLUMNS == 0:
                # a large output block goes out in column slices through two slots, each
                # slice's TMA store overlapping the next slice's copy into shared memory
                shape = (W, 2) + shape[1:-1] + (EPILOGUE_COLUMNS,)
                self.tiled_epilogue.add(len(self.out_smem))
            self.out_smem.append(smem(f"{ap.name}_smem", shape, ap.dtype, shape[-2:]))
            self.buffer("epilogue", self.nbytes(shape, ap.dtype))
        n_bar = W * len(self.fixed)
        if n_bar:
            scratch.append(f"plgpu.Barrier(num_barriers={n_bar})")
            names.append(w.reserve("loaded"))
            self.smem["barriers"] += 8 * n_bar
        return scratch, names

    def pipeline(self) -> list[str]:
        """``pipeline(step, consumer)``: the stream's warp-specialised pipeline, one chunk
        BlockSpec per streamed input; returns the HBM windows it streams from."""
        plan, w, sp = self.plan, self.w, self.stream_plan
        lo, hi = self.skip_bounds(sp)
        steps = sp.chunks if (lo, hi) == (0, sp.chunks) else \
            f"jnp.maximum({hi} - {lo}, 1).astype(jnp.int32)" if not isinstance(hi, int) \
            else max(hi - lo, 1)
        self.lo = lo
        stages = self.stages_in_flight = min(self.stages, sp.chunks)
        self.steps, self.slots = steps, min(stages, steps) if isinstance(steps, int) else stages
        specs, windows = [], []
        for i in sorted(self.streamed):
            ap = plan.inputs[i]
            windows.append(self.gmem_window(ap, self.gmem[i], consumer=False, keep={sp.axis}))
            names = [a for a in ap.type.names if a not in ap.squeezed]
            block = tuple(sp.chunk if a == sp.axis else b for a, b in zip(names, ap.kernel_block))
            index = ", ".join((f"c + {lo}" if lo != 0 else "c") if a == sp.axis else "0"
                              for a in names)
            # (a step that runs a product late keeps its chunks one step more: <delay>)
            specs.append(f"plgpu.BlockSpec({block}, lambda c: ({index},), "
                         f"transforms=_transforms({block}, {dtype_name(ap.dtype)})<delay>)")
            self.buffer("staged", stages * self.nbytes(block, ap.dtype))
        w.line("def pipeline(step, consumer):")
        w.line("    return plgpu.emit_pipeline_warp_specialized(")
        w.line(f"        step, grid=({steps},), memory_registers={PRODUCER_REGISTERS},")
        w.line(f"        in_specs=[{', '.join(specs)}],")
        w.line(f"        wg_axis='wg', num_compute_wgs={self.split.consumers}, "
               f"max_concurrent_steps={stages}, compute_context=consumer,")
        w.line("        manual_produced_barriers=True<consumed>)")  # a barrier per input: K
        # before V
        self.smem["barriers"] += 8 * (len(specs) + 1) * stages  # produced (each), consumed
        return windows

    def consumer_inputs(self) -> list:
        """The body's inputs as a consumer sees them: tiles loaded once by TMA (copied, then
        waited for), chunks (the pipeline's, named in its step), values read from HBM."""
        plan, w = self.plan, self.w
        n = len(self.fixed)
        for j, i in enumerate(self.fixed):
            ap = plan.inputs[i]
            w.line(f"plgpu.copy_gmem_to_smem({self.gmem_window(ap, self.gmem[i], True)}, "
                   f"{self.fixed_smem[i]}.at[wg], loaded.at[wg * {n} + {j}])")
        for j in range(n):
            w.line(f"plgpu.barrier_wait(loaded.at[wg * {n} + {j}])")
        self.chunk_refs, wires = {}, []
        for i, ap in enumerate(plan.inputs):
            aval = jax.ShapeDtypeStruct(self.consumer_shape(ap), ap.dtype)
            if i in self.streamed:
                ref = w.reserve(f"{ap.name}_chunk")
                self.chunk_refs[ref] = (ref, ap)  # (in the pipeline's order of inputs)
                wires.append(SmemRef(w, ref, aval))
            elif i in self.scalars:
                at = ", ".join(str(self.starts[a]) for a in ap.type.names)
                wires.append(w.let(f"{self.gmem[i]}[{at}]", name=ap.name, aval=aval))
            else:
                view = w.reserve(f"{ap.name}_wg")
                w.line(f"{view} = {self.fixed_smem[i]}.at[wg]")
                wires.append(SmemRef(w, view, aval))
        return wires

    def consumer_context(self) -> EvalContext:
        """Sizes and offsets as a consumer sees them: a sliced axis starts at its slice and
        its tile symbol is the slice's rows."""
        plan, w, split = self.plan, self.w, self.split
        offsets = dict(self.starts)
        env = dict(plan.env)
        if split.kind == "slice":
            offsets[split.axis] = w.let(f"{self.starts[split.axis]} + wg * {split.rows}",
                                        name=f"{split.axis}_wg0", aval=I32)
            spec = next(s for s in self.k.structure.groups if s.axis == split.axis)
            if isinstance(spec.size, sympy.Symbol):
                env[spec.size] = split.rows
        offsets = {a: (v if isinstance(v, Var) else Var(w, v, I32, temp=False))
                   for a, v in offsets.items()}
        self.consumer_env = env
        return EvalContext(env, offsets, self.xp)

    def epilogue(self, outs) -> None:
        """Each output through its shared-memory buffer (whole, or in column slices through
        two slots) and a TMA store into its HBM window."""
        plan, w = self.plan, self.w
        n_in = len(plan.inputs)
        w.line()
        whole = []
        for j, (val, ap) in enumerate(zip(outs, plan.outputs)):
            if isinstance(val, SmemRef):
                val = Var(w, str(val), val.aval, temp=False)
            val = self.xp.astype(val, ap.dtype)
            if j not in self.tiled_epilogue:
                w.line(f"{self.out_smem[j]}.at[wg][...] = {val}")
                whole.append(j)
                continue
            for e in range(val.shape[-1] // EPILOGUE_COLUMNS):
                cols = f"{e * EPILOGUE_COLUMNS}:{(e + 1) * EPILOGUE_COLUMNS}"
                slot = f"{self.out_smem[j]}.at[wg, {e % 2}]"
                w.line("plgpu.wait_smem_to_gmem(1, wait_read_only=True)")
                w.line(f"{slot}[...] = {val}[{', '.join([':'] * (val.ndim - 1) + [cols])}]")
                w.line("plgpu.commit_smem()")
                cut = (ap.names[-1], e * EPILOGUE_COLUMNS, EPILOGUE_COLUMNS)
                w.line(f"plgpu.copy_smem_to_gmem({slot}, "
                       f"{self.gmem_window(ap, self.gmem[n_in + j], True, cut=cut)})")
        if whole:
            w.line("plgpu.commit_smem()")
        for j in whole:
            w.line(f"plgpu.copy_smem_to_gmem({self.out_smem[j]}.at[wg], "
                   f"{self.gmem_window(plan.outputs[j], self.gmem[n_in + j], True)})")
        # a persistent program waits only for the stores' reads of shared memory (its next
        # tile writes there), and for their writes to HBM once, after its last tile
        w.line("plgpu.wait_smem_to_gmem(0, wait_read_only=True)" if self.persistent
               else "plgpu.wait_smem_to_gmem(0)")

    def reduction_scratch(self) -> None:
        """Mosaic reserves shared memory for cross-warp reductions in a kernel that reduces."""
        if any(re.search(rf"\bjnp\.{r}\(", line) for line in self.w.live_lines()
               for r in ("sum", "max", "min", "mean", "prod")):
            from jax.experimental.pallas import mosaic_gpu as plgpu
            scratch = plgpu.CompilerParams().reduction_scratch_bytes
            self.smem["reduction scratch"] = -(-scratch // SMEM_ALIGNMENT) * SMEM_ALIGNMENT

    def skip_bounds(self, sp):
        """The chunks [lo, hi) this program's pipeline visits: all, or — with tile skipping
        from causal / window masks (plan.SkipPlan) — those holding a key some row of the
        program's tile keeps; a tile with a fully masked row visits all (its guard makes the
        row zero).  Ints, or names of values of this program written into the kernel."""
        skip = sp.skip
        if skip is None:
            return 0, sp.chunks
        if skip.static is not None:
            return skip.static
        w, s, n, g = self.w, sp.chunk, sp.size, skip.tile
        first = self.starts[skip.query]
        last = w.reserve(f"{skip.query}_last")
        w.line(f"{last} = jnp.minimum({first} + {g.tile}, {g.size}) - 1")

        def key_range(row):
            low = f"jnp.maximum({row} + {skip.low}, 0)" if skip.low is not None else "0"
            return low, f"jnp.minimum({row} + {skip.high}, {n})"
        w.comment(f"tile skipping: only the chunks of {sp.axis} holding a key the "
                  f"{'/'.join(skip.kinds)} mask keeps for a row of this tile")
        (a0, b0), (a1, b1) = key_range(first), key_range(last)
        empty = w.reserve(f"{skip.query}_masked_row")
        w.line(f"{empty} = ({a0} >= {b0}) | ({a1} >= {b1})")
        lo = 0
        if skip.low is not None:
            lo = w.reserve(f"{sp.axis}_lo")
            w.line(f"{lo} = jnp.where({empty}, 0, {a0} // {s}).astype(jnp.int32)")
        hi = w.reserve(f"{sp.axis}_hi")
        w.line(f"{hi} = jnp.where({empty}, {sp.chunks}, ({b1} + {s - 1}) // {s})"
               f".astype(jnp.int32)")
        self.notes.append(f"stream {sp.axis}: tile skipping (the pipeline's steps per "
                          f"program from the {'/'.join(skip.kinds)} masks); the masks apply "
                          f"only in chunks they do not keep whole")
        return lo, hi

    def visited(self) -> int:
        """Chunks the stream visits over all programs (the traffic of tile skipping)."""
        sp, plan = self.stream_plan, self.plan
        skip = sp.skip
        programs = int(np.prod(plan.launch_shape))
        if skip is None:
            return programs * sp.chunks
        if skip.static is not None:
            return programs * max(skip.static[1] - skip.static[0], 1)
        g, s, n = skip.tile, sp.chunk, sp.size
        total = 0
        for t in range(g.tiles):
            first = t * g.tile
            last = min(first + g.tile, g.size) - 1
            lo0 = max(first + skip.low, 0) if skip.low is not None else 0
            lo1 = max(last + skip.low, 0) if skip.low is not None else 0
            hi0, hi1 = min(first + skip.high, n), min(last + skip.high, n)
            if lo0 >= hi0 or lo1 >= hi1:
                lo, hi = 0, sp.chunks
            else:
                lo, hi = (lo0 // s if skip.low is not None else 0), -(-hi1 // s)
            total += max(hi - lo, 1)
        return total * programs // g.tiles

    def check_registers(self):
        """A consumer's registers: its state and the largest tile it computes, in f32, over
        its 128 threads, must fit what setmaxnreg gives it (else it would spill)."""
        if not self.stream_box:
            return
        W = self.split.consumers
        avals = self.state_avals()
        first, last, state_lines, carry = self.step_lines
        live = self.w.live_indices()
        temps = [(line, n, shape) for line, (n, shape) in self.w.sizes.items()
                 if first <= line < last and line not in state_lines and line in live]

        def in_place(line, shape) -> bool:  # computed from a state value of its shape
            return any(sh == shape and re.search(rf"\b{name}\b", self.w.lines[line])
                       for name, sh in carry.items())
        # a temporary computed from the state (the rescaled accumulator) is updated in
        # place; any other tile (scores, probabilities — even of the state's shape) lives
        # beside the state, with its predecessor while it is computed
        peak = max([n if in_place(line, sh) else 2 * n for line, n, sh in temps], default=0)
        held = 0  # the late product's A, carried to the next step (in registers of 4 B)
        if self.deferred is not None:
            a = self.deferred.a
            held = math.prod(a.shape) * a.dtype.itemsize / 4
        need = int((sum(math.prod(v.shape) for v in avals) + peak + held) / THREADS)
        have = consumer_registers(W)
        self.notes.append(f"registers per consumer thread: ~{need} of {have} (setmaxnreg)")
        if need > have and self.deferred is not None:
            raise NotDeferred(f"~{need} registers per consumer thread with the late product's "
                              f"operand held, {have} left")
        if need > have:
            raise NapkinError(f"a consumer warpgroup needs ~{need} registers per thread (its "
                              f"state and tiles) and {W} consumers leave {have}: choose smaller "
                              f"tiles")

    def check_shared_memory(self):
        """Mosaic allocates exactly self.smem (checked against the export in the tests);
        over a Hopper block's limit it would fail only at lowering."""
        total = sum(self.smem.values())
        if total > SMEM_LIMIT:
            parts = ", ".join(f"{p} {b:,}" for p, b in self.smem.items() if b)
            raise NapkinError(f"shared memory {total:,} B per block ({parts}) is over Hopper's "
                              f"{SMEM_LIMIT:,} B: choose smaller tiles or fewer stages")

    def state_avals(self):
        spec = self.stream_box.spec
        env = self.consumer_env
        return [jax.ShapeDtypeStruct(tuple(int(sympy.sympify(a.size).subs(env))
                                           for a in t.axes), jnp.float32)
                for t in array_types(spec.init.cod)
                if all(sympy.sympify(a.size).subs(env).is_Number for a in t.axes)]

    def module(self, threads: int) -> Written:
        k, plan = self.k, self.plan
        names = [f"'g{i}'" for i in range(len(plan.launch_dims))]
        grid = plan.launch_shape
        tiles = ""
        if self.persistent:
            names, grid, tiles = ["'sm'"], (SMS,), f", persistent over {plan.launch_shape}"
        args = ", ".join(a.name for a in plan.inputs)
        what = [
            *plan.summary(),
            f"grid:    {grid}{tiles}; {self.split.describe()}"
            + (" + a producer warpgroup (TMA)" if self.stream_box else ""),
            f"shared memory: {sum(self.smem.values())} B (" + ", ".join(
                f"{p} {b}" for p, b in self.smem.items() if b) + ")",
        ]
        head = [f'"""Pallas kernel (Mosaic GPU backend) for {k.name}, written by napkin.lower.',
                "", *what, "",
                "Run it with forward(*inputs) on a Hopper GPU, interpret=True on a CPU.", '"""',
                "import jax", "import jax.numpy as jnp", "from jax import lax",
                "from jax.experimental import pallas as pl",
                "from jax.experimental.pallas import mosaic_gpu as plgpu", "", *VARYING, ""]
        out_type = ", ".join(f"jax.ShapeDtypeStruct({o.shape}, {dtype_name(o.dtype)}"
                             f"{varying_of(args)})"
                             for o in plan.outputs)
        fwd = ["", "",
               "# exp2 as the SFU's ex2.approx (as JAX's own Mosaic attention compiles it)",
               "_PARAMS = plgpu.CompilerParams(approx_math=True)", "",
               f"def {k.symbol('forward')}({forward_params(args)}):",
               f'    """{", ".join(o.name for o in plan.outputs)} = '
               f'{k.symbol("forward")}({args})"""',
               "    extra = {'interpret': plgpu.InterpretGPUParams()} if interpret else {}",
               "    _MODE['interpret'] = bool(interpret)",
               "    try:  # Mosaic's pipelines index in int32 (x64 mode would make them int64)",
               "      with jax.enable_x64(False):",
               f"        return plgpu.kernel({k.symbol('kernel')}, out_type=[{out_type}], "
               f"grid={grid}, grid_names=({', '.join(names)},), num_threads={threads}, "
               f"thread_name='wg', compiler_params=_PARAMS, **extra)({args})",
               "    finally:",
               "        _MODE['interpret'] = False"]
        definitions = "\n".join(["", *(f"# {line}" for line in what if k.suffix)]
                                + self.w.live_lines() + fwd) + "\n"
        source = "\n".join(head) + HELPERS + "\n\n" + definitions
        forward, calls = load_module(source, k, "mosaic")
        launch = {"num_stages": self.stages, "consumer_warpgroups": self.split.consumers}
        return Written(source, forward, calls, launch, list(self.notes),
                       definitions=definitions, backend="mosaic", smem=dict(self.smem),
                       copies=self.copies(), turns=self.turns is not None,
                       deferred=self.deferred is not None)

    def copies(self) -> tuple[dict, dict]:
        """HBM bytes each array's TMA copies move over the whole grid (reads, writes): a
        tile loaded once per consumer, a stream's chunks once per step, an output's tile
        stored once per consumer.  The kernel's copies are these by construction (each
        written above once per program); napkin.lower.traffic reports them for Mosaic
        kernels, whose jaxpr it does not walk."""
        plan, W = self.plan, self.split.consumers
        programs = int(np.prod(plan.launch_shape))
        reads, writes = {}, {}
        for i, ap in enumerate(plan.inputs):
            if i in self.streamed:
                sp = self.stream_plan
                names = [a for a in ap.type.names if a not in ap.squeezed]
                block = [sp.chunk if a == sp.axis else b for a, b in zip(names, ap.kernel_block)]
                reads[ap.name] = self.visited() * self.nbytes(block, ap.dtype)
            else:
                reads[ap.name] = programs * W * self.nbytes(self.consumer_shape(ap), ap.dtype)
        for ap in plan.outputs:
            writes[ap.name] = programs * W * self.nbytes(self.consumer_shape(ap), ap.dtype)
        return reads, writes


def interpret_supported() -> bool:
    """Whether this jax runs Mosaic GPU kernels in interpret mode on a CPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return hasattr(plgpu, "InterpretGPUParams") and \
        "interpret" in inspect.signature(plgpu.kernel).parameters


class MosaicGPU:
    """The Mosaic GPU backend (see the module doc and ``napkin.lower.backends``)."""

    name = "mosaic"
    # TMA boxes and wgmma take any multiple of their granules: no powers of two (192 query
    # rows are the paper's 3 consumer warpgroups); refusal() checks the rest
    rules = BlockRules("Mosaic GPU", pow2=False, dot_min=16, tails=False)
    # pipeline stages of the stream (max_concurrent_steps): the schedule's
    launch = {"num_stages": 2}
    loads = frozenset({"load", "get", "copy_gmem_to_smem"})
    stores = frozenset({"swap", "copy_smem_to_gmem"})

    def check_launch(self, launch: dict) -> None:
        stages = launch["num_stages"]
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise NapkinError(f"num_stages={stages!r}: the Mosaic GPU backend takes a positive "
                              f"integer (the stream's max_concurrent_steps)")

    def refusal(self, plan: KernelPlan) -> str:
        return refusal(plan)

    def profile(self, hw):
        return profile(hw)

    def write(self, kernel, plan: KernelPlan) -> Written:
        why = refusal(plan)
        if why:
            raise NapkinError(f"{kernel.name}: the Mosaic GPU backend cannot write it: {why}")
        stages = int(kernel.launch["num_stages"])
        try:
            return _Spelling(kernel, plan, stages).write()
        except NotDeferred as e:  # the products waited for in turn, as before
            written = _Spelling(kernel, plan, stages, defer=False).write()
            written.notes.append(f"no product runs a step late: {e}")
            return written

    def export(self, kernel, structs, device_kind: str = "NVIDIA H100") -> str:
        """Lower for CUDA on any machine (no GPU needed): the MLIR text holding the
        ``mosaic_gpu_v2`` custom call (:func:`mosaic_module` reads the kernel inside).
        Mosaic lays out shared memory here: an over-budget kernel fails on a CPU too."""
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
            device_kind=device_kind, num_cores=132, platform="gpu"))
        checks = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]

        def f(*xs):
            return kernel(*xs, interpret=False)
        try:
            with jax.sharding.use_abstract_mesh(mesh):
                exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                                        disabled_checks=checks)(*structs)
        except NapkinError:
            raise
        except Exception as e:  # Mosaic's own refusal (layouts, shared memory): one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise NapkinError(f"{kernel.name}: Mosaic GPU does not lower the kernel: "
                              f"{first}") from None
        text = exp.mlir_module()
        if "mosaic_gpu_v2" not in text:
            raise NapkinError("the CUDA export holds no Mosaic GPU kernel")
        return text


MOSAIC = BACKEND = MosaicGPU()
