"""A kernel with a derivative: ``jax.custom_vjp`` around a forward kernel, its backward the
kernels of the derived backward pass (napkin.frontend.grad, searched and lowered like any
program: ``Optimized.backward``).  The backward reads the forward's inputs and recomputes
what it needs of the forward inside its own kernels (the derived diagram replays the
forward; the search decides how it fuses), so the residuals are the inputs themselves.
Integer inputs (labels, segment ids) get no cotangent, as in JAX."""
from __future__ import annotations

from napkin.core.arrays import array_types
from napkin.core.primitives import FLOATING


def differentiable(forward, algorithm, backward_kernel):
    """``forward`` (a kernel: inputs -> output or tuple) made differentiable by
    ``backward_kernel()`` (called once, when first differentiated: inputs, then one
    cotangent per floating output -> the floating inputs' cotangents)."""
    import jax
    import jax.numpy as jnp
    ins, outs = array_types(algorithm.dom), array_types(algorithm.cod)
    floating_in = [i for i, t in enumerate(ins) if t.dtype in FLOATING]
    floating_out = [i for i, t in enumerate(outs) if t.dtype in FLOATING]
    backward = []

    @jax.custom_vjp
    def kernel(*xs):
        return forward(*xs)

    def kernel_fwd(*xs):
        return forward(*xs), xs

    def kernel_bwd(xs, cts):
        if not backward:
            backward.append(backward_kernel())
        cts = cts if isinstance(cts, tuple) else (cts,)
        seeds = [jnp.zeros(jnp.shape(cts[i]), jnp.result_type(xs[0])) if cts[i] is None
                 else cts[i] for i in floating_out]
        grads = backward[0](*xs, *seeds)
        grads = grads if isinstance(grads, tuple) else (grads,)
        got = dict(zip(floating_in, grads))
        return tuple(got[i].astype(jnp.result_type(x)) if i in got else None
                     for i, x in enumerate(xs))

    kernel.defvjp(kernel_fwd, kernel_bwd)
    return Differentiable(forward, kernel)


class Differentiable:
    """A lowered kernel (``forward``: its source, plan, launch, report — every attribute
    reads through) whose call has a derivative.  A call with keywords (``interpret=``) runs
    the forward kernel as it is."""

    def __init__(self, forward, fn):
        self.forward, self._fn = forward, fn

    def __call__(self, *arrays, **options):
        return self.forward(*arrays, **options) if options else self._fn(*arrays)

    def __getattr__(self, name):
        return getattr(self.forward, name)

    def __repr__(self):
        return f"Differentiable({self.forward!r})"
