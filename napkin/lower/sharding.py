"""A kernel's batch axes keep their sharding.

A Pallas call is a custom call XLA's SPMD partitioner cannot see into: under ``jax.jit``,
inputs sharded along an axis the kernel maps (``jax.vmap`` of the kernel over heads sharded
on a mesh, or leading batch axes) were all-gathered onto every device, each device ran the
whole batch, and the result came back replicated.  A batch axis is trivially parallel, so
the kernel says so:

* :func:`shardable` wraps a kernel in ``jax.custom_batching.custom_vmap``: a ``vmap`` of it
  (the user's, or :func:`napkin.lower.call.call_batched`'s for leading batch axes) becomes a
  call with one more leading batch axis on the inputs that carry it (an input broadcast along
  it stays as it is, unless it carries earlier batch axes: then it is broadcast, so every
  batched input has the same leading axes);
* the innermost call, with its leading batch axes explicit, is a
  ``jax.experimental.custom_partitioning`` whose rule keeps the batch axes' sharding (taken
  from the first batched input) and replicates the kernel's own axes; each device runs the
  same kernel, vmapped into its grid, on its shard.

On one device, and inside a ``jax.shard_map`` (manual axes), JAX inlines the call: nothing
changes there.  ``custom_partitioning`` has no differentiation rule, which is why it sits
inside the kernel's ``jax.custom_vjp`` (napkin.lower.vjp), around each of the forward, saving
and backward kernels.
"""
from __future__ import annotations


def shardable(kernel, counts: tuple | None = None):
    """``kernel`` (arrays -> an array or a tuple), its ``vmap`` a call with explicit leading
    batch axes whose sharding is kept.  ``counts``: per input, how many leading batch axes
    it carries (every batched input the same; internal)."""
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def call(*xs):
        return _partitioned(kernel, counts or (0,) * len(xs))(*xs)

    @call.def_vmap
    def _batched(axis_size, in_batched, *xs):
        import jax
        import jax.numpy as jnp
        have = counts or (0,) * len(xs)
        new, more = [], []
        for x, batched, k in zip(xs, in_batched, have):
            if not batched and k:  # earlier batch axes but not this one: broadcast along it
                x = jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
            new.append(x)
            more.append(k + 1 if batched or k else 0)
        out = shardable(kernel, tuple(more))(*new)
        return out, jax.tree.map(lambda _: True, out)
    return call


def _partitioned(kernel, counts: tuple):
    """``kernel`` on inputs with ``counts`` leading batch axes: vmapped into its grid, and
    partitioned along those axes as its inputs are sharded."""
    import jax
    depth = max(counts, default=0)

    def batched(*xs):
        fn = kernel
        for _ in range(depth):
            fn = jax.vmap(fn, in_axes=tuple(0 if c else None for c in counts))
        return fn(*xs)
    if depth == 0:
        return batched
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding, PartitionSpec as P

    def batch_spec(arg_shapes):
        """The batch axes' sharding: the first batched input's."""
        for s, c in zip(arg_shapes, counts):
            if c:
                return (*tuple(s.sharding.spec), *(None,) * depth)[:depth]
        return (None,) * depth  # pragma: no cover — some input carries the batch axes

    def sharding(mesh, spec, rank, c):
        return NamedSharding(mesh, P(*(spec if c else ()), *(None,) * (rank - c)))

    def partition(mesh, arg_shapes, result_shape):
        spec = batch_spec(arg_shapes)
        ins = tuple(sharding(mesh, spec, len(s.shape), c) for s, c in zip(arg_shapes, counts))
        outs = jax.tree.map(lambda r: sharding(mesh, spec, len(r.shape), depth), result_shape)
        return mesh, batched, outs, ins

    def infer(mesh, arg_shapes, result_shape):
        spec = batch_spec(arg_shapes)
        return jax.tree.map(lambda r: sharding(mesh, spec, len(r.shape), depth), result_shape)

    def rule(mesh, values, results):
        """Shardy's rule: batch factors b<i> shared by every batched operand and result, the
        kernel's own dimensions each a factor of their own that must stay whole."""
        own = []

        def factors(rank, c):
            names = [f"b{i}" for i in range(c)]
            for _ in range(rank - c):
                own.append(f"k{len(own)}")
                names.append(own[-1])
            return " ".join(names)
        ins = [factors(len(v.shape), c) for v, c in zip(values, counts)]
        outs = [factors(len(r.shape), depth) for r in results]
        return f"{', '.join(ins)} -> {', '.join(outs)}", {"need_replication_factors": tuple(own)}

    call = custom_partitioning(batched)
    call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule=rule)
    return call
