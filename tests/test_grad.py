"""The backward pass as a diagram: every primitive's derivative is proved, napkin.grad of the
library's algorithms and of imported JAX functions matches jax.vjp of an independent
reference in float64, masked rows get zero gradients, and bad requests are one line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin as nk
from napkin import ops
from napkin.certify.certificate import size_symbols
from napkin.frontend.grad import residuals
from napkin.frontend.library import LIBRARY
from proofs import prove_derivatives
from proofs.vjp import WRONG, prove_wrong

import outside_algorithms as oa

F64 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float64)  # noqa: E731
I32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _rel(got, want) -> float:
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
               / max(float(np.max(np.abs(np.asarray(w)))), 1e-300) for g, w in zip(got, want))


def _vjp(fn, xs, cts):
    """jax.vjp of ``fn`` with respect to its floating arguments."""
    fl = [i for i, x in enumerate(xs) if np.asarray(x).dtype.kind == "f"]

    def of_floats(*fx):
        a = list(xs)
        for i, v in zip(fl, fx):
            a[i] = v
        return fn(*a)
    _, back = jax.vjp(of_floats, *[xs[i] for i in fl])
    return back(cts[0] if len(cts) == 1 else tuple(cts))


def _tuple(y):
    return y if isinstance(y, tuple) else (y,)


def test_every_primitive_derivative_is_proved():
    results = prove_derivatives()
    failed = [r.summary() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    kinds = [{o.kind for o in r.obligations} for r in results]
    assert all("numeric" in k for k in kinds)
    assert sum("symbolic" in k for k in kinds) >= 35  # the smooth ones, by sympy too


def test_wrong_derivatives_fail_their_proofs():
    results = prove_wrong()
    assert [r.rule for r in results] == [f"wrong vjp: {n}" for n in WRONG] + [
        "wrong vjp: L saved off by one"]
    for r in results:
        assert not r.ok, r.summary()
        assert any(o.kind == "numeric" for o in r.failed), r.summary()


GRADED = ["attention", "causal_attention", "gqa", "mqa", "sliding_window_attention",
          "softcap_attention", "sink_attention", "alibi_attention", "cross_entropy",
          "linear_cross_entropy", "rmsnorm_matmul", "mlp", "logsumexp", "softmax"]


@pytest.mark.parametrize("name", GRADED)
def test_grad_of_library_algorithms_matches_jax_grad_of_the_reference(name):
    alg = LIBRARY[name]
    d = alg.diagram("f64")
    rng = np.random.default_rng(sum(map(ord, name)))
    sizes = {s: int(v) for s, v in zip(sorted(size_symbols(d)), rng.integers(3, 8, 10))}
    xs = alg.sample(rng, sizes)
    ys = _tuple(nk.evaluate(d, sizes)(*xs))
    cts = [rng.standard_normal(np.shape(y)) for y in ys]
    got = _tuple(nk.evaluate(nk.grad(d), sizes)(*xs, *cts))
    want = _vjp(alg.reference, xs, cts)
    assert len(got) == len(want)
    assert _rel(got, want) <= 1e-9
    # from what the forward saves (its outputs, each softmax's L): the same cotangents
    saved = _tuple(nk.evaluate(residuals(d), sizes)(*xs))
    fl = [i for i, ob in enumerate(d.cod.inside) if ob.type.dtype.startswith("f")]
    extra = [saved[i] for i in fl] + list(saved[len(ys):])
    from_saved = _tuple(nk.evaluate(nk.grad(d, residuals=True), sizes)(*xs, *extra, *cts))
    assert _rel(from_saved, want) <= 1e-9


IMPORTED = {  # FlexAttention-style score_mods and the forms users write, from plain JAX
    "document": (oa.document, [F64(2, 5, 3), F64(2, 7, 3), F64(2, 7, 3), I32(5), I32(7)],
                 ["h q d", "h x d", "h x d", "q", "x"]),
    "prefix_lm": (oa.prefix_lm, [F64(2, 5, 3), F64(2, 7, 3), F64(2, 7, 3), I32()],
                  ["h q d", "h x d", "h x d", ""]),
    "t5_relative_bias": (oa.t5_relative_bias,
                         [F64(2, 5, 3), F64(2, 7, 3), F64(2, 7, 3), F64(2, 32)],
                         ["h q d", "h x d", "h x d", "h b"]),
    "layernorm_matmul": (oa.layernorm_matmul, [F64(5, 6), F64(6), F64(6), F64(6, 4)],
                         ["n d", "d", "d", "d e"]),
    "rotary_attention": (oa.rotary_attention,
                         [F64(5, 2)] * 2 + [F64(7, 2)] * 2 + [F64(7, 3)] + [F64(5, 2)] * 2
                         + [F64(7, 2)] * 2, ["q h", "q h", "x h", "x h", "x e", "q h", "q h",
                                             "x h", "x h"]),
    "softcap_score_mod": (lambda q, k, v: jax.nn.softmax(20 * jnp.tanh(q @ k.T / 20), -1) @ v,
                          [F64(5, 3), F64(7, 3), F64(7, 4)], ["q d", "x d", "x e"]),
}


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_grad_of_imported_jax_functions_matches_jax_grad(name):
    fn, structs, axes = IMPORTED[name]
    d = nk.from_jax(fn, *structs, axes=axes)
    rng = np.random.default_rng(len(name))
    xs = [np.asarray(rng.integers(0, 3, size=s.shape), np.int32) if s.dtype == jnp.int32
          else rng.standard_normal(s.shape) for s in structs]
    ct = rng.standard_normal(np.shape(fn(*xs)))
    got = _tuple(nk.evaluate(nk.grad(d))(*xs, ct))
    assert len(got) == sum(s.dtype != jnp.int32 for s in structs)  # ids get no cotangent
    assert _rel(got, _vjp(fn, xs, [ct])) <= 1e-9


def _attention_with_empty_rows():
    q, x, d = nk.axes("q x d")

    @nk.algorithm(Q=(q, d), K=(x, d), V=(x, d), dtype="f64")
    def attn(Q, K, V):
        s = ops.causal_mask(ops.contract(Q, K, out=(q, x)), q, x, offset=-3)  # rows 0-2: none
        return ops.contract(ops.softmax(s, x), V, out=(q, d))
    return attn


def test_fully_masked_rows_get_zero_gradients_not_nan():
    d = _attention_with_empty_rows()
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s) for s in ((6, 4), (5, 4), (5, 4))]
    ct = rng.standard_normal((6, 4))
    dq, dk, dv = nk.evaluate(nk.grad(d))(*xs, ct)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g))
    assert np.all(dq[:3] == 0)  # a row that kept no key: its output is 0 whatever Q is
    assert _rel((dq, dk, dv), _vjp(nk.evaluate(d), xs, [ct])) <= 1e-9


def test_logits_of_1e4_keep_the_gradient_exact():
    alg = LIBRARY["causal_attention"]
    d = alg.diagram("f64")
    rng = np.random.default_rng(4)
    sizes = {"q": 6, "x": 6, "d": 4}
    xs = alg.sample(rng, sizes)
    xs[0] = xs[0] * 100.0  # logits about ±1e4 (Q·K/√d with |Q| ~ 100·|K|)
    ct = rng.standard_normal((6, 4))
    got = nk.evaluate(nk.grad(d), sizes)(*xs, ct)
    assert all(np.all(np.isfinite(g)) for g in got)
    assert _rel(got, _vjp(alg.reference, xs, [ct])) <= 1e-9


def test_a_value_read_twice_sums_its_cotangents():
    a, = nk.axes("a")

    @nk.algorithm(X=(a,), dtype="f64")
    def f(X):
        return ops.sum_(ops.exp(X) * X + X, a)  # X read three times
    x = np.linspace(-1, 1, 5)
    (g,) = _tuple(nk.evaluate(nk.grad(f))(x, np.asarray(2.0)))
    np.testing.assert_allclose(g, 2 * (np.exp(x) * (1 + x) + 1), rtol=1e-13)


def test_grad_names_what_it_cannot_differentiate():
    fn, structs, axes = IMPORTED["document"]
    d_ = nk.from_jax(fn, *structs, axes=axes)
    ids = [ob.name for ob in d_.dom.inside if ob.type.dtype == "int32"]
    assert len(ids) == 2
    with pytest.raises(nk.NapkinError, match="integer or boolean input has no cotangent"):
        nk.grad(d_, wrt=ids[0])
    with pytest.raises(nk.NapkinError, match="is not an input"):
        nk.grad(d_, wrt="nope")
    assert len(nk.grad(d_, wrt=[0]).cod) == 1
    # a streamed program's bubble declares no derivative: the box is named
    program = nk.optimize("attention", sizes={"q": 256, "x": 256, "d": 64}).program
    with pytest.raises(nk.NapkinError, match=r"grad: box \d+ \(.*\).*declares no derivative"):
        nk.grad(program)


def test_a_stop_gradient_napkin_cannot_honour_is_refused_not_ignored():
    F = jax.ShapeDtypeStruct((4, 5), jnp.float32)
    # JAX's softmax and logsumexp shift by a stopped row max: invariant under the shift
    for fn in (lambda x: jax.nn.softmax(x, -1), lambda x: jax.nn.logsumexp(x, -1)):
        nk.grad(nk.from_jax(fn, F, axes=["a b"]))
    straight_through = nk.from_jax(lambda x: jnp.sum(jax.lax.stop_gradient(x) * x, -1), F,
                                   axes=["a b"])
    with pytest.raises(nk.NapkinError, match=r"stops gradients at .*stop_gradient"):
        nk.grad(straight_through)
