"""Every library diagram means what its independent plain-jnp reference computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import napkin as nk
from napkin.frontend.library import LIBRARY, get
from napkin.core.errors import NapkinError

AXES = ["q", "x", "d", "a", "b", "c", "h", "k", "r", "n", "v", "e", "batch", "f"]


def rel_err(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-300)


@pytest.mark.parametrize("name", sorted(LIBRARY))
@settings(max_examples=4, deadline=None)
@given(sizes=st.fixed_dictionaries({a: st.integers(1, 9) for a in AXES}), seed=st.integers(0, 2**31))
def test_meaning_matches_reference_float64(name, sizes, seed):
    alg = LIBRARY[name]
    xs = alg.sample(np.random.default_rng(seed), sizes)
    out, ref = np.asarray(nk.evaluate(alg.diagram())(*xs)), np.asarray(alg.reference(*xs))
    # relative to the output's scale, with a floor: an output that cancels to 6e-7 from terms
    # of order 1 (the MLP at sizes of 1) keeps float64 rounding of the terms, not of itself
    assert np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-4) <= 1e-10


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_odd_sizes_and_large_logits(name):
    alg = LIBRARY[name]
    sizes = {a: s for a, s in zip(AXES, [7, 13, 5, 3, 11, 9, 3, 2, 3, 5, 17, 7, 2, 6])}
    xs = alg.sample(np.random.default_rng(1), sizes, scale=30.0)
    out = nk.evaluate(alg.diagram())(*xs)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, alg.reference(*xs)) <= 1e-10


def test_every_algorithm_has_a_summary_and_symbolic_signature():
    for alg in LIBRARY.values():
        d = alg.diagram()
        assert alg.summary and len(d.dom) >= 1 and len(d.cod) == 1
        assert any(not isinstance(a.size, int) for ob in d.dom.inside for a in ob.type.axes)


def test_unknown_algorithm_suggests():
    with pytest.raises(NapkinError, match="did you mean attention"):
        get("atention")


def test_gqa_shares_kv_heads():
    # GQA with r query heads per KV head equals MHA with K, V repeated r times.
    alg = get("gqa")
    xs = alg.sample(np.random.default_rng(2), dict(k=2, r=3, q=4, x=5, d=3))
    Q, K, V = xs
    out = nk.evaluate(alg.diagram())(*xs)
    mha = nk.evaluate(get("mha").diagram())
    ref = mha(Q.reshape(6, 4, 3), np.repeat(K, 3, 0), np.repeat(V, 3, 0)).reshape(2, 3, 4, 3)
    assert rel_err(out, ref) <= 1e-12


def test_causal_mask_fully_masked_rows_are_finite():
    # more queries than keys with offset 0: row 0 sees key 0 only; nothing is NaN
    alg = get("causal_attention")
    xs = alg.sample(np.random.default_rng(3), dict(q=6, x=3, d=2))
    out = np.asarray(nk.evaluate(alg.diagram())(*xs))
    assert np.isfinite(out).all()
    assert rel_err(out, alg.reference(*xs)) <= 1e-10


def test_semantics_under_jit_vmap_grad():
    alg = get("attention")
    f = nk.evaluate(alg.diagram())
    Q, K, V = alg.sample(np.random.default_rng(4), dict(q=5, x=6, d=4))
    np.testing.assert_allclose(jax.jit(lambda *a: f(*a))(Q, K, V), alg.reference(Q, K, V), rtol=1e-12)
    batched = jax.vmap(f, in_axes=(0, None, None))(np.stack([Q, 2 * Q]), K, V)
    np.testing.assert_allclose(batched[1], alg.reference(2 * Q, K, V), rtol=1e-12)
    g = jax.grad(lambda Q: f(Q, K, V).sum())(Q)
    g_ref = jax.grad(lambda Q: alg.reference(Q, K, V).sum())(jnp.asarray(Q))
    np.testing.assert_allclose(g, g_ref, rtol=1e-10)


def test_functor_agrees_with_iterative_evaluation():
    from napkin.core.primitives import EvalContext
    from napkin.core.semantics import functor
    import sympy
    alg = get("softcap_attention")
    Q, K, V = alg.sample(np.random.default_rng(5), dict(q=3, x=4, d=2))
    F = functor(EvalContext({sympy.Symbol("d", integer=True, positive=True): 2}))
    np.testing.assert_allclose(F(alg.diagram())(Q, K, V), nk.evaluate(alg.diagram())(Q, K, V))


def test_large_diagram_no_recursion_limit():
    # 600 boxes: DisCoPy's functor would recurse once per box; evaluate is iterative.
    from napkin import ops
    (n,) = nk.axes("n")

    def chain(X):
        for i in range(600):
            X = ops.add_const(X, 1.0) if i % 2 else ops.scale(X, 0.5)
        return X
    d = nk.trace(chain, {"X": (n,)})
    assert len(d.boxes) >= 600
    out = np.asarray(nk.evaluate(d)(np.zeros(3)))
    expected = 0.0
    for i in range(600):
        expected = expected + 1.0 if i % 2 else expected * 0.5
    np.testing.assert_allclose(out, expected)


def test_fully_masked_rows_mean_zeros():
    # window 4 and more queries than keys: rows q >= x + 3 keep no key at all.
    # softmax of such a row is zero (not the uniform average the fill alone
    # would give), in the diagram and in the reference alike.
    alg = get("sliding_window_attention")
    xs = alg.sample(np.random.default_rng(6), dict(q=12, x=5, d=3))
    out = np.asarray(nk.evaluate(alg.diagram())(*xs))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[8:], 0.0)
    assert np.abs(out[:8]).min() > 0
    assert rel_err(out, alg.reference(*xs)) <= 1e-10
