"""The library of algorithms, each a diagram with an independent reference.

Diagrams are stated with the tracer (napkin.frontend.ops); references are written in
plain ``jax.numpy`` with positional axes and share no code with napkin, so a
test comparing the two checks the diagram, not napkin against itself.
Sizes are symbolic: one diagram serves every size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import sympy

from napkin.frontend import ops
from napkin.core.arrays import axes, Axis
from napkin.core.errors import NapkinError
from napkin.frontend.sampling import sample
from napkin.frontend.trace import Array, trace
from napkin.frontend.weave import weave

class _JaxNumpy:
    """jax.numpy, imported when a reference first runs: listing or building the library
    (``napkin algorithms``) needs no JAX, and importing it is most of a short command."""

    def __getattr__(self, name):
        import jax.numpy
        return getattr(jax.numpy, name)


jnp = _JaxNumpy()

SOFTCAP = 30.0
WINDOW = 4
RMS_EPS = 1e-6


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    build: Callable[[str], object]          # dtype -> Diagram
    reference: Callable                      # plain jnp on positional arrays
    inputs: dict = field(default_factory=dict)  # name -> normal | positive | onehot:AXIS | index:AXIS

    def diagram(self, dtype: str = "f32"):
        return self.build(dtype)

    def sample(self, rng: np.random.Generator, sizes: dict, dtype=np.float64, scale=1.0):
        """Random inputs for given axis sizes ({"q": 7, ...}), of this algorithm's kinds
        (one-hot labels, positive values): napkin.frontend.sampling.sample."""
        return sample(self.diagram(), sizes, rng, kinds=self.inputs, scale=scale, dtype=dtype)


LIBRARY: dict[str, Algorithm] = {}

# Sizes the CLI uses when none are given: a transformer layer of today's scale.
DEFAULT_SIZES = {"q": 4096, "x": 4096, "d": 128, "a": 4096, "b": 4096, "c": 4096,
                 "h": 32, "k": 8, "r": 4, "n": 4096, "v": 32768, "e": 4096, "f": 4096,
                 "batch": 8}


def register(name, summary, reference, inputs=None):
    def wrap(build):
        LIBRARY[name] = Algorithm(name, summary, build, reference, inputs or {})
        return build
    return wrap


def get(name: str) -> Algorithm:
    if name not in LIBRARY:
        import difflib
        close = difflib.get_close_matches(name, LIBRARY, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise NapkinError(f"unknown algorithm {name!r}{hint}; known: {', '.join(LIBRARY)}")
    return LIBRARY[name]


# ----------------------------------------------------------------------------- helpers
def _softmax_ref(s, axis=-1):
    m = jnp.max(s, axis=axis, keepdims=True)
    e = jnp.exp(s - m)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def _attention_core(Q, K, V, q, x, d, logits=lambda S: S):
    S = ops.contract(Q, K, out=(q, x), name="QK^T", as_="S")
    S = ops.scale(S, 1 / sympy.sqrt(d.size), as_="S")
    S = logits(S)
    P = ops.softmax(S, x, as_="P")
    return ops.contract(P, V, out=(q, d), name="PV", as_="O")


def _attn_ref(Q, K, V, mask=None, cap=None):
    s = jnp.einsum("...qd,...kd->...qk", Q, K) / np.sqrt(Q.shape[-1])
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    if mask is None:
        return jnp.einsum("...qk,...kd->...qd", _softmax_ref(s), V)
    keep = mask(s.shape[-2], s.shape[-1])
    s = jnp.where(keep, s, -1e30)
    out = jnp.einsum("...qk,...kd->...qd", _softmax_ref(s), V)
    return jnp.where(keep.any(-1)[..., None], out, 0.0)  # a row that keeps no key: zeros


q, x, d = axes("q x d")
a, b, c = axes("a b c")
h, k, r = axes("h k r")
n, v, e = axes("n v e")
(f,) = axes("f")
B = Axis("batch", "batch")


# ----------------------------------------------------------------------------- algorithms
@register("matmul", "C[a,c] = A[a,b] · B[b,c]", lambda A, B_: A @ B_)
def matmul(dtype="f32"):
    return trace(lambda A, B_: ops.contract(A, B_, out=(a, c), name="matmul", as_="C"),
                 {"A": Array(a, b, dtype=dtype), "B": Array(b, c, dtype=dtype)}, "matmul")


@register("batched_matmul", "C[batch,a,c] = A[batch,a,b] · B[batch,b,c] (matmul woven over batch)",
          lambda A, B_: jnp.einsum("zab,zbc->zac", A, B_))
def batched_matmul(dtype="f32"):
    return weave(matmul(dtype), B)


@register("softmax", "P[n,v] = softmax over v of X[n,v]", lambda X: _softmax_ref(X, -1))
def softmax(dtype="f32"):
    return trace(lambda X: ops.softmax(X, v, as_="P"), {"X": Array(n, v, dtype=dtype)}, "softmax")


@register("attention", "O[q,d] = softmax_x(Q·Kᵀ/√d) · V, one head", _attn_ref)
def attention(dtype="f32"):
    return trace(lambda Q, K, V: _attention_core(Q, K, V, q, x, d),
                 {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
                  "V": Array(x, d, dtype=dtype)}, "attention")


@register("mha", "multi-head attention: attention woven over heads h", _attn_ref)
def mha(dtype="f32"):
    return weave(attention(dtype), h)


def _gqa_ref(Q, K, V):
    # Q[k,r,q,d]; K,V[k,x,d]: every query head of group k reads KV head k.
    return _attn_ref(Q, K[:, None], V[:, None])


@register("gqa", "grouped-query attention: r query heads per KV head (Q[k,r,q,d], K,V[k,x,d])",
          _gqa_ref)
def gqa(dtype="f32"):
    # attention woven over the r query heads of a group for Q only (K and V
    # are broadcast along r), then over the KV heads k for every input.
    return weave(weave(attention(dtype), r, inputs=["Q"]), k)


@register("mqa", "multi-query attention: all h query heads share one K,V (Q[h,q,d], K,V[x,d])",
          lambda Q, K, V: _attn_ref(Q, K[None], V[None]))
def mqa(dtype="f32"):
    return weave(attention(dtype), h, inputs=["Q"])


@register("causal_attention", "attention with a causal mask (key index <= query index)",
          lambda Q, K, V: _attn_ref(Q, K, V, mask=lambda m, n_: np.tril(np.ones((m, n_), bool))))
def causal_attention(dtype="f32"):
    return trace(lambda Q, K, V: _attention_core(
        Q, K, V, q, x, d, logits=lambda S: ops.causal_mask(S, q, x, as_="S")),
        {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
         "V": Array(x, d, dtype=dtype)}, "causal_attention")


def _window(m, n_, w=WINDOW):
    i, j = np.arange(m)[:, None], np.arange(n_)[None, :]
    return (j <= i) & (j > i - w)


@register("sliding_window_attention",
          f"causal attention over the last {WINDOW} keys (q - {WINDOW} < x <= q)",
          lambda Q, K, V: _attn_ref(Q, K, V, mask=_window))
def sliding_window_attention(dtype="f32"):
    return trace(lambda Q, K, V: _attention_core(
        Q, K, V, q, x, d, logits=lambda S: ops.window_mask(S, q, x, WINDOW, as_="S")),
        {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
         "V": Array(x, d, dtype=dtype)}, "sliding_window_attention")


@register("softcap_attention", f"attention with logits soft-capped: {SOFTCAP}·tanh(s/{SOFTCAP})",
          lambda Q, K, V: _attn_ref(Q, K, V, cap=SOFTCAP))
def softcap_attention(dtype="f32"):
    return trace(lambda Q, K, V: _attention_core(
        Q, K, V, q, x, d, logits=lambda S: ops.softcap(S, SOFTCAP, as_="S")),
        {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
         "V": Array(x, d, dtype=dtype)}, "softcap_attention")


def _lse_ref(L):
    m = jnp.max(L, axis=-1)
    return m + jnp.log(jnp.sum(jnp.exp(L - m[:, None]), axis=-1))


@register("logsumexp", "l[n] = log Σ_v exp L[n,v]", _lse_ref)
def logsumexp(dtype="f32"):
    return trace(lambda L: ops.logsumexp(L, v, as_="l"), {"L": Array(n, v, dtype=dtype)},
                 "logsumexp")


def _ce_ref(L, label):
    picked = jnp.take_along_axis(L, jnp.asarray(label, jnp.int32)[:, None], axis=-1)[:, 0]
    return _lse_ref(L) - picked


@register("cross_entropy",
          "loss[n] = logsumexp_v L[n,v] − L[n, label[n]]  (integer labels: take_along_axis)",
          _ce_ref, inputs={"label": "index:v"})
def cross_entropy(dtype="f32"):
    def f(L, label):
        picked = ops.take_along_axis(L, label, v, name="pick label", as_="t")
        return ops.sub(ops.logsumexp(L, v, as_="l"), picked, as_="loss")
    return trace(f, {"L": Array(n, v, dtype=dtype), "label": Array(n, dtype="int32")},
                 "cross_entropy")


@register("linear_cross_entropy",
          "loss[n] = cross-entropy of logits X[n,d]·W[d,v] (the logits never materialise once streamed)",
          lambda X, W, Y: (lambda L: _lse_ref(L) - jnp.sum(L * Y, axis=-1))(X @ W),
          inputs={"Y": "onehot:v"})
def linear_cross_entropy(dtype="f32"):
    def f(X, W, Y):
        L = ops.contract(X, W, out=(n, v), name="XW", as_="L")
        picked = ops.contract(L, Y, out=(n,), name="pick label", as_="t")
        return ops.sub(ops.logsumexp(L, v, as_="l"), picked, as_="loss")
    return trace(f, {"X": Array(n, d, dtype=dtype), "W": Array(d, v, dtype=dtype),
                     "Y": Array(n, v, dtype=dtype)}, "linear_cross_entropy")


def _rms_ref(X, G, W):
    ms = jnp.mean(X * X, axis=-1, keepdims=True)
    return (X / jnp.sqrt(ms + RMS_EPS) * G) @ W


@register("rmsnorm_matmul", "Y[n,e] = (X / rms_d(X) · g[d]) · W[d,e]", _rms_ref)
def rmsnorm_matmul(dtype="f32"):
    def f(X, G, W):
        ms = ops.mean(ops.square(X), d, as_="ms")
        inv = ops.rsqrt(ops.add_const(ms, RMS_EPS), as_="inv")
        # scale by the weight first: the per-row factor inv[n] then sits
        # outermost, where normalized_contraction can pull it out of the matmul
        Xn = ops.mul(ops.mul(X, G, as_="Xg"), inv, as_="Xn")
        return ops.contract(Xn, W, out=(n, e), name="matmul", as_="Y")
    return trace(f, {"X": Array(n, d, dtype=dtype), "G": Array(d, dtype=dtype),
                     "W": Array(d, e, dtype=dtype)}, "rmsnorm_matmul")


# ----------------------------------------------------------------------------- new primitives
def _mh_attn_ref(Q, K, V, bias=None, mask=None, sink=None):
    """Multi-head attention in plain jnp: Q[h,q,d], K,V[h,x,d]; ``bias`` [h,q,x] added to the
    scaled scores; ``mask`` [q,x] of kept entries; ``sink`` [h], one extra logit per row."""
    s = jnp.einsum("hqd,hkd->hqk", Q, K) / np.sqrt(Q.shape[-1])
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask[None], s, -1e30)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink[:, None, None])
    e = jnp.exp(s - m)
    z = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        z = z + jnp.exp(sink[:, None, None] - m)
    out = jnp.einsum("hqk,hkd->hqd", e / z, V)
    if mask is not None and sink is None:
        out = jnp.where(mask.any(-1)[None, :, None], out, 0.0)  # a row that keeps no key
    return out


def _alibi_ref(Q, K, V, slopes):
    nq, nx = Q.shape[1], K.shape[1]
    rel = np.arange(nq)[:, None] - np.arange(nx)[None, :]
    bias = -slopes[:, None, None] * rel[None]
    return _mh_attn_ref(Q, K, V, bias=bias, mask=np.tril(np.ones((nq, nx), bool)))


@register("alibi_attention",
          "causal multi-head attention with ALiBi: scores − slope[h]·(q − x) (positions along q "
          "and x)", _alibi_ref)
def alibi_attention(dtype="f32"):
    def fn(Q, K, V, slopes):
        S = ops.contract(Q, K, out=(h, q, x), name="QK^T", as_="S")
        S = ops.scale(S, 1 / sympy.sqrt(d.size), as_="S")
        rel = ops.sub(ops.positions(q, as_="pos_q"), ops.positions(x, as_="pos_x"), as_="q−x")
        S = ops.sub(S, ops.mul(slopes, rel, as_="bias"), as_="S")
        S = ops.causal_mask(S, q, x, as_="S")
        P = ops.softmax(S, x, as_="P")
        return ops.contract(P, V, out=(h, q, d), name="PV", as_="O")
    return trace(fn, {"Q": Array(h, q, d, dtype=dtype), "K": Array(h, x, d, dtype=dtype),
                      "V": Array(h, x, d, dtype=dtype), "slopes": Array(h, dtype=dtype)},
                 "alibi_attention")


@register("sink_attention",
          "multi-head attention with one learned sink logit per head (sink[h]: softmax mass "
          "without a value)", lambda Q, K, V, sink: _mh_attn_ref(Q, K, V, sink=sink))
def sink_attention(dtype="f32"):
    def fn(Q, K, V, sink):
        S = ops.contract(Q, K, out=(h, q, x), name="QK^T", as_="S")
        S = ops.scale(S, 1 / sympy.sqrt(d.size), as_="S")
        P = ops.softmax(S, x, sink=sink, as_="P")
        return ops.contract(P, V, out=(h, q, d), name="PV", as_="O")
    return trace(fn, {"Q": Array(h, q, d, dtype=dtype), "K": Array(h, x, d, dtype=dtype),
                      "V": Array(h, x, d, dtype=dtype), "sink": Array(h, dtype=dtype)},
                 "sink_attention")


def _gelu_ref(z):
    import jax.scipy.special as jsp
    return 0.5 * z * (1.0 + jsp.erf(z / np.sqrt(2.0)))


@register("mlp", "Y[n,f] = gelu(X[n,d]·W1[d,e]) · W2[e,f]  (the exact, erf form of gelu)",
          lambda X, W1, W2: _gelu_ref(X @ W1) @ W2)
def mlp(dtype="f32"):
    def fn(X, W1, W2):
        H = ops.gelu(ops.contract(X, W1, out=(n, e), name="up", as_="U"), as_="H")
        return ops.contract(H, W2, out=(n, f), name="down", as_="Y")
    return trace(fn, {"X": Array(n, d, dtype=dtype), "W1": Array(d, e, dtype=dtype),
                      "W2": Array(e, f, dtype=dtype)}, "mlp")
