"""What several test modules build or check the same way: a traced dV stream (the product
that reads a query chunk with its head axis as merged rows) and jax.grad through fitted
kernels against float64."""
import jax
import jax.numpy as jnp
import numpy as np


def dv_stream(head: str, name: str):
    """exp(Q·Kᵀ)·dO with Q, dO carrying ``head`` beside the queries q: grouped over the keys
    x, streamed over q, so a product reads each chunk of Q as (head·q) × d rows."""
    from napkin.core.arrays import axes
    from napkin.core.region import Site
    from napkin.frontend import ops
    from napkin.frontend.trace import trace
    from rewrites import RULES
    h, q, x, d = axes(f"{head} q x d")

    def dv(Q, K, dO):
        return ops.contract(ops.exp(ops.contract(Q, K, out=(h, q, x))), dO, out=(x, d))
    D = trace(dv, {"Q": (h, q, d), "K": (x, d), "dO": (h, q, d)}, name)
    D = RULES["group_partition"].apply(D, Site((), (0, 1, 2)), {"axis": "x"})
    return RULES["stream_partition"].apply(D, Site((0,), (0, 1, 2)), {"axis": "q"})


def grads_match_float64(fitted, alg, seed: int, tol: float) -> None:
    """jax.grad of Σ kernel(...)·c through ``fitted``'s interpret-mode Triton kernel (f32)
    equals jax.grad of ``alg``'s reference in float64, within ``tol`` of the largest."""
    rng = np.random.default_rng(seed)
    xs = [jnp.asarray(a, jnp.float32) for a in alg.sample(rng, fitted.sizes)]
    k = fitted.kernel("triton", interpret=True, dtype="f32")
    c = jnp.asarray(rng.standard_normal(jax.eval_shape(k, *xs).shape), jnp.float32)
    argnums = tuple(range(len(xs)))
    got = jax.grad(lambda *a: jnp.sum(k(*a) * c), argnums=argnums)(*xs)
    with jax.enable_x64(True):
        want = jax.grad(lambda *a: jnp.sum(alg.reference(*a) * c.astype(jnp.float64)),
                        argnums=argnums)(*[a.astype(jnp.float64) for a in xs])
    for g, w in zip(got, want):
        assert np.abs(np.asarray(g, np.float64) - w).max() <= tol * np.abs(w).max()
