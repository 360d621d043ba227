"""The cost model: transfers, memory, FLOPs and time of streamed programs, in sympy.

The model is a fold over the program's schedule (:mod:`napkin.schedule`, the one walk that
decides what moves where and what is live when); ``Cost.schedule`` is that schedule.

    c = cost(program, "h100", dtype="f16")      # symbolic in axis and tile sizes
    c.transfers["smem"]   -> a*b*c/g_a + a*b*c/g_c + a*c        (values; c.transfers_bytes too)
    c.memory["smem"]      -> g_a*g_c + g_a*s_b + g_c*s_b        (peak values per instance)
    c.flops, c.time_s["total"], c.evaluate({"a": 4096, ..., "g_a": 128, ...})
    t = optimize_tiles(program, "h100", {"a": 4096, "b": 4096, "c": 4096}, "f16")
    canonical_form(c).terms -> ((a*c, 0), (2*a*b*c, 1/2))        # H*(M) = Σ α_t·M^(−β_t)
    cost_json(c, sizes); plot_cost(program, "h100", sizes, "cost.png")

Conventions (the paper leaves these open; "Costs" and "Hardware-aware derivation" in the
paper notes):

* **Levels.** A profile's levels run top (GMEM, unbounded) to bottom.  H_ℓ counts the values
  that cross into or out of level ℓ from its parent (loads + stores), summed over **every**
  execution: all groups, all chunks (N·H_group).  A transfer between non-adjacent levels
  crosses every hop in between, so an intermediate level is a pass-through: with no cache
  reuse modelled, H_L2 = H_SMEM for a program grouped at SMEM (``pooled_transfers`` models
  caching).  A group whose level a profile lacks runs at the deepest profile level not below
  it (on a GMEM+SMEM profile from ``two_level``, everything lands at SMEM).
* **Where data is loaded.** Data moves as late as possible: a value enters a group as a view
  of its home level and is loaded where a box of the body reads it, once per execution of
  that body, and stays until its last use there.  Nested groups at the same level are one
  grid (matmul: group a ⊃ group c ⊃ stream b loads the chunks straight from GMEM).
  *Inputs without the grouped axis* are thereby re-sent to every group; a *stream* loads each
  chunk once per enclosing execution (H independent of the chunk), and its inputs without the
  streamed axis once per execution; *outputs* are written once, when produced; the
  accumulator *state stays on chip* (updated in place, never transferred).
* **Top level.** The top-level diagram lives in GMEM (M_GMEM = every array of it).  A box
  outside every group runs as a kernel of its own at SMEM (one group of the whole array):
  it reads all its inputs and writes all its outputs, so an unfused program pays for its
  intermediates (attention without partitions: 2qd + 2xd + 6qx), and its memory is the
  whole operands (infeasible at real sizes, as it should be).
* **Memory (liveness).** M_ℓ = peak live bytes per instance of ℓ (one group per SM):
  the group's loaded inputs (broadcast inputs included) + a stream's state + its current
  chunks + intermediates alive at that step.  A value read only by one elementwise box is
  fused into it (never stored: the partial product of acc += A·B, the rescale of exp); an
  elementwise box writes in place over an input that dies there.  ``intermediates=False``
  drops every intermediate (the paper's count: inputs, chunks, state, outputs).  When steps
  cannot be ordered symbolically, M is a sympy Max of the candidates.
* **Bytes.** ``dtype=None`` prices every array at its own dtype (accumulators f32 as the
  rules build them); ``dtype="f16"`` prices every array, state included, at one dtype (the
  paper's q bytes per value); ``dtype={"Q": "fp8", ...}`` per array name.
* **FLOPs and time.** FLOPs come from the primitives (a size-k contraction 2k per output, as
  ``napkin.core.flops``), split by unit: matrix products (two inputs, each with an output axis of
  its own, and a summed axis) on tensor cores at ``peak_flops`` of their widest input dtype,
  transcendental maps on the SFU, the rest (dot products included) on the vector ALUs
  (a ``tensor:f32`` contraction runs at the vector rate, the profiles' f32 figure).  Roofline:
  t_ℓ = bytes_ℓ / bandwidth into ℓ (chip aggregate); t_compute = max over units;
  **total = max(t_ℓ, t_compute)** (perfect overlap; ``time_s["serial"]`` is the sum, for
  comparison).  Bandwidths and throughputs are whole-chip figures: the model assumes enough
  groups to fill every SM.
* **Tiles.** Tile symbols are the group sizes g_a and chunks s_x of the program
  (``Cost.tiles``, with the axis each tiles and the divisibility the hardware asks:
  coalescing = align_bytes / bytes per value on the contiguous (last) axis of every tile
  moved, tensor-core m/n/k multiples (``mma_*`` of the profile's levels) of each matrix
  product, combined by LCM).  The symbolic model assumes tiles divide their axes (ragged
  last tiles priced as full ones).
* **Deeper groups.** A group at a level below its enclosing body's (a group at L2 holding
  a group at SMEM) stages its inputs in the enclosing level, once per execution there: each
  level then has its own tiles and traffic, as in the multi-level formula
  (H_L2 = 2qd + 2xqd/g_q, H_SMEM = 2qd + 2xqd/w_q for attention grouped twice).

Where the model and the paper's table differ (all by lower-order terms or a stated reason):
attention memory is 2·g_q·d + 2·s_x·d **+ 2·g_q** (running max and sum, which the paper omits)
**+ g_q·s_x + g_q** (the live score tile and one row vector), so the canonical form reads
4qxd(d+2)/M rather than 4qxd²/M (1.6 % at d = 128); multi-head attention moves
2qhd + 2xqhd/g_q, not 2xqhd/(g_q·g_h) — K and V carry h, so grouping heads shares nothing —
with the same optimum 2qhd + 4hxqd²/M once the memory 2·g_h·g_q·d is spent on g_q.
GQA moves 2qhd + 2qkxd/g_q: K/V traffic ÷ r at a fixed g_q (what matters when q is small, as
in decoding), but at a fixed memory the r query heads of a group share the tile, g_q shrinks
by r and H* equals MHA's.  With no cache reuse modelled, SMEM-sized FP16 matmul tiles
(g ≤ 256, intensity g/2 FLOP/B) sit below H100's ridge (295 FLOP/B) and read as HBM-bound;
real kernels are compute-bound through L2 reuse among co-resident blocks, which
``pooled_transfers`` (H*(N·M)) prices.
"""
from napkin.cost.bounds import (
    H800_CLUSTER_BYTES_PER_S, H800_GMEM_SMEM_BYTES_PER_S, cross_transfer_saving, crossover,
    lower_bound, multilevel_time, multilevel_transfers, pooled_transfers, quantisation_factor,
    quantised,
)
from napkin.cost.grid import Grid, candidates
from napkin.cost.model import Cost, CostError, TileInfo, bytes_per_value, cost, value_at
from napkin.cost.optimize import (
    M_SYM, Canonical, Tiles, canonical_form, optimize_tiles, optimum_curve,
)
from napkin.cost.separable import Parts, grid_for
from napkin.cost.report import cost_json, plot_cost

__all__ = [
    "Canonical", "Cost", "CostError", "Grid", "H800_CLUSTER_BYTES_PER_S",
    "H800_GMEM_SMEM_BYTES_PER_S", "M_SYM", "Parts", "TileInfo", "Tiles", "bytes_per_value",
    "candidates", "canonical_form", "cost", "cost_json", "cross_transfer_saving", "crossover",
    "grid_for",
    "lower_bound", "multilevel_time", "multilevel_transfers", "optimize_tiles", "optimum_curve",
    "plot_cost", "pooled_transfers", "quantisation_factor", "quantised", "value_at",
]
