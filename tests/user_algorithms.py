"""Algorithms a user writes that are not in the library, each an Algorithm with a
plain-jnp reference sharing no code with napkin (`napkin run --from
tests/user_algorithms.py:NAME` compares the kernel with it).  Used by
tests/test_user_algorithms.py; also a gallery of what napkin.frontend.ops states."""
import jax
import jax.numpy as jnp
import numpy as np
import sympy

import napkin as nk
from napkin import ops
from napkin.frontend.library import Algorithm

q, x, d, k, r = nk.axes("q x d k r")
a, b, c, e = nk.axes("a b c e")
CAP = 20.0


def _softmax(s):
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def _arrays(dtype, **shapes):
    return {name: nk.Array(*axes, dtype=dtype) for name, axes in shapes.items()}


def _sigmoid_attention(dtype="f32"):
    def f(Q, K, V):
        S = ops.scale(ops.contract(Q, K, out=(q, x)), 1 / sympy.sqrt(d.size))
        return ops.contract(ops.sigmoid(S), V, out=(q, d))
    return nk.trace(f, _arrays(dtype, Q=(q, d), K=(x, d), V=(x, d)), "sigmoid_attention")


def _l2_attention(dtype="f32"):
    """Queries and keys normalised to unit length (QK-norm), then softmax attention."""
    def unit(X):
        return ops.mul(X, ops.rsqrt(ops.add_const(ops.sum_(ops.square(X), d), 1e-6)))

    def f(Q, K, V):
        S = ops.scale(ops.contract(unit(Q), unit(K), out=(q, x)), 8.0)
        return ops.contract(ops.softmax(S, x), V, out=(q, d))
    return nk.trace(f, _arrays(dtype, Q=(q, d), K=(x, d), V=(x, d)), "l2_attention")


def _softcap_causal_gqa(dtype="f32"):
    """Soft-capped causal attention with r query heads per KV head."""
    def f(Q, K, V):
        S = ops.scale(ops.contract(Q, K, out=(k, r, q, x)), 1 / sympy.sqrt(d.size))
        S = ops.causal_mask(ops.softcap(S, CAP), q, x)
        return ops.contract(ops.softmax(S, x), V, out=(k, r, q, d))
    return nk.trace(f, _arrays(dtype, Q=(k, r, q, d), K=(k, x, d), V=(k, x, d)),
                    "softcap_causal_gqa")


def _linear_attention(dtype="f32"):
    def f(Q, K, V):
        return ops.contract(ops.contract(Q, K, out=(q, x)), V, out=(q, d))
    return nk.trace(f, _arrays(dtype, Q=(q, d), K=(x, d), V=(x, d)), "linear_attention")


def _gemm_chain(dtype="f32"):
    def f(A, B, C):
        return ops.contract(ops.contract(A, B, out=(a, c)), C, out=(a, e))
    return nk.trace(f, _arrays(dtype, A=(a, b), B=(b, c), C=(c, e)), "gemm_chain")


def _hand_written_attention(dtype="f32"):
    """Softmax written by hand (max, sub, exp, sum, div after P·V): recognised, streamed."""
    def f(Q, K, V):
        S = ops.scale(ops.contract(Q, K, out=(q, x)), 1 / sympy.sqrt(d.size))
        P = ops.exp(ops.sub(S, ops.max_(S, x)))
        return ops.div(ops.contract(P, V, out=(q, d)), ops.sum_(P, x))
    return nk.trace(f, _arrays(dtype, Q=(q, d), K=(x, d), V=(x, d)), "hand_written_attention")


def _attn(Q, K, V, scores=lambda s: s):
    s = scores(jnp.einsum("...qd,...xd->...qx", Q, K) / np.sqrt(Q.shape[-1]))
    return jnp.einsum("...qx,...xd->...qd", _softmax(s), V)


def _unit(X):
    return X / jnp.sqrt(jnp.sum(X * X, axis=-1, keepdims=True) + 1e-6)


def _gqa(Q, K, V):
    s = jnp.einsum("krqd,kxd->krqx", Q, K) / np.sqrt(Q.shape[-1])
    s = CAP * jnp.tanh(s / CAP)
    keep = np.tril(np.ones(s.shape[-2:], bool))
    return jnp.einsum("krqx,kxd->krqd", _softmax(jnp.where(keep, s, -1e30)), V)


ALGORITHMS = {
    "sigmoid_attention": Algorithm(
        "sigmoid_attention", "sigmoid attention", _sigmoid_attention,
        lambda Q, K, V: jax.nn.sigmoid(Q @ K.T / np.sqrt(Q.shape[-1])) @ V),
    "l2_attention": Algorithm(
        "l2_attention", "QK-norm attention", _l2_attention,
        lambda Q, K, V: _softmax(8.0 * _unit(Q) @ _unit(K).T) @ V),
    "softcap_causal_gqa": Algorithm(
        "softcap_causal_gqa", "soft-capped causal GQA", _softcap_causal_gqa, _gqa),
    "linear_attention": Algorithm(
        "linear_attention", "linear attention", _linear_attention,
        lambda Q, K, V: (Q @ K.T) @ V),
    "gemm_chain": Algorithm("gemm_chain", "(A·B)·C", _gemm_chain, lambda A, B, C: (A @ B) @ C),
    "hand_written_attention": Algorithm(
        "hand_written_attention", "attention, softmax by hand", _hand_written_attention, _attn),
}
# `--from tests/user_algorithms.py:NAME` names the Algorithm
sigmoid_attention, l2_attention, softcap_causal_gqa, linear_attention, gemm_chain, \
    hand_written_attention = ALGORITHMS.values()
