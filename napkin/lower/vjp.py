"""A kernel with a derivative: ``jax.custom_vjp`` around a forward kernel, its backward the
kernels of the derived backward pass (napkin.frontend.grad, searched and lowered like any
program: ``Optimized.backward``).  Differentiated, the forward runs the program that also
saves each softmax's row logsumexp (``Optimized.saving``); the backward reads the inputs,
the floating outputs and those L, and recomputes the rest inside its own kernels.  Integer
inputs (labels, segment ids) get no cotangent, as in JAX."""
from __future__ import annotations

from napkin.core.arrays import array_types
from napkin.core.primitives import FLOATING


def differentiable(forward, algorithm, saving_kernel, backward_kernel):
    """``forward`` (a kernel: inputs -> output or tuple) made differentiable by
    ``saving_kernel()`` (inputs -> the outputs, then what the backward reads beyond them)
    and ``backward_kernel()`` (inputs, the floating outputs, the saved values, then one
    cotangent per floating output -> the floating inputs' cotangents); both are built
    once, when first differentiated."""
    import jax
    import jax.numpy as jnp
    from napkin.lower.sharding import shardable
    ins, outs = array_types(algorithm.dom), array_types(algorithm.cod)
    floating_in = [i for i, t in enumerate(ins) if t.dtype in FLOATING]
    floating_out = [i for i, t in enumerate(outs) if t.dtype in FLOATING]
    built = {}

    def once(key, make):  # each kernel's batch axes keep their sharding (lower/sharding.py)
        if key not in built:
            built[key] = shardable(make())
        return built[key]

    @jax.custom_vjp
    def kernel(*xs):
        return once("forward", lambda: forward)(*xs)

    def kernel_fwd(*xs):
        out = once("saving", saving_kernel)(*xs)
        out = out if isinstance(out, tuple) else (out,)
        ys, saved = out[:len(outs)], out[len(outs):]
        return (ys if len(outs) > 1 else ys[0]), (xs, [ys[i] for i in floating_out], saved)

    def kernel_bwd(res, cts):
        xs, ys, saved = res
        cts = cts if isinstance(cts, tuple) else (cts,)
        seeds = [jnp.zeros(jnp.shape(cts[i]), jnp.result_type(xs[0])) if cts[i] is None
                 else cts[i] for i in floating_out]
        grads = once("backward", backward_kernel)(*xs, *ys, *saved, *seeds)
        grads = grads if isinstance(grads, tuple) else (grads,)
        got = dict(zip(floating_in, grads))
        return tuple(got[i].astype(jnp.result_type(x)) if i in got else None
                     for i, x in enumerate(xs))

    kernel.defvjp(kernel_fwd, kernel_bwd)
    return Differentiable(forward, kernel, [ob.name for ob in algorithm.dom.inside], ins,
                          getattr(algorithm, "boundary", None))


def handed_back(out, xs, dtypes):
    """The outputs in the caller's floating dtype: a kernel fed floating arrays of another
    dtype than its own (bf16 into an f32 kernel) computes in its own — the inputs cast on the
    way in — and hands its floating results back in theirs, as a JAX function of those
    arrays would (one dtype among the caller's floating inputs; mixed ones keep the
    kernel's)."""
    import jax.numpy as jnp
    given = {jnp.result_type(x) for x, dt in zip(xs, dtypes) if jnp.issubdtype(dt, jnp.floating)
             and jnp.issubdtype(jnp.result_type(x), jnp.floating)}
    own = {dt for dt in dtypes if jnp.issubdtype(dt, jnp.floating)}
    if len(given) != 1 or given == own:
        return out
    (want,) = given
    cast = lambda y: y.astype(want) if jnp.issubdtype(y.dtype, jnp.floating) else y  # noqa: E731
    return tuple(cast(y) for y in out) if isinstance(out, tuple) else cast(out)


class Differentiable:
    """A lowered kernel (``forward``: its source, plan, launch, report — every attribute
    reads through) whose call has a derivative.  Inputs by position or by the diagram's
    names (``k(Q=q, K=k, V=v)``); leading axes beyond an input's own are batch axes, mapped
    in one launch (``napkin.lower.call``: (B, H, S, D) for attention's Q[q, d]).  A call
    with ``interpret=`` runs the forward kernel as it is (no derivative).  Floating inputs of
    another dtype than the kernel's are cast in, and its results handed back in theirs.
    ``boundary``: where an imported function's arguments are not the diagram's inputs as
    they are (napkin.frontend.jaxpr.boundary): an argument read twice (self-attention from
    one x: the kernel takes x once and passes it as both inputs; jax.grad sums the two
    cotangents), a dimension the function merges or splits (GQA by jnp.repeat: Q[h, q, d]
    passed as Q[g, h_1, q, d], results merged back)."""

    def __init__(self, forward, fn, names, types, boundary=None):
        self.forward, self._fn = forward, fn
        self.names, self.types = list(names), list(types)
        self.boundary = boundary

    def __call__(self, *arrays, interpret=None, **by_name):
        from napkin.lower.call import bind, call_batched
        if self.boundary is None:
            xs = bind(self.forward.name, self.names, arrays, by_name)
        else:
            xs = self.boundary.inputs(bind(self.forward.name, self.boundary.argnames,
                                           arrays, by_name))
        fn = self._fn if interpret is None else \
            (lambda *a: self.forward(*a, interpret=interpret))
        out = call_batched(fn, self.forward.name, self.names, self.types, xs)
        out = handed_back(out, xs, self.forward.dtypes())
        return out if self.boundary is None else self.boundary.outputs(out)

    def __getattr__(self, name):
        return getattr(self.forward, name)

    def __repr__(self):
        return f"Differentiable({self.forward!r})"
