"""Algorithms as users outside the project write them — plain JAX through ``napkin.from_jax``
(and one in ``napkin.frontend.ops``) — from the found-from-outside issue: packed-sequence masks,
a T5 relative bias, LayerNorm before a matmul, differential, latent-projection (MLA) and
rotary attention, sigmoid and linear attention, a sink written as a constant.  Each entry:
the function, its argument shapes at a transformer layer's scale, and the axis names.
Used by tests/test_kernel_soundness.py, tests/test_search_scales.py and
benchmarks/search.py (its "forms users write" rows)."""
import jax
import jax.numpy as jnp

import napkin as nk
from napkin import ops

F = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
I = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
SINK = 0.5


def _masked(q, k, v, keep):
    s = jnp.einsum("hqd,hxd->hqx", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(keep, s, -jnp.inf)
    return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, axis=-1), v)


def document(q, k, v, seg_q, seg_k):  # packed sequences: attend within one's own document
    return _masked(q, k, v, seg_q[:, None] == seg_k[None, :])


def document_causal(q, k, v, seg_q, seg_k):
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    return _masked(q, k, v, (seg_q[:, None] == seg_k[None, :]) & (j <= i))


def prefix_lm(q, k, v, prefix):  # bidirectional over the first `prefix` keys, causal after
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    return _masked(q, k, v, (j <= i) | (j < prefix))


def t5_relative_bias(q, k, v, table):  # table[h, b]: a bias per head and bucket of j − i
    s = jnp.einsum("hqd,hxd->hqx", q, k) / jnp.sqrt(q.shape[-1])
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    bucket = jnp.clip(j - i + 16, 0, 31)
    onehot = (bucket[:, :, None] == jnp.arange(table.shape[1])[None, None, :]).astype(jnp.float32)
    s = s + jnp.einsum("hb,qxb->hqx", table, onehot)  # a one-hot contraction over buckets
    return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, axis=-1), v)


def layernorm_matmul(x, g, b, w):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return ((x - mu) / jnp.sqrt(var + 1e-5) * g + b) @ w


def differential_attention(q1, k1, q2, k2, v, lam):
    def attend(q, k):
        return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=-1) @ v
    return attend(q1, k1) - lam * attend(q2, k2)


def latent_attention(q, c, wk, wv):  # MLA-style: keys and values projected from a latent c
    k, v = c @ wk, c @ wv
    return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=-1) @ v


def rotary_attention(q1, q2, k1, k2, v, cq, sq, ck, sk):  # d in halves, rotated by angle
    qa, qb = q1 * cq - q2 * sq, q1 * sq + q2 * cq
    ka, kb = k1 * ck - k2 * sk, k1 * sk + k2 * ck
    s = (qa @ ka.T + qb @ kb.T) / jnp.sqrt(2.0 * q1.shape[-1])
    return jax.nn.softmax(s, axis=-1) @ v


def sigmoid_attention(q, k, v):
    return jax.nn.sigmoid(q @ k.T / jnp.sqrt(q.shape[-1])) @ v


def linear_attention(q, k, v):
    return (q @ k.T) @ v


def constant_sink(q, k, v):  # a sink logit written as a constant
    s = q @ k.T / jnp.sqrt(q.shape[-1])
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), SINK)
    p = jnp.exp(s - m)
    return (p @ v) / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(SINK - m))


def _heads(n=16):
    return [F(n, 4096, 128)] * 3, ["h q d", "h x d", "h x d"]


# name -> (function, argument shapes, axis names)
FORMS = {
    "document": (document, [*_heads()[0], I(4096), I(4096)], [*_heads()[1], "q", "x"]),
    "document_causal": (document_causal, [*_heads()[0], I(4096), I(4096)],
                        [*_heads()[1], "q", "x"]),
    "prefix_lm": (prefix_lm, [*_heads()[0], I()], [*_heads()[1], ""]),
    "t5_relative_bias": (t5_relative_bias, [*_heads()[0], F(16, 32)], [*_heads()[1], "h b"]),
    "layernorm_matmul": (layernorm_matmul, [F(4096, 4096), F(4096), F(4096), F(4096, 4096)],
                         ["n d", "d", "d", "d e"]),
    "differential_attention": (differential_attention, [F(4096, 128)] * 5 + [F()],
                               ["q d", "x d", "q d", "x d", "x e", ""]),
    "latent_attention": (latent_attention, [F(4096, 128), F(4096, 512), F(512, 128),
                                            F(512, 128)], ["q d", "x r", "r d", "r e"]),
    "rotary_attention": (rotary_attention, [F(4096, 64)] * 4 + [F(4096, 128)] + [F(4096, 64)] * 4,
                         ["q h", "q h", "x h", "x h", "x e", "q h", "q h", "x h", "x h"]),
    "sigmoid_attention": (sigmoid_attention, [F(4096, 128)] * 3, ["q d", "x d", "x d"]),
    "linear_attention": (linear_attention, [F(4096, 128)] * 3, ["q d", "x d", "x d"]),
    "constant_sink": (constant_sink, [F(4096, 128)] * 3, ["q d", "x d", "x d"]),
}


def imported(name: str):
    """The form as a diagram (napkin.from_jax), its sizes the shapes above."""
    fn, structs, axes = FORMS[name]
    return nk.from_jax(fn, *structs, axes=axes)


n, d, e = nk.axes("n d e")


@nk.algorithm(X=(n, d), G=(d,), B=(d,), W=(d, e))
def layernorm_matmul_ops(X, G, B, W):
    """LayerNorm → matmul in napkin.frontend.ops (x − μ read twice: by the variance and the norm)."""
    xc = ops.sub(X, ops.mean(X, d))
    var = ops.mean(ops.square(xc), d)
    y = ops.add(ops.mul(ops.mul(xc, ops.rsqrt(ops.add_const(var, 1e-5))), G), B)
    return ops.contract(y, W, out=(n, e))
