"""The device level: one algorithm over several chips joined by links.

A stream whose accumulator has a proved merge (napkin.rewrites' split_stream: merge(state(A),
state(B)) = state(A ∥ B)) folds its chunks in any grouping, so the chunks can live on
different devices; an axis every box is woven over (a group partition's premise) cuts the
work into independent pieces.  The strategies (:mod:`.plan`):

* ``shard``  — the group partition of a woven axis over the devices (heads, a batch, the
  queries): each device runs the single-device program on its share; no communication;
* ``ring``   — the queries sharded (a group partition) and the streamed axis cut into one
  chunk per device, the chunks rotating device to device (``ppermute``, the next issued
  before this one is folded): each device folds every chunk into its state with the
  accumulator's merge, then finalises — ring attention, derived; in zigzag order (2n
  chunks, device i holding i and 2n − 1 − i) a causal ring's devices keep as much as each
  other, and each step is priced by its busiest device's unmasked block pairs;
* ``gather`` — the streamed axis cut over the devices, each folding its chunk from the
  empty state, the partial states gathered and merged (flash-decoding across devices);
* a 2-D mesh — a ring or gather on part of the devices, within each block of another woven
  axis cut over the rest (``Strategy.outer``: GQA's KV heads × a ring).

A box that reads positions along a cut axis (a causal mask, a take) is handed the base of
the device's share (:mod:`napkin.frontend.bases`).  Each is priced (:mod:`.plan`) from the
single-device search at the per-device sizes (the launch model's time) plus the link: bytes
over ``Hardware.link_bytes_per_s`` and ``link_latency_s`` per message, a ring's transfers
overlapped with the compute they hide behind; the choice is the fastest, explained.  Its
certificates (:meth:`.plan.Distributed.certificates`) are the device-level decomposition —
proved rules with the shares as tiles — and each device's program, both replayed by
``napkin check``.  The lowering (:mod:`.spmd`) is JAX's SPMD
engine: ``jax.shard_map`` over a one-axis mesh, ``ppermute`` and ``all_gather``; the
per-device body is the single-device kernel napkin already writes (Pallas on a GPU,
interpret mode on a CPU).
"""
from napkin.devices.plan import Distributed, Priced, distribute
from napkin.devices.strategy import Strategy

__all__ = ["Distributed", "Priced", "Strategy", "distribute"]
