"""jax.grad through napkin's kernels: the forward kernel's custom_vjp runs the kernels of the
derived backward (one searched program per input's cotangent), in interpret mode here, and
matches jax.grad of the plain-jnp reference at ragged sizes (f32 ≤ 1e-5, bf16 ≤ 3e-2);
jit, vmap and value_and_grad compose with it; a small training step learns."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin as nk
from napkin import ops
from napkin.certify.certificate import size_symbols
from napkin.frontend.library import LIBRARY

SEARCH = {"q": 256, "x": 256, "d": 64, "n": 256, "v": 512, "e": 128, "f": 128, "k": 2,
          "r": 2}
RUN = {"q": 37, "x": 53, "d": 16, "n": 29, "v": 70, "e": 24, "f": 20, "k": 2, "r": 3}


def _fitted(name, dtype="f32"):
    axes = {str(s) for s in size_symbols(LIBRARY[name].diagram())}
    pick = lambda s: {k: v for k, v in s.items() if k in axes}  # noqa: E731
    opt = nk.optimize(name, sizes=pick(SEARCH), dtype=dtype)
    opt.backward  # searched at the search's sizes, then fitted with the forward  # noqa: B018
    return opt.fit(pick(RUN)), pick(RUN)


def _grads(fn, xs, c):
    fl = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.floating)]

    def loss(*fx):
        a = list(xs)
        for i, v in zip(fl, fx):
            a[i] = v
        return jnp.sum(fn(*a).astype(jnp.float32) * c)
    return jax.grad(loss, argnums=tuple(range(len(fl))))(*[xs[i] for i in fl])


def _rel(got, want):
    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                     / jnp.max(jnp.abs(w.astype(jnp.float32)))) for g, w in zip(got, want))


@pytest.mark.parametrize("name", ["attention", "causal_attention", "gqa",
                                  "sliding_window_attention", "softcap_attention",
                                  "cross_entropy", "linear_cross_entropy", "rmsnorm_matmul",
                                  "mlp"])
def test_jax_grad_through_the_kernel_matches_the_reference(name):
    alg = LIBRARY[name]
    opt, sizes = _fitted(name)
    kernel = opt.kernel("triton", interpret=True)
    rng = np.random.default_rng(sum(map(ord, name)))
    xs = [jnp.asarray(x, jnp.float32) if np.asarray(x).dtype.kind == "f" else jnp.asarray(x)
          for x in alg.sample(rng, sizes)]
    c = jnp.asarray(rng.standard_normal(jax.eval_shape(kernel, *xs).shape), jnp.float32)
    got = _grads(kernel, xs, c)
    with jax.enable_x64(True):
        x64 = [x.astype(jnp.float64) if x.dtype == jnp.float32 else x for x in xs]
        want = _grads(alg.reference, x64, c.astype(jnp.float64))
    assert len(got) == len(opt.backward.inputs)
    assert _rel(got, want) <= 1e-5


def test_bf16_gradients_through_attention():
    alg = LIBRARY["attention"]
    opt, sizes = _fitted("attention", "bf16")
    kernel = opt.kernel("triton", interpret=True, dtype="bf16")
    rng = np.random.default_rng(7)
    xs = [jnp.asarray(x, jnp.bfloat16) for x in alg.sample(rng, sizes)]
    c = jnp.asarray(rng.standard_normal((sizes["q"], sizes["d"])), jnp.float32)
    got = _grads(kernel, xs, c)
    assert all(g.dtype == jnp.bfloat16 for g in got)
    with jax.enable_x64(True):
        want = _grads(alg.reference, [x.astype(jnp.float64) for x in xs], c.astype(jnp.float64))
    assert _rel(got, want) <= 3e-2
    # the saved L is stored in f32 (a bf16 L would scale every exp(S − L) by up to e^0.06)
    saving = opt.saving._forward_kernel("triton", True, "bf16")
    outs = jax.eval_shape(saving, *xs)
    assert [o.dtype for o in outs] == [jnp.bfloat16, jnp.float32]
    # ... and the backward reads L, and D = Σ dO ⊙ O where a kernel hands it on, in f32
    for _, piece in opt.backward.pieces:
        kept = piece._statistics()
        assert "L0" in kept and kept <= {"L0", "D0"}


def test_jit_vmap_and_value_and_grad_compose_with_the_kernel():
    alg = LIBRARY["attention"]
    opt, sizes = _fitted("attention")
    kernel = opt.kernel("triton", interpret=True)
    rng = np.random.default_rng(8)
    Q, K, V = [jnp.asarray(rng.standard_normal((3, *x.shape)), jnp.float32)
               for x in alg.sample(rng, sizes)]  # a batch of 3 heads, vmapped

    def loss(Q, K, V):
        return jnp.sum(jnp.tanh(jax.vmap(kernel)(Q, K, V)))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(Q, K, V)
    ref = lambda Q, K, V: jnp.sum(jnp.tanh(jax.vmap(alg.reference)(Q, K, V)))  # noqa: E731
    want_value, want = jax.value_and_grad(ref, argnums=(0, 1, 2))(Q, K, V)
    assert abs(float(value) - float(want_value)) <= 1e-4 * abs(float(want_value)) + 1e-5
    assert _rel(grads, want) <= 1e-5


def test_masked_rows_get_zero_gradients_through_the_kernel():
    q, x, d = nk.axes("q x d")

    @nk.algorithm(Q=(q, d), K=(x, d), V=(x, d))
    def early(Q, K, V):  # queries 0-4 see no key: their rows are masked whole
        s = ops.causal_mask(ops.contract(Q, K, out=(q, x)), q, x, offset=-5)
        return ops.contract(ops.softmax(s, x), V, out=(q, d))
    opt = nk.optimize(early, sizes={"q": 128, "x": 128, "d": 32}, dtype="f32")
    opt.backward  # noqa: B018
    opt = opt.fit({"q": 24, "x": 24, "d": 16})
    kernel = opt.kernel("triton", interpret=True)
    rng = np.random.default_rng(9)
    xs = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((24, 16), (24, 16), (24, 16))]
    c = jnp.ones((24, 16), jnp.float32)
    dq, dk, dv = _grads(kernel, xs, c)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in (dq, dk, dv))
    assert bool(jnp.all(dq[:5] == 0))
    want = _grads(nk.evaluate(early), xs, c)
    assert _rel((dq, dk, dv), want) <= 1e-5


def test_the_backward_programs_certificates_replay():
    opt, _ = _fitted("attention")
    reports = opt.backward.check()
    assert len(reports) == 2 and all(r.ok for r in reports), reports  # dQ; dK and dV
    assert [names for names, _ in opt.backward.pieces] == [("Q",), ("K", "V")]
    assert opt.backward.pieces[0][1].certificate.algorithm == {"grad": "attention", "wrt": "Q",
                                                               "residuals": True}
    assert opt.backward.pieces[1][1].certificate.algorithm["wrt"] == ["K", "V"]
    assert opt.saving.check().ok  # the forward that saves L: its certificate replays too
    assert opt.saving.certificate.algorithm == {"residuals": "attention"}


def test_causal_backward_skips_masked_tiles_and_stays_right():
    alg = LIBRARY["causal_attention"]
    opt = nk.optimize("causal_attention", sizes={"q": 4096, "x": 4096, "d": 128})
    opt.backward  # noqa: B018  (searched at scale: dQ streams the keys)
    small = opt.fit({"q": 200, "x": 200, "d": 16})
    (names, dq), = [(n, o) for n, o in small.backward.pieces if n == ("Q",)]
    shapes = [tuple(dq.sizes[a.name] for a in ob.type.axes) for ob in dq.algorithm.dom.inside]
    notes = dq._forward_kernel("triton", True, "f32").plan(*shapes).notes
    assert any("tile skipping from the q/x masks" in n for n in notes), notes
    # dK, dV: a program per key tile, streaming the queries: the query chunks above the
    # diagonal only
    (_, dkv), = [(n, o) for n, o in small.backward.pieces if n == ("K", "V")]
    shapes = [tuple(dkv.sizes[a.name] for a in ob.type.axes) for ob in dkv.algorithm.dom.inside]
    plan = dkv._forward_kernel("triton", True, "f32").plan(*shapes)
    notes = [n for _, _, spec in plan.steps for n in spec.notes]
    assert any("the query chunks that keep a key of this x tile" in n for n in notes), notes
    kernel = small.kernel("triton", interpret=True, dtype="f32")
    rng = np.random.default_rng(10)
    xs = [jnp.asarray(x, jnp.float32) for x in alg.sample(rng, small.sizes)]
    c = jnp.asarray(rng.standard_normal((200, 16)), jnp.float32)
    got = _grads(kernel, xs, c)
    with jax.enable_x64(True):
        want = _grads(alg.reference, [x.astype(jnp.float64) for x in xs], c.astype(jnp.float64))
    assert _rel(got, want) <= 1e-5


def test_sink_attentions_backward_reads_the_saved_logsumexp():
    """A softmax with a sink saved no L, so each cotangent's program recomputed the row
    statistics first (dQ 6 kernels, the backward 20× the forward).  Its L now holds the
    sink's logit (log-add-exp), P = exp(S − L) and the sink's probability exp(s − L) are
    elementwise, and the backward is FlashAttention-2's.  At ragged sizes, with sinks far
    below and above the scores, jax.grad through the kernels equals float64."""
    alg = LIBRARY["sink_attention"]
    opt = nk.optimize("sink_attention", sizes=dict(h=32, q=4096, x=4096, d=128), dtype="bf16")
    assert "L0" in [ob.name for ob in opt.saving.algorithm.cod.inside]
    assert len(opt.saving.search.best.tiles.launch) == 1  # L fused into the forward's stream
    pieces = dict(opt.backward.pieces)
    assert len(pieces[("Q",)].search.best.tiles.launch) == 1
    assert opt.backward.time_s < 4 * opt.search.best.time_s
    small = opt.fit({"h": 3, "q": 37, "x": 53, "d": 16})
    kernel = small.kernel("triton", interpret=True, dtype="f32")
    rng = np.random.default_rng(14)
    Q, K, V, _ = (jnp.asarray(a, jnp.float32) for a in alg.sample(rng, small.sizes))
    sink = jnp.asarray([-30.0, 0.5, 30.0], jnp.float32)  # the sink: none, some, nearly all
    c = jnp.asarray(rng.standard_normal((3, 37, 16)), jnp.float32)
    got = _grads(kernel, [Q, K, V, sink], c)
    with jax.enable_x64(True):
        want = _grads(alg.reference, [a.astype(jnp.float64) for a in (Q, K, V, sink)],
                      c.astype(jnp.float64))
    assert _rel(got, want) <= 1e-5


def test_a_saved_logsumexp_spares_the_backward_a_pass_over_the_vocabulary():
    """Linear cross-entropy's logsumexp over the vocabulary was recomputed by each
    cotangent's program: dW in 2 kernels (the row statistics first), the backward 8.6× the
    forward.  The forward saves it (L0, as a softmax's L) and the backward reads it: dW is
    one stream over the tokens per vocabulary tile."""
    opt = nk.optimize("linear_cross_entropy", dtype="bf16")
    assert "L0" in [ob.name for ob in opt.saving.algorithm.cod.inside]
    pieces = dict(opt.backward.pieces)
    assert len(pieces[("W",)].search.best.tiles.launch) == 1
    assert opt.backward.time_s < 4 * opt.search.best.time_s
