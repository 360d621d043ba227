"""The launch model: how a GPU runs each kernel of a program at given tiles.

The roofline (``Cost.time_s``) prices a program as if the whole chip worked on it at once,
with unbounded on-chip memory.  A GPU runs each kernel as a grid of thread blocks, and this
module prices that, per kernel (:func:`napkin.schedule.resources.kernels`) and per tile point
of a :class:`napkin.cost.grid.Grid`, for a profile whose ``register_budget`` is set:

* **launch parameters** — warps per block: the fewest of ``warps_per_block`` whose threads
  hold the block's register-resident values within ``register_budget`` registers each,
  with no more warp groups than its matrix products have rows for (``mma_m`` each);
  pipeline stages: the most, up to ``pipeline_stages``, whose chunk buffers fit the block's
  shared memory (``smem_per_block_max_bytes``) — at two or more, with one buffer for each chunk
  read elementwise on its way into a product, which the compiler's pipeline copies ahead too
  (``KernelResources.pipelined``).  A point whose one-stage buffers do not fit
  is infeasible (the reason says by how much).  A warp-specialised block (a profile with
  ``producer_warps``: Mosaic GPU's) has a producer warp group that only copies, and as many
  consumer warp groups as divide its rows; setmaxnreg shares the register file among them
  (:func:`register_budget`), one block an SM.  Registers beyond the budget spill: the
  compiler still builds the kernel, and the spilled bytes are stored and loaded again every
  step, which the time prices at the HBM rate; such a point is chosen only where every
  point of the program spills.  A group inside a block's body (beside other boxes, below
  the groups that make the grid) is a loop the block runs: its trips are sequential steps.
* **occupancy and waves** — blocks per SM (shared memory, registers, ``max_blocks_per_sm``);
  a grid of B blocks on S SMs with k blocks each runs ceil(B / (S·k)) waves; the chip's
  useful fraction is B / (waves·S·k), or the busy SMs' share when one partial wave leaves
  SMs idle.
* **time** — per kernel: ``launch_s`` + max(roofline ÷ useful fraction, waves × (a load's
  ``memory_latency_s`` + a block's sequential steps × ``step_s``)); with a single stage, loads
  and compute do not overlap (their sum, not their max).  A program's time is its kernels'
  sum.  The compute is the busiest unit's (tensor cores, vector ALUs, SFU) where they run
  at once — several blocks an SM, two consumers taking turns, or a stream whose step the
  schedule says may run its product a step late (``Loop.overlap``) — and a warp-specialised
  block's single consumer otherwise waits for its products: tensor cores, then the rest.
  A warp-specialised block, alone on its SM, has only its own pipeline to hide a load's
  latency: its stages are the fewest (2 up to ``pipeline_stages``, as many as fit)
  whose buffers, each held for a load's latency, its transfer and its step, keep a step
  running every step (:func:`_depth`), and what they leave uncovered stalls every step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import sympy

from napkin.cost.model import combined, compute_times, evaluate_on, fold, value_at
from napkin.core.memo import IdentityMemo
from napkin.hardware import SETMAXNREG
from napkin.schedule.nest import Loop, Move
from napkin.schedule.resources import at_stages, block_level

REGISTER_OVERHEAD = 32  # [EST] registers a thread spends on indices, addresses and loop state
THREADS_PER_WARP = 32


@dataclass
class KernelLaunch:
    """One kernel at every point of a grid (arrays of the grid's length)."""
    name: str
    warps: np.ndarray
    stages: np.ndarray
    smem: np.ndarray           # bytes per block at the chosen stages
    smem1: np.ndarray          # bytes per block at one stage
    registers: np.ndarray      # data registers per thread at the chosen warps
    spilled: np.ndarray        # bytes per block beyond the register budget (spilled)
    blocks_per_sm: np.ndarray
    ctas: np.ndarray
    waves: np.ndarray
    fits: np.ndarray
    why: str                   # at one point: "" where it fits, else the budget it breaks
    time: np.ndarray

    def at(self, i: int) -> dict:
        """The launch at point ``i``: what a kernel is written with and a reader checks."""
        return {"kernel": self.name, "num_warps": int(self.warps[i]),
                "num_stages": int(self.stages[i]), "smem_bytes": int(self.smem[i]),
                "registers_per_thread": int(math.ceil(self.registers[i])),
                "spilled_bytes": int(self.spilled[i]),
                "blocks": int(self.ctas[i]), "blocks_per_sm": int(self.blocks_per_sm[i]),
                "waves": int(self.waves[i])}


def modelled(hw) -> bool:
    """Whether ``hw`` states a launch model (else tiles are priced by the roofline alone)."""
    return getattr(hw, "register_budget", None) is not None


class Launches:
    """Every kernel of a grid's program, launched at every point of the grid.  Only the
    totals are kept (fits, time, the least each budget must be): a search holds a grid per
    state, and a point's details are worked out again when asked for (:meth:`at`)."""

    def __init__(self, grid):
        self.grid = grid
        c, shape = grid.c, grid.shape
        # (a view of one part of a program's cost holds that part's: napkin.cost.separable)
        self.resources = c.kernels
        # worked out on the grid's shape, each kernel's arrays broadcast from the dimensions
        # of its own tiles (and summed at their shape first: kernels share tiles)
        # fits: within every budget; runs: within shared memory (registers spill, priced);
        # where some kernel spills at every point, the others still keep to their points
        # that do not (a spilling kernel must not license its neighbours' spills)
        fits, runs, spill_least, spilled, time = [], [], [], [], []
        self.least_smem = 0.0
        self.excess = 0.0  # bytes by which the kernels' smallest points break the budget
        limit = smem_limit(c.hardware)
        for k in self.resources:
            kl, dims = self._on_grid(k, c, grid)
            ok = kl.fits.reshape(dims)
            clean = ok & (kl.spilled.reshape(dims) == 0)
            runs.append(ok)
            fits.append(clean)
            spill_least.append(clean if clean.any() else ok)
            spilled.append(kl.spilled.reshape(dims))  # bytes spilled per block
            time.append(kl.time.reshape(dims))
            smem = float(kl.smem1.min())  # (its least on its own grid is its least here)
            self.least_smem = max(self.least_smem, smem)
            self.excess += max(0.0, smem - limit)
        self.fits, self.runs, self.spill_least = (
            combined(parts, shape, np.logical_and, True).reshape(-1)
            for parts in (fits, runs, spill_least))
        self.spilled, self.time = (combined(parts, shape).reshape(-1)
                                   for parts in (spilled, time))

    @classmethod
    def _on_grid(cls, k, c, grid) -> tuple[KernelLaunch, tuple]:
        """One kernel on the grid of the tiles it reads (memoised: the search meets the same
        kernel in state after state, each time in a program with other tiles), and the shape
        its arrays take to broadcast over ``grid`` (its tiles' dimensions; 1 elsewhere)."""
        own = read_symbols(k)
        tiles = [j for j, t in enumerate(grid.free) if t in own]
        cands = tuple((grid.free[j], tuple(grid.cands[grid.free[j].name])) for j in tiles)
        sizes = tuple(sorted(grid.sizes.items()))

        def make():
            sub = np.meshgrid(*[np.array(v, dtype=float) for _, v in cands], indexing="ij")
            axis_of = {t: g.ravel() for (t, _), g in zip(cands, sub)}
            m = sub[0].size if sub else 1
            return cls._kernel(k, c, lambda e: evaluate_on(e, grid.sizes, axis_of, m), m)
        kl = _ON_GRID.get((k, c.hardware), make, (cands, sizes))
        dims = tuple(grid.shape[j] if j in tiles else 1 for j in range(len(grid.shape)))
        return kl, dims

    def _at(self, i: int) -> list[KernelLaunch]:
        return self.point(self.grid, i)

    @classmethod
    def point(cls, grid, i: int) -> list[KernelLaunch]:
        """Each kernel of ``grid``'s program launched at point ``i`` alone (no arrays over
        the grid: what a slimmed grid still answers)."""
        env = {**grid.sizes, **grid.values(i)}
        ev = lambda e: np.array([value_at(e, env)])  # noqa: E731
        return [cls._kernel(k, grid.c, ev, 1) for k in grid.c.kernels]

    def at(self, i: int) -> list[dict]:
        """Each kernel's launch at point ``i``."""
        return [k.at(0) for k in self._at(i)]

    def shortfall(self) -> dict:
        """The least the block level's shared memory must be for some point to fit (the
        neediest kernel's smallest point)."""
        return {self.grid.c.levels[block_level(self.grid.c.levels)]: self.least_smem}

    def why(self, i: int) -> str:
        """Why point ``i`` does not launch ("" when it does)."""
        return "; ".join(f"{k.name}: {k.why}" for k in self._at(i) if k.why)

    @staticmethod
    def _kernel(k, c, ev, n) -> KernelLaunch:
        hw = c.hardware
        smem1, stage = k.smem_bytes(ev) + np.zeros(n), ev(k.stage)
        # warps: the fewest whose threads hold the register-resident values, and no more
        # warp groups than the matrix products have rows for (M = mma_m per warp group);
        # a warp-specialised block's consumers are its rows' split, whatever they hold
        choices = sorted(hw.warps_per_block)
        per_thread = lambda w: k.registers_per_thread(ev, w)  # noqa: E731
        groups = (np.maximum(np.floor(ev(k.rows) / _mma_m(hw)), 1) + np.zeros(n)
                  if k.rows is not None else None)
        if hw.producer_warps:
            warps = _consumer_warps(hw, groups, n)
        else:
            most = np.full(n, float(choices[-1]))
            if groups is not None:
                warp_groups = groups * hw.warpgroup_threads // THREADS_PER_WARP
                most = np.full(n, float(choices[0]))
                for w in choices:
                    most = np.where(w <= warp_groups, np.maximum(most, w), most)
            warps = most.copy()
            for w in reversed(choices):
                warps = np.where((w <= most) & (per_thread(w) <= hw.register_budget), w, warps)
        budget = register_budget(hw, warps)
        regs = per_thread(warps)
        # stages: the most whose chunk buffers fit the block's shared memory (the profile's
        # per-block limit, or a smaller capacity its block level states)
        limit = smem_limit(c.hardware)
        # (a block of one sequential step has nothing to load ahead: one buffer, as the
        # compiler allocates; its loads still overlap other blocks' work, as a stream-less
        # kernel's do)
        steps = np.maximum(ev(k.steps) + np.zeros(n), 1)
        # (a compiler's pipeline also copies the chunks read elementwise into a product to
        # shared memory, once each; a warp-specialised block's producer copies only what it
        # is written to: napkin.lower.backends.mosaic_gpu counts its own)
        piped = 0.0 if hw.producer_warps else ev(k.pipelined)
        stages = np.zeros(n)
        for s in range(1, hw.pipeline_stages + 1):
            stages = np.where((at_stages(smem1, stage, piped, s) <= limit)
                              & ((s == 1) | (steps > 1)), s, stages)
        smem = at_stages(smem1, stage, piped, np.maximum(stages, 1))
        fits = stages >= 1
        # the reason is words for one point (a grid's worth of strings would cost seconds)
        why = "" if n != 1 or fits[0] else \
            f"{int(smem1[0]):,} B of shared memory per block (limit {int(limit):,})"
        # registers beyond the budget spill to local memory (the compiler still builds the
        # kernel; it is slow): priced below, out and back every step
        spilled = np.maximum(regs - budget, 0) * 4 * THREADS_PER_WARP * warps
        # occupancy: blocks per SM by shared memory, registers and the hardware's cap
        alloc = np.minimum(hw.registers_per_thread_max,
                           np.ceil((regs + REGISTER_OVERHEAD) / 8) * 8)
        by_regs = hw.registers_per_sm_bytes // np.maximum(alloc * 4 * THREADS_PER_WARP * warps, 1)
        by_smem = np.where(smem > 0, hw.smem_per_sm_bytes // np.maximum(smem, 1),
                           hw.max_blocks_per_sm)
        per_sm = np.maximum(np.minimum(np.minimum(by_regs, by_smem), hw.max_blocks_per_sm), 1)
        if hw.producer_warps:  # setmaxnreg hands one block the SM's whole register file
            per_sm = np.ones(n)
        ctas = np.maximum(np.round(ev(k.ctas)), 1)
        slots = hw.sms * per_sm
        waves = np.ceil(ctas / slots)
        useful = np.where(ctas >= slots, ctas / (waves * slots),
                          np.minimum(ctas, hw.sms) / hw.sms)
        # the kernel's own roofline: bytes into each level, and compute, per launch
        totals, blocks = fold(k.loop), ev(k.loop.trips)  # one block's, times the blocks
        moved_b = {}
        for table in (totals.loads_b, totals.stores_b):
            for lv, t in table.items():
                moved_b[lv] = moved_b.get(lv, 0) + sum(t.values(), 0)
        parts = [blocks * ev(moved_b.get(lv, 0)) / hw.level(lv).bandwidth_bytes_per_s
                 for lv in c.levels[1:]]
        # re-reads of operands the L2 holds (the blocks of a grid read the same tiles of
        # a broadcast input): HBM once, then L2's bandwidth (a part of their own where the
        # profile has no L2 level, else the level under it already prices them)
        saved = _l2_reuse(k, c, ev, blocks, totals)
        if saved is not None:
            through = blocks * ev(moved_b.get(c.levels[1], 0))
            parts[0] = (through - saved) / hw.level(c.levels[1]).bandwidth_bytes_per_s
            if "l2" not in c.levels:
                parts.append(through / hw.l2_bytes_per_s)
        # spilled registers: out and back every step, priced at the HBM rate (local
        # memory is backed by it, and a spilling kernel waits on every round trip)
        parts.append(2 * ctas * spilled * steps / hw.memory_bandwidth)
        units = {u: np.broadcast_to(ev(t), (n,))
                 for u, t in compute_times(totals.flops, hw).items()}
        tensor, other = units["tensor"], np.maximum(units["vector"], units["sfu"])
        if hw.producer_warps:
            # a warp-specialised block is alone on its SM: a consumer's tensor cores run
            # beside its other work only where the schedule says the step's product may run
            # a step late (Loop.overlap), or where two consumers take turns; else each
            # consumer waits for its products, then works on them
            concurrent = k.overlapped | (warps >= 2 * hw.warpgroup_threads // THREADS_PER_WARP)
            compute = blocks * np.where(concurrent, np.maximum(tensor, other), tensor + other)
        else:  # several blocks an SM, or Triton's own pipelining: the units overlap
            compute = blocks * np.maximum(tensor, other)
        moved = sum(parts, np.zeros(n))
        overlap = np.maximum(np.max(np.stack(parts), axis=0) if parts else 0.0, compute)
        roof = np.where((stages >= 2) | (k.streams == 0) | (steps == 1), overlap, moved + compute)
        # a block waits once for its first loads (a pipeline hides the later ones behind
        # its steps, never its own prologue), then runs its steps; the blocks resident
        # together wait together: a grid of many tiny blocks is bound by this, not bandwidth
        latency = waves * (hw.memory_latency_s + ev(k.steps) * hw.step_s)
        if hw.producer_warps:  # a warp-specialised block is alone on its SM: only its own
            per_step = useful * np.maximum(waves * steps, 1)
            memory = np.max(np.stack(parts), axis=0) if parts else np.zeros(n)
            stages, exposed = _depth(hw, stages, roof / per_step, memory / per_step)
            smem = at_stages(smem1, stage, piped, np.maximum(stages, 1))  # pipeline hides loads
            # a pipeline too shallow stalls every step: the steps run slower than the roof
            roof = roof + useful * waves * steps * exposed
        time = ev(k.launches) * (hw.launch_s + np.maximum(roof / useful, latency))
        return KernelLaunch(k.name, warps.astype(int), np.maximum(stages, 1).astype(int), smem,
                            smem1, regs, spilled, per_sm.astype(int), ctas, waves, fits, why,
                            time)


_ON_GRID = IdentityMemo(20000)
_SYMBOLS = IdentityMemo(20000)
_WHOLE = IdentityMemo(20000)

# [EST] the share of L2 the re-read operands of one kernel may take and still be read from
# HBM once: H100's L2 is two partitions, and a line a far SM reads is copied into its near
# one, so half the capacity holds distinct data
L2_SHARE = 0.5


def _l2_reuse(k, c, ev, blocks, totals):
    """The bytes of kernel ``k``'s loads through the HBM level that its blocks re-read from
    the L2 — each array's loads beyond the whole array, while the arrays re-read fit
    :data:`L2_SHARE` of the L2 (0 where they do not) —, or None where the profile states no
    L2."""
    hw = c.hardware
    if not hw.l2_bytes or not hw.l2_bytes_per_s:
        return None
    top = c.levels[1]
    whole = _WHOLE.get((k,), lambda: _whole_bytes(k.loop, top))
    total = {a: blocks * ev(b) for a, b in totals.loads_b.get(top, {}).items() if a in whole}
    once = {a: ev(whole[a]) for a in total}
    reread = sum((np.where(total[a] > once[a], once[a], 0.0) for a in once), 0.0)
    saved = sum((np.maximum(total[a] - once[a], 0.0) for a in once), 0.0)
    return np.where(reread <= L2_SHARE * hw.l2_bytes, saved, 0.0)


def _whole_bytes(loop, level: str) -> dict:
    """{array: bytes of the whole of what ``loop``'s loads into ``level`` read of it}: each
    load's tile with the axes the loops around it tile at their full extent (the distinct
    tiles of one array, summed: wires of one name)"""
    seen: dict = {}

    def walk(lp, full):
        full = {lp.axis: lp.full, **full} if lp.axis and lp.full is not None else full
        for it in lp.items:
            if isinstance(it, Loop):
                walk(it, full)
            elif isinstance(it, Move) and it.kind == "load" and level in it.levels \
                    and it.values != 0:
                axes = tuple(sorted(a for a, _ in it.dst.axes))
                values = sympy.Mul(*(full.get(a, size) for a, size in it.dst.axes))
                seen[(it.array, axes)] = values * it.bytes / it.values
    walk(loop, {})
    out: dict = {}
    for (a, _), b in seen.items():
        out[a] = sympy.expand(out.get(a, 0) + b)
    return out


def read_symbols(k) -> set:
    """The size and tile symbols a kernel's launch reads."""
    def make():
        totals = fold(k.loop)
        exprs = [*k.smem, k.stage, k.pipelined, *k.registers, k.ctas, k.steps, k.launches,
                 k.loop.trips, *([k.rows] if k.rows is not None else [])]
        for table in (totals.loads_b, totals.stores_b):
            exprs += [e for t in table.values() for e in t.values()]
        exprs += list(totals.flops.values())
        return set().union(*(sympy.sympify(e).free_symbols for e in exprs))
    return _SYMBOLS.get((k,), make)


def smem_limit(hw) -> int:
    """Shared memory one block may use: the profile's per-block limit, or a smaller
    capacity its block level states."""
    block = hw.levels[block_level([lv.name for lv in hw.levels])]
    return min(hw.smem_per_block_max_bytes, block.capacity_bytes)


def consumer_registers(hw, consumers) -> np.ndarray:
    """Registers per thread ``setmaxnreg`` gives each of ``consumers`` consumer warp groups
    of a warp-specialised block: the SM's file less the producer's, shared, in 8s."""
    left = hw.registers_per_sm_bytes // 4 // hw.warpgroup_threads - hw.producer_registers
    return np.minimum(SETMAXNREG[1], left / np.asarray(consumers)) // 8 * 8


def register_budget(hw, warps) -> np.ndarray:
    """Registers of data one thread of ``warps`` (a block's data-holding warps) may hold:
    the profile's ``register_budget``, or in a warp-specialised block that budget scaled
    by what setmaxnreg leaves the consumers (it is stated for one consumer warp group)."""
    if not hw.producer_warps:
        return np.full(np.shape(warps), float(hw.register_budget))
    groups = np.asarray(warps) * THREADS_PER_WARP / hw.warpgroup_threads
    return hw.register_budget * consumer_registers(hw, groups) / consumer_registers(hw, 1)


def _depth(hw, most, step, load) -> tuple:
    """(stages, exposed latency per step) of a warp-specialised block's pipeline.  A chunk's
    buffer is held from its copy's issue until its step is done: a load's
    ``memory_latency_s``, its transfer (``load``: a step's share of the kernel's memory
    time) and the step (``step``: its share of the kernel's time).  To run a step every
    ``step`` the pipeline needs that many steps' worth of buffers (Little's law): the fewest
    stages of 2 up to ``most`` (what fits its shared memory) with (stages - 1) x step >=
    latency + load — a bandwidth-bound stream (load = step) takes 3 or more.  With fewer,
    each step waits (latency + load + step) / stages - step (the exposed latency)."""
    held = hw.memory_latency_s + load
    need = 1 + np.ceil(held / np.maximum(step, 1e-15))
    stages = np.where(most >= 2, np.clip(need, 2, np.maximum(most, 2)), most)
    exposed = np.where(stages >= 2, np.maximum((held + step) / np.maximum(stages, 1) - step,
                                               0.0), 0.0)
    return stages, exposed


def _consumer_warps(hw, groups, n) -> np.ndarray:
    """A warp-specialised block's consumer warps: its rows (``groups`` × mma_m; None: one
    group) cut into as many consumer warp groups as divide them (Mosaic GPU's split: 128
    rows to 2, 192 to 3, 256 to 2)."""
    per_group = hw.warpgroup_threads // THREADS_PER_WARP
    counts = sorted({max(w // per_group, 1) for w in hw.warps_per_block})
    g = np.ones(n) if groups is None else groups
    best = np.full(n, float(counts[0]))
    for c in counts:
        best = np.where((g % c == 0) & (c <= g), c, best)
    return best * per_group


def _mma_m(hw) -> int:
    """Rows one warp group's tensor-core instruction takes (the profile's mma_m; 1 if none)."""
    return max((lv.multiple("mma_m") for lv in hw.levels), default=1)
