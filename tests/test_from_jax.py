"""napkin.from_jax: plain JAX functions read into diagrams over named axes — their meaning
equals the function's (float64, random inputs, ragged sizes, other sizes than traced), the
patterns the search streams are read back as primitives, and everything else is one line
naming what and why."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import napkin as nk
from napkin.core.streamed import Group, Stream

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def f32(*shape):
    return S(shape, F32)


def boxes(diagram) -> list[str]:
    return [b.name for b in diagram.boxes if hasattr(b, "spec")]


def same(diagram, fn, *arrays, rtol=1e-10, atol=1e-12):
    """napkin.evaluate(diagram) equals fn on these arrays, in float64 (both jitted: one
    compilation each rather than one per primitive)."""
    with jax.enable_x64(True):
        got, want = jax.jit(nk.evaluate(diagram))(*arrays), jax.jit(fn)(*arrays)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def normal(rng, *shapes):
    return [rng.normal(size=s) for s in shapes]


# ------------------------------------------------------------------ the README example
def score_mod(s, i, j):                      # FlexAttention-style: score, query index, key index
    s = 30.0 * jnp.tanh(s / 30.0)            # soft-capping
    return jnp.where(j <= i, s, -jnp.inf)    # causal


def flex_attention(q, k, v):                 # q[h,q,d], k,v[h,x,d]: plain jnp
    s = jnp.einsum("hqd,hxd->hqx", q, k) / jnp.sqrt(q.shape[-1])
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    p = jax.nn.softmax(score_mod(s, i, j), axis=-1)
    return jnp.einsum("hqx,hxd->hqd", p, v)


def test_the_readme_attention_reads_as_the_library_primitives_and_means_the_same(rng):
    d = nk.from_jax(flex_attention, f32(8, 1024, 64), f32(8, 4096, 64), f32(8, 4096, 64),
                    axes=["h q d", "h x d", "h x d"])
    assert d.sizes == {"h": 8, "q": 1024, "d": 64, "x": 4096}
    assert boxes(d) == ["contract->hqx", "scale(1/sqrt(d))", "softcap(30)", "causal",
                        "softmax_x", "contract->hqd"]
    assert str(d.dom) == "q[h,q,d] @ k[h,x,d] @ v[h,x,d]" or len(d.dom) == 3
    # sizes are symbols: the diagram serves every size, ragged ones included
    same(d, flex_attention, *normal(rng, (3, 7, 5), (3, 11, 5), (3, 11, 5)))
    same(d, flex_attention, *normal(rng, (2, 13, 4), (2, 6, 4), (2, 6, 4)))


def _single_head(q, k, v):
    s = q @ k.T / jnp.sqrt(q.shape[-1])
    keep = jnp.arange(q.shape[0])[:, None] >= jnp.arange(k.shape[0])[None, :]
    s = jnp.where(keep, 30.0 * jnp.tanh(s / 30.0), -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


@pytest.fixture(scope="module")
def streamed():
    d = nk.from_jax(_single_head, f32(300, 128), f32(1001, 128), f32(1001, 128),
                    axes=["q d", "x d", "x d"])
    return d, nk.optimize(d, sizes=d.sizes, dtype="f32")


def _specs(diagram, found=None):
    found = [] if found is None else found
    for b in diagram.boxes:
        spec = getattr(b, "spec", None)
        if isinstance(spec, (Group, Stream)):
            found.append(spec)
            for body in spec.bodies:
                _specs(body, found)
    return found


def test_optimize_streams_the_keys_with_the_softmax_accumulator(streamed):
    d, opt = streamed
    assert opt.sizes == {"q": 300, "x": 1001, "d": 128}
    assert any(m.rule == "stream_partition" and m.params_dict["axis"] == "x" for m in opt.chain)
    streams = [s for s in _specs(opt.program) if isinstance(s, Stream)]
    # 5 query tiles at q = 300: the keys are split in parts, merged by the same accumulator
    assert [(s.axis, s.rule) for s in streams] == [("x", "softmax_contraction"),
                                                  ("x_parts", "softmax_contraction")]


def test_the_kernel_of_an_imported_function_matches_it(streamed, rng):
    _, opt = streamed
    small = opt.fit({"q": 45, "x": 77, "d": 16})
    xs = [a.astype(np.float32) for a in normal(rng, (45, 16), (77, 16), (77, 16))]
    got = small.kernel(interpret=True, dtype="f32")(*xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_single_head(*xs)), rtol=2e-5,
                               atol=2e-6)


# ------------------------------------------------------------------ more algorithms
def test_matmul_named_by_shapes(rng):
    d = nk.from_jax(lambda a, b: a @ b, f32(5, 4), f32(4, 6))
    assert d.sizes == {"n5": 5, "n4": 4, "n6": 6}
    assert boxes(d) == ["contract->n5,n6"]
    same(d, lambda a, b: a @ b, *normal(rng, (9, 3), (3, 2)))   # every size
    opt = nk.optimize(d, sizes=d.sizes, dtype="f32")
    assert opt.sizes == d.sizes


@pytest.mark.parametrize("approximate,name", [(True, "gelu_tanh"), (False, "gelu")])
def test_an_mlp_with_jax_gelu_is_the_gelu_primitive(rng, approximate, name):
    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1, approximate=approximate) @ w2
    d = nk.from_jax(mlp, f32(5, 4), f32(4, 6), f32(6, 3), axes={"x": "n d", "w1": "d e",
                                                                "w2": "e f"})
    assert boxes(d) == ["contract->ne", name, "contract->nf"]
    same(d, mlp, *normal(rng, (7, 3), (3, 5), (5, 2)))


def test_gelu_and_silu_are_read_however_they_are_written(rng):
    from jax.scipy.special import erf

    def f(x):
        return (x * (1 + erf(x / jnp.sqrt(2.0))) / 2, x * jax.nn.sigmoid(x),
                x / (1 + jnp.exp(-x)))
    d = nk.from_jax(f, f32(4, 3), axes=["n d"])
    assert boxes(d) == ["gelu", "silu"]  # both silus are one box: common subexpressions
    same(d, f, *normal(rng, (6, 5)))


def test_rmsnorm_reads_mean_and_rsqrt(rng):
    def rmsnorm(x, g, w):
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g
        return y @ w
    d = nk.from_jax(rmsnorm, f32(5, 4), f32(4), f32(4, 6), axes=["n d", "d", "d e"])
    assert "mean_d" in boxes(d) and "rsqrt" in boxes(d)
    same(d, rmsnorm, *normal(rng, (7, 9), (9,), (9, 3)))


def test_cross_entropy_with_integer_labels_is_logsumexp_and_take_along_axis(rng):
    def ce(logits, labels):
        lse = jax.scipy.special.logsumexp(logits, axis=-1)
        return lse - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    d = nk.from_jax(ce, f32(5, 9), S((5,), jnp.int32), axes=["n v", "n"])
    assert "logsumexp_v" in boxes(d) and "take_v" in boxes(d)
    assert [ob.type.dtype for ob in d.dom.inside] == ["f32", "int32"]
    L = rng.normal(size=(6, 11))
    labels = rng.integers(-11, 11, size=6).astype(np.int32)  # negative ones wrap, as in jnp
    same(d, ce, L, labels)


def test_log_softmax_and_one_hot_cross_entropy(rng):
    def ce(logits, labels):
        onehot = jax.nn.one_hot(labels, logits.shape[-1])
        return -jnp.sum(jax.nn.log_softmax(logits) * onehot, axis=-1)
    d = nk.from_jax(ce, f32(5, 9), S((5,), jnp.int32), axes=["n v", "n"])
    assert "logsumexp_v" in boxes(d) and "positions_v" in boxes(d)
    same(d, ce, rng.normal(size=(4, 7)), rng.integers(0, 7, size=4).astype(np.int32))


def test_softmax_written_by_hand_is_the_primitive(rng):
    def f(s):
        e = jnp.exp(s - jnp.max(s, axis=0, keepdims=True))
        naive = jnp.exp(s) / jnp.exp(s).sum(-1, keepdims=True)  # no shift: the same over ℝ
        return e / e.sum(axis=0, keepdims=True), naive
    d = nk.from_jax(f, f32(3, 4), axes=["a b"])
    assert sorted(boxes(d)) == ["softmax_a", "softmax_b"]
    same(d, f, *normal(rng, (5, 6)))


def test_imported_cross_entropy_streams_the_vocabulary_and_its_kernel_matches(rng):
    def ce(logits, labels):
        lse = jax.scipy.special.logsumexp(logits, axis=-1)
        return lse - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    d = nk.from_jax(ce, f32(4096, 32768), S((4096,), jnp.int32), axes=["n v", "n"])
    opt = nk.optimize(d, sizes=d.sizes, dtype="f32")
    assert any(m.rule == "stream_partition" and m.params_dict["axis"] == "v" for m in opt.chain)
    small = opt.fit({"n": 37, "v": 301})
    L = rng.normal(size=(37, 301)).astype(np.float32)
    labels = rng.integers(0, 301, size=37).astype(np.int32)
    np.testing.assert_allclose(np.asarray(small.kernel(interpret=True)(L, labels)),
                               np.asarray(ce(L, labels)), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ masks from iota
def _causal(offset=0, fill=-jnp.inf):
    def attention(q, k, v):
        s = q @ k.T / jnp.sqrt(q.shape[-1])
        keep = jnp.arange(k.shape[0])[None, :] <= jnp.arange(q.shape[0])[:, None] + offset
        return jax.nn.softmax(jnp.where(keep, s, fill), axis=-1) @ v
    return attention


def test_a_causal_mask_via_iota_is_the_causal_mask_and_matches_jax(rng):
    fn = _causal()
    d = nk.from_jax(fn, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    assert "causal" in boxes(d) and "where" not in " ".join(boxes(d))
    same(d, fn, *normal(rng, (7, 4), (9, 4), (9, 4)))
    same(d, fn, *normal(rng, (12, 3), (5, 3), (5, 3)))


def test_the_mask_primitive_equals_the_where_it_replaces_even_on_rows_without_keys(rng):
    """With an offset of −2 the first two rows keep no key: JAX gives NaN there (−∞ fill)
    and napkin's softmax zeros; the recognised mask and the plain positions/compare/where
    (kept when the masked scores are also an output) agree on every row."""
    fn = _causal(offset=-2)
    masked = nk.from_jax(fn, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    assert "causal" in boxes(masked)

    def both(q, k, v):
        s = q @ k.T / jnp.sqrt(q.shape[-1])
        keep = jnp.arange(k.shape[0])[None, :] <= jnp.arange(q.shape[0])[:, None] - 2
        s = jnp.where(keep, s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ v, s
    plain = nk.from_jax(both, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    assert "causal" not in boxes(plain) and "positions_q" in boxes(plain)
    xs = normal(rng, (7, 4), (9, 4), (9, 4))
    with jax.enable_x64(True):
        a = np.asarray(jax.jit(nk.evaluate(masked))(*xs))
        b, scores = (np.asarray(t) for t in jax.jit(nk.evaluate(plain))(*xs))
        ref, ref_scores = (np.asarray(t) for t in both(*xs))
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(a[2:], ref[2:], rtol=1e-10, atol=1e-12)  # rows with a key
    assert np.all(a[:2] == 0) and np.all(np.isnan(ref[:2]))             # napkin: zeros
    np.testing.assert_array_equal(scores, ref_scores)                   # −∞ kept as written


def test_a_sliding_window_via_iota_is_the_window_mask(rng):
    def attention(q, k, v):
        s = q @ k.T * 0.5
        i, j = jnp.arange(q.shape[0])[:, None], jnp.arange(k.shape[0])[None, :]
        return jax.nn.softmax(jnp.where((j <= i) & (i - j < 3), s, -1e30), axis=-1) @ v
    d = nk.from_jax(attention, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    assert "window(3)" in boxes(d)
    same(d, attention, *normal(rng, (7, 4), (9, 4), (9, 4)))


def test_a_mask_with_a_small_fill_stays_a_where(rng):
    fn = _causal(fill=0.0)
    d = nk.from_jax(fn, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    assert "causal" not in boxes(d) and "where(·, ·, 0)" in boxes(d)
    same(d, fn, *normal(rng, (7, 4), (9, 4), (9, 4)))


def test_masks_made_numbers_and_back_are_read_too(rng):
    """jnp.tril of ones, and jax.nn.dot_product_attention(is_causal=True), build the mask as
    where(c, 1, 0) read back as bool: still the causal mask."""
    def tril(s):
        return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf), -1)
    d = nk.from_jax(tril, f32(5, 7), axes=["q x"])
    assert boxes(d) == ["causal", "softmax_x"]
    same(d, tril, *normal(rng, (6, 9)))

    def sdpa(q, k, v):
        return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    d = nk.from_jax(sdpa, f32(5, 2, 4), f32(7, 2, 4), f32(7, 2, 4),
                    axes=["q h d", "x h d", "x h d"])
    assert "causal" in boxes(d) and "softmax_x" in boxes(d)
    same(d, sdpa, *normal(rng, (6, 3, 4), (8, 3, 4), (8, 3, 4)), rtol=1e-5, atol=1e-6)


def test_alibi_positions_and_heads(rng):
    def alibi(q, k, v, slopes):
        s = jnp.einsum("hqd,hxd->hqx", q, k) / jnp.sqrt(q.shape[-1])
        rel = jnp.arange(q.shape[1])[:, None] - jnp.arange(k.shape[1])[None, :]
        s = s - slopes[:, None, None] * rel
        return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, axis=-1), v)
    d = nk.from_jax(alibi, f32(2, 7, 4), f32(2, 9, 4), f32(2, 9, 4), f32(2),
                    axes=["h q d", "h x d", "h x d", "h"])
    assert {"positions_q", "positions_x", "softmax_x"} <= set(boxes(d))
    same(d, alibi, *normal(rng, (3, 5, 4), (3, 8, 4), (3, 8, 4), (3,)))


# ------------------------------------------------------------------ axes and sizes
def test_axes_as_a_list_a_dict_and_axis_objects_name_the_same_diagram():
    q, x, dd = nk.axes("q x d")
    fn = _causal()
    shapes = (f32(7, 4), f32(9, 4), f32(9, 4))
    a = nk.from_jax(fn, *shapes, axes=["q d", "x d", "x d"])
    b = nk.from_jax(fn, *shapes, axes={"q": (q, dd), "k": ["x", "d"], "v": "x d"})
    assert a == b and a.sizes == b.sizes == {"q": 7, "d": 4, "x": 9}


def test_a_size_the_function_reads_as_a_number_is_read_back_as_a_symbol(rng):
    """math.sqrt needs a Python number: fn is traced at fixed sizes, then at others, and the
    constant that changed is read back as 1/sqrt(d): the diagram still serves every size."""
    def attention(q, k, v):
        s = q @ k.T / math.sqrt(q.shape[-1]) + k.shape[0] ** -1.0
        return jax.nn.softmax(s, axis=-1) @ v
    d = nk.from_jax(attention, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    assert "scale(1/sqrt(d))" in boxes(d) and "add_const(1/x)" in boxes(d)
    same(d, attention, *normal(rng, (5, 6), (11, 6), (11, 6)))


def test_unit_dimensions_are_broadcast_and_outputs_keep_their_axis_order(rng):
    def f(a, b, c):
        return (a + b).T, jnp.broadcast_to(c.sum(0)[None, :], a.shape), a.min(0)
    d = nk.from_jax(f, f32(3, 4), f32(1, 4), f32(3, 4), axes=["a b", "1 b", "a b"])
    assert [ob.type.names for ob in d.dom.inside] == [("a", "b"), ("b",), ("a", "b")]
    assert [ob.type.names for ob in d.cod.inside] == [("b", "a"), ("a", "b"), ("b",)]
    a, b, c = normal(rng, (5, 2), (2,), (5, 2))
    with jax.enable_x64(True):
        got = nk.evaluate(d)(a, b, c)
        want = f(a, b[None], c)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12)


# ------------------------------------------------------------------ the clear errors
def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith("from_jax: ")
    return msg


def _attn(q, k, v):
    return jax.nn.softmax(q @ k.T, axis=-1) @ v


def test_two_axes_of_one_size_without_axes_ask_for_axes():
    with pytest.raises(nk.NapkinError, match="both have size 8 but fn uses them as different "
                                             "axes; name the axes with axes=") as e:
        nk.from_jax(_attn, f32(8, 4), f32(8, 4), f32(8, 4))
    assert "q's dimension 0 and k's dimension 0" in _one_line(e)


@pytest.mark.parametrize("axes,match", [
    (["q d", "x d e", "x d"], r"axes for k: 3 name\(s\) \(x d e\) for 2 dimension\(s\)"),
    (["q d", "x d"], "axes has 2 entries for 3 arguments"),
    ({"q": "q d", "k": "x d"}, "axes names no axes for argument v"),
    ({"q": "q d", "k": "x d", "v": "x d", "w": "y"}, "axes names argument 'w', which fn "),
    (["q q", "x d", "x d"], "axis q names two dimensions"),
    (["q d", "x e", "x d"], "fn uses axes d and e as one axis"),
    (["q d", "x d", "y d"], "fn uses axes x and y as one axis"),
    (["1 d", "x d", "x d"], "dimension 0 is marked '1' .* but has size 8"),
])
def test_bad_axes_are_one_line_naming_what(axes, match):
    with pytest.raises(nk.NapkinError, match=match) as e:
        nk.from_jax(_attn, f32(8, 4), f32(8, 4), f32(8, 4), axes=axes)
    _one_line(e)


@pytest.mark.parametrize("fn,prim", [
    (lambda x: jnp.cumsum(x, axis=0), "cumsum"),
    (lambda x: jnp.sort(x, axis=0), "sort"),
    (lambda x: jnp.argmax(x, axis=0), "argmax"),
])
def test_an_unsupported_primitive_is_named_with_the_users_line(fn, prim):
    with pytest.raises(nk.NapkinError, match=f"primitive {prim} \\(at .*test_from_jax.py:\\d+"
                                             ) as e:
        nk.from_jax(fn, f32(8, 4), axes=["a b"])
    assert "has no napkin primitive; supported:" in _one_line(e)


def test_an_index_with_a_slice_is_refused_in_one_line():
    with pytest.raises(nk.NapkinError, match="primitive concatenate .* has no napkin "
                                             "primitive; supported") as e:  # x[i, :2]
        nk.from_jax(lambda x, i: x[i, :2], f32(8, 4), S((5,), jnp.int32), axes=["v d", "n"])
    _one_line(e)


def test_an_embedding_lookup_is_a_take_with_the_index_axis(rng):
    d = nk.from_jax(lambda emb, ids: emb[ids], f32(8, 4), S((5,), jnp.int32),
                    axes=["v d", "n"])
    emb, ids = rng.standard_normal((8, 4)), np.array([3, 0, 7, 3, 1], np.int32)
    with jax.enable_x64(True):
        got = np.asarray(nk.evaluate(d)(emb, ids))
    assert d.cod.inside[0].type.names == ("n", "d")
    np.testing.assert_array_equal(got, emb[ids])


@pytest.mark.parametrize("fn,axes,match", [
    (lambda x: x * jnp.array([1.0, 2.0, 3.0, 4.0]), ["q d"], "closes over an array constant"),
    (lambda x: jax.scipy.special.erf(x), ["q d"], "primitive erf .* only inside gelu"),
    (lambda x: jnp.zeros(3), ["q d"], "size 3 made by broadcast_in_dim .* none of the "
                                      "arguments' axes"),
])
def test_other_refusals_are_one_line(fn, axes, match):
    with pytest.raises(nk.NapkinError, match=match) as e:
        nk.from_jax(fn, f32(8, 4), axes=axes)
    _one_line(e)


def test_an_unexplained_size_constant_is_refused():
    def f(q):
        return q * math.log(q.shape[0])  # log(q): no c·qᵖ
    with pytest.raises(nk.NapkinError, match="changes with the sizes .* write sizes through "
                                             "jnp") as e:
        nk.from_jax(f, f32(8, 4), axes=["q d"])
    _one_line(e)


# ------------------------------------------------------------------ the package
def test_from_jax_is_the_package_entry_point():
    from napkin.frontend.jaxpr import from_jax
    assert nk.from_jax is from_jax and "from_jax" in nk.__all__


# ------------------------------------------------------------------ what is read back is exact
def _plain(diagram):
    """The diagram kept the mask as positions / compare / where."""
    names = boxes(diagram)
    assert "causal" not in names and not any(n.startswith("window") for n in names)
    assert any(n.startswith("positions") for n in names)


def _scores(q, k):
    return q @ k.T / jnp.sqrt(q.shape[-1])


def _keep(q, k, offset=0):
    return jnp.arange(k.shape[0])[None, :] <= jnp.arange(q.shape[0])[:, None] + offset


def _also_summed(q, k, v):                         # the masked scores feed a sum too
    s = jnp.where(_keep(q, k), _scores(q, k), -1e30)
    return jax.nn.softmax(s, axis=-1) @ v, jnp.sum(s, axis=-1)


def _small_fill(q, k, v):                          # −1.0 is no mask's fill
    return jax.nn.softmax(jnp.where(_keep(q, k), _scores(q, k), -1.0), axis=-1) @ v


def _nan_fill(q, k, v):
    return jax.nn.softmax(jnp.where(_keep(q, k), _scores(q, k), jnp.nan), axis=-1) @ v


def _over_queries(q, k, v):                        # the softmax runs over the query axis
    s = jnp.where(_keep(q, k, 8), _scores(q, k), -jnp.inf)  # (every key keeps a query)
    return jax.nn.softmax(s, axis=0).T @ q


def _size_offset(q, k, v):                         # bottom-right aligned: offset x − q
    keep = _keep(q, k, k.shape[0] - q.shape[0])
    return jax.nn.softmax(jnp.where(keep, _scores(q, k), -jnp.inf), axis=-1) @ v


def _float_positions(q, k, v):                     # float32 positions round above 2²⁴
    i = jnp.arange(q.shape[0], dtype=jnp.float32)[:, None]
    j = jnp.arange(k.shape[0], dtype=jnp.float32)[None, :]
    return jax.nn.softmax(jnp.where(j <= i, _scores(q, k), -jnp.inf), axis=-1) @ v


@pytest.mark.parametrize("fn", [_also_summed, _small_fill, _nan_fill, _over_queries,
                                _size_offset, _float_positions])
def test_a_mask_outside_the_exact_conditions_stays_positions_compare_where(fn, rng):
    d = nk.from_jax(fn, f32(7, 4), f32(9, 4), f32(9, 4), axes=["q d", "x d", "x d"])
    _plain(d)
    same(d, fn, *normal(rng, (7, 4), (9, 4), (9, 4)))
    same(d, fn, *normal(rng, (5, 3), (11, 3), (11, 3)))


def test_a_mask_on_two_axes_other_than_the_softmax_axis_stays_a_where(rng):
    def fn(q, k, v):                               # h against q; the softmax runs over x
        s = jnp.einsum("hqd,hxd->hqx", q, k)
        keep = jnp.arange(q.shape[0])[:, None, None] <= jnp.arange(q.shape[1])[None, :, None]
        return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(jnp.where(keep, s, -1e30), -1), v)
    d = nk.from_jax(fn, f32(2, 7, 4), f32(2, 9, 4), f32(2, 9, 4),
                    axes=["h q d", "h x d", "h x d"])
    _plain(d)
    xs = normal(rng, (3, 5, 4), (3, 8, 4), (3, 8, 4))
    with jax.enable_x64(True):
        got, want = np.asarray(nk.evaluate(d)(*xs)), np.asarray(fn(*xs))
    kept = np.arange(3)[:, None] <= np.arange(5)[None, :]       # rows (h, q) keeping keys
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-10)
    assert np.all(got[~kept] == 0)       # a row that keeps no key: napkin's softmax zeros


def test_a_mask_in_float16_stays_a_where():
    """float16 clips napkin's fill to −32752, above MASKED: no longer a mask's fill."""
    def fn(q, k, v):
        return jax.nn.softmax(jnp.where(_keep(q, k), _scores(q, k), -jnp.inf), axis=-1) @ v
    h = jnp.float16
    d = nk.from_jax(fn, S((7, 4), h), S((9, 4), h), S((9, 4), h), axes=["q d", "x d", "x d"])
    _plain(d)
    assert "causal" in boxes(nk.from_jax(fn, S((7, 4), jnp.bfloat16), S((9, 4), jnp.bfloat16),
                                         S((9, 4), jnp.bfloat16), axes=["q d", "x d", "x d"]))


def test_a_sum_cast_to_integers_is_no_softmax_denominator(rng):
    def fn(x):
        e = jnp.exp(x)
        return e / jnp.sum(e.astype(jnp.int32), axis=-1, keepdims=True).astype(F32)
    d = nk.from_jax(fn, f32(3, 5), axes=["a b"])
    assert "softmax_b" not in boxes(d) and "cast(int32)" in boxes(d)
    same(d, fn, 2 * rng.normal(size=(4, 6)))


def test_softcap_needs_c_times_one_over_c_exactly(rng):
    def exact_cap(x):
        return 30.0 * jnp.tanh(x / 30.0)

    def rounded_cap(x):                            # x·fl(1/30): not x/30 over the reals
        return 30.0 * jnp.tanh(x * (1 / 30.0))
    assert boxes(nk.from_jax(exact_cap, f32(3, 4), axes=["a b"])) == ["softcap(30)"]
    d = nk.from_jax(rounded_cap, f32(3, 4), axes=["a b"])
    assert boxes(d) == ["scale(0.0333333)", "tanh", "scale(30)"]
    same(d, rounded_cap, *normal(rng, (5, 2)), rtol=1e-6)  # traced with fl32(1/30)


@pytest.mark.parametrize("fn,read", [
    (lambda x: (1 + jnp.tanh(x / 2)) / 2, "sigmoid"),                   # proved: sigmoid
    (lambda x: x * jnp.exp(x) / (1 + jnp.exp(x)), "silu"),              # proved: silu
    (lambda x: 0.5 * x * (1 + jnp.tanh(0.7978846 * (x + 0.0447 * x ** 3))), None),  # 0.0447
    (lambda x: x * x / x * jax.nn.sigmoid(x), None),                    # 0/0 at 0: no silu
    (lambda x: jnp.sqrt(x) ** 2 * jax.nn.sigmoid(x), None),             # NaN below 0
])
def test_gelu_silu_sigmoid_are_read_only_where_sympy_proves_them(fn, read, rng):
    d = nk.from_jax(fn, f32(3, 4), axes=["a b"])
    if read:
        assert boxes(d) == [read]
    else:
        assert not {"gelu", "gelu_tanh", "silu"} & set(boxes(d)) and len(boxes(d)) > 2
    same(d, fn, np.abs(rng.normal(size=(5, 2))) + 0.1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_jax_gelu_in_low_precision_keeps_its_rounded_constants_as_the_primitive(dtype):
    for approximate, name in ((True, "gelu_tanh"), (False, "gelu")):
        d = nk.from_jax(lambda x: jax.nn.gelu(x, approximate=approximate), S((3, 4), dtype),
                        axes=["a b"])
        assert boxes(d) == [name]


def test_take_along_axis_with_mode_clip_is_refused():
    def fn(x, i):
        return jnp.take_along_axis(x, i[:, None], axis=-1, mode="clip")[:, 0]
    with pytest.raises(nk.NapkinError, match="take_along_axis with mode='clip' .* has no "
                                             "napkin primitive") as e:
        nk.from_jax(fn, f32(5, 9), S((5,), jnp.int32), axes=["n v", "n"])
    _one_line(e)


def test_a_pick_from_a_unit_dimension_keeps_jax_fill_for_an_index_out_of_range(rng):
    def fn(x, i):
        return jnp.take(x, i, axis=1)               # x[n, 1]: x[:, 0] at i = 0, else NaN
    d = nk.from_jax(fn, f32(5, 1), S((), jnp.int32), axes=["n 1", ""])
    x = rng.normal(size=(6,))
    for i in (0, -1, 3):
        with jax.enable_x64(True):
            got = np.asarray(nk.evaluate(d)(x, np.int32(i)))
            want = np.asarray(fn(x[:, None], np.int32(i)))
        np.testing.assert_array_equal(got, want)


def test_a_power_of_a_negative_constant_base_is_refused(rng):
    d = nk.from_jax(lambda x: 2.0 ** x, f32(3, 4), axes=["a b"])
    same(d, lambda x: 2.0 ** x, *normal(rng, (4, 5)))
    with pytest.raises(nk.NapkinError, match="pow with the constant base -2.0 .* for c > 0"):
        nk.from_jax(lambda x: (-2.0) ** x, f32(3, 4), axes=["a b"])


def test_an_array_whose_size_only_equals_an_axis_is_not_that_axis():
    """Traced at fixed sizes (math.sqrt needs a number), jnp.arange(9) has q's size 9; at
    other sizes it keeps 9 where q changes: it is no axis q, and the diagram would claim
    Σ positions(q) = q(q − 1)/2 at every size."""
    def f(q):
        return q / math.sqrt(q.shape[1]) + jnp.arange(9.0).sum()
    with pytest.raises(nk.NapkinError, match="has size 9 at the given sizes but 9 at other "
                                             "sizes .* it is not axis q") as e:
        nk.from_jax(f, f32(9, 4), axes=["q d"])
    _one_line(e)


# ------------------------------------------------------------------ a generic guard
_AXES = "abc"
_ARGS = (("a", "b", "c"), ("a", "b"), ("b", "c"), ("c",))      # each argument's axes
_UNARY_OPS = {
    "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid, "neg": jnp.negative, "abs": jnp.abs,
    "square": jnp.square, "cube": lambda x: x ** 3, "relu": jax.nn.relu,
    "gelu": jax.nn.gelu, "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu, "exp_tanh": lambda x: jnp.exp(jnp.tanh(x)),
    "exp2_tanh": lambda x: jnp.exp2(jnp.tanh(x)), "log": lambda x: jnp.log(1 + x * x),
    "sqrt": lambda x: jnp.sqrt(1 + x * x), "rsqrt": lambda x: jax.lax.rsqrt(1 + x * x),
    "pow": lambda x: (1 + x * x) ** 0.75, "recip": lambda x: 2.0 / (1 + x * x),
    "clip": lambda x: jnp.clip(x, -0.5, 0.5), "affine": lambda x: 1.5 - x * 0.25,
    "div_const": lambda x: x / 3.0, "max_const": lambda x: jnp.maximum(x, 0.3),
    "softcap": lambda x: 5.0 * jnp.tanh(x / 5.0),
}
_BINARY_OPS = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum,
    "min": jnp.minimum, "div": lambda x, y: x / (1 + y * y),
    "where": lambda x, y: jnp.where(x > y, x, 0.5 * y),
}
_REDUCE_OPS = {
    "sum": lambda x, i: jnp.sum(x, i, keepdims=True),
    "max": lambda x, i: jnp.max(x, i, keepdims=True),
    "min": lambda x, i: jnp.min(x, i, keepdims=True),
    "mean": lambda x, i: jnp.mean(x, i, keepdims=True),
    "logsumexp": lambda x, i: jax.scipy.special.logsumexp(x, i, keepdims=True),
    "softmax": lambda x, i: jax.nn.softmax(x, i), "log_softmax": jax.nn.log_softmax,
}


def _contract(u, pu, v, pv, k):
    """Σ_k u·v as an einsum over the axes u and v have (a dot_general), back in the
    canonical layout: dims a, b, c, size 1 where the value lacks the axis."""
    def squeezed(x, present):
        return jnp.squeeze(x, tuple(i for i, a in enumerate(_AXES) if a not in present))
    out = "".join(a for a in _AXES if (a in pu or a in pv) and a != k)
    r = jnp.einsum(f"{''.join(pu)},{''.join(pv)}->{out}", squeezed(u, pu), squeezed(v, pv))
    return jnp.expand_dims(r, tuple(i for i, a in enumerate(_AXES) if a not in out)), out


def _program(steps):
    """fn(*args) running ``steps`` on a pool of values (the arguments first); every value
    kept in the canonical layout, so broadcasting is by position."""
    def fn(*args):
        pool = [(jnp.expand_dims(x, tuple(i for i, a in enumerate(_AXES) if a not in axes)),
                 "".join(axes)) for x, axes in zip(args, _ARGS)]
        for kind, name, i, j, axis in steps:
            (u, pu), (v, pv) = pool[i % len(pool)], pool[j % len(pool)]
            if kind == "unary":
                pool.append((_UNARY_OPS[name](u), pu))
            elif kind == "binary":
                pool.append((_BINARY_OPS[name](u, v), "".join(sorted(set(pu) | set(pv)))))
            elif kind == "reduce":
                keeps = name in ("softmax", "log_softmax") or axis not in pu
                pool.append((_REDUCE_OPS[name](u, _AXES.index(axis)),
                             pu if keeps else pu.replace(axis, "")))
            else:
                pool.append(_contract(u, pu, v, pv, axis))
        # every value computed is an output: each step is checked
        return tuple(jnp.squeeze(x, tuple(i for i, a in enumerate(_AXES) if a not in present))
                     for x, present in pool[len(_ARGS):])
    return fn


_KINDS = ([("unary", n) for n in sorted(_UNARY_OPS)] + [("binary", n) for n in sorted(_BINARY_OPS)]
          + [("reduce", n) for n in sorted(_REDUCE_OPS)] + [("contract", "")] * 3)
_STEP = st.sampled_from(_KINDS).flatmap(lambda kn: st.tuples(
    st.just(kn[0]), st.just(kn[1]), st.integers(0, 99), st.integers(0, 99),
    st.sampled_from(_AXES)))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(steps=st.lists(_STEP, min_size=2, max_size=8),
       sizes=st.tuples(*[st.integers(2, 4)] * 3), other=st.tuples(*[st.integers(2, 5)] * 3),
       seed=st.integers(0, 2 ** 31))
def test_random_programs_mean_what_jax_computes(steps, sizes, other, seed):
    """Random compositions of the elementwise ops, reductions (softmax and logsumexp among
    them) and einsums napkin reads: the diagram equals the function in float64, at the
    traced sizes and at others (the sizes are symbols)."""
    fn = _program(steps)
    n = dict(zip(_AXES, sizes))
    d = nk.from_jax(fn, *[f32(*[n[a] for a in axes]) for axes in _ARGS],
                    axes=[" ".join(axes) for axes in _ARGS])
    r = np.random.default_rng(seed)
    for at in (n, dict(zip(_AXES, other))):
        xs = [r.normal(size=[at[a] for a in axes]) for axes in _ARGS]
        with jax.enable_x64(True):
            got, want = nk.evaluate(d)(*xs), fn(*xs)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want, strict=True):
            g, w = np.asarray(g), np.asarray(w)
            scale = max(1.0, float(np.nanmax(np.abs(w), initial=0.0)))
            np.testing.assert_allclose(g, w, rtol=1e-7, atol=1e-7 * scale)


def test_an_int64_index_that_int32_cannot_hold_is_refused_not_wrapped():
    """napkin reads int64 as int32, as its docs say: a value within int32 is read as it
    is; one beyond it is refused by name (JAX without x64 wraps 2**32 + 1 to 1; napkin's
    take_along_axis would give 0: neither is what was asked)."""
    def f(x, i):
        return jnp.take_along_axis(x, i[:, None], axis=1)[:, 0]
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    d = nk.from_jax(f, x, np.array([1, 2, 3], np.int32))
    assert np.allclose(nk.evaluate(d)(x, np.array([1, 0, 3], np.int64)), [1, 4, 11])
    with pytest.raises(nk.NapkinError, match="int64 value 4294967297 does not fit int32"):
        nk.evaluate(d)(x, np.array([2**32 + 1, 0, 0], np.int64))


def test_a_named_axis_of_size_one_is_carried():
    """jax.nn.dot_product_attention (BTNH) reads a size as a number, so it is traced at fixed
    sizes, where a dimension of 1 cannot be told from a broadcast: an axis the caller names
    is read at another size and kept at 1 — then checked against the function at size 1."""
    import jax
    S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    D = nk.from_jax(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), S(1, 24, 2, 16),
                    S(1, 40, 2, 16), S(1, 40, 2, 16), axes=["b q h d", "b x h d", "b x h d"])
    assert D.sizes == {"b": 1, "q": 24, "h": 2, "d": 16, "x": 40}
    rng = np.random.default_rng(2)
    xs = [jnp.asarray(rng.standard_normal(s), jnp.float32)
          for s in ((1, 24, 2, 16), (1, 40, 2, 16), (1, 40, 2, 16))]
    np.testing.assert_allclose(nk.evaluate(D)(*xs), jax.nn.dot_product_attention(*xs),
                               rtol=1e-5, atol=1e-6)

    def apart(q):  # reads its size as a number, and doubles at b = 1
        return (q / np.sqrt(q.shape[-1])).sum(0) * (2.0 if q.shape[0] == 1 else 1.0)
    with pytest.raises(nk.NapkinError, match="axis b has size 1 and fn treats it apart"):
        nk.from_jax(apart, S(1, 8), axes=["b d"])
    assert nk.from_jax(apart, S(3, 8), axes=["b d"]).sizes == {"b": 3, "d": 8}


def test_an_imported_functions_own_sizes_are_its_defaults():
    # optimize without the table axis: it keeps the 32 buckets the function was given (a
    # library default of 4096 in its place once sized the table 128× too big, silently)
    import outside_algorithms as oa
    fn, structs, axes = oa.FORMS["t5_relative_bias"]
    alg = nk.from_jax(fn, *structs, axes=axes)
    assert alg.sizes["b"] == 32
    opt = nk.optimize(alg, sizes={"q": 128, "x": 256, "d": 64, "h": 2}, dtype="f32")
    assert opt.sizes == {"q": 128, "x": 256, "d": 64, "h": 2, "b": 32}
    with pytest.raises(nk.NapkinError, match="names zz, which the algorithm does not have"):
        nk.optimize(alg, sizes={"zz": 4})


# ------------------------------------------------------------ an argument read twice
def _self_attention(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv
    return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=-1) @ v


def _causal_self_attention(x, g, wq, wk, wv):  # pre-norm, causal, the scale as a number
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g
    q, k, v = h @ wq, h @ wk, h @ wv
    s = q @ k.T * q.shape[-1] ** -0.5
    i, j = jnp.arange(x.shape[0])[:, None], jnp.arange(x.shape[0])[None, :]
    return jax.nn.softmax(jnp.where(i >= j, s, -jnp.inf), axis=-1) @ v


def test_self_attention_from_one_input_reads_the_keys_as_a_second_axis(rng):
    F = lambda *s: S(s, jnp.float32)  # noqa: E731
    d = nk.from_jax(_self_attention, F(512, 64), *[F(64, 32)] * 3, axes=["t e"] + ["e d"] * 3)
    assert d.arguments == (["x", "wq", "wk", "wv"], [0, 1, 2, 3, 0])
    assert [ob.name for ob in d.dom.inside] == ["x", "wq", "wk", "wv", "x_2"]
    assert d.sizes["t_2"] == 512 and d.aliases == {"t_2": "t"}
    assert "softmax_t_2" in str(d)
    opt = nk.optimize(d, sizes={"t": 1024, "e": 64, "d": 32}, dtype="f32", max_seconds=6)
    assert opt.sizes["t_2"] == 1024  # a size for t sizes its second reading
    moves = [m for m in opt.chain if m.rule != "untie_tiles"]  # (each kernel's tiles named)
    assert moves[-1].params_dict.get("axis") == "t_2"  # the keys streamed
    with pytest.raises(nk.NapkinError, match="t_2 is a second reading of axis t"):
        nk.optimize(d, sizes={"t": 1024, "t_2": 512})
    k = opt.fit({"t": 37, "e": 16, "d": 8}).kernel("triton", interpret=True)
    x = rng.standard_normal((37, 16)).astype(np.float32)
    ws = [0.3 * rng.standard_normal((16, 8)).astype(np.float32) for _ in range(3)]

    def loss(f, *a):
        return jnp.sum(jnp.tanh(f(*a)))
    with jax.enable_x64(True):
        x64 = [np.float64(a) for a in (x, *ws)]
        want, dwant = _self_attention(*x64), jax.grad(
            lambda *a: loss(_self_attention, *a), argnums=(0, 1, 2, 3))(*x64)
    np.testing.assert_allclose(np.asarray(k(x, *ws)), want, rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda *a: loss(k, *a), argnums=(0, 1, 2, 3))(x, *ws)
    for g, w in zip(got, dwant):  # x's cotangent sums its two readings'
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_a_causal_pre_norm_self_attention_reads_the_mask_over_both_readings(rng):
    F = lambda *s: S(s, jnp.float32)  # noqa: E731
    d = nk.from_jax(_causal_self_attention, F(256, 64), F(64), *[F(64, 32)] * 3,
                    axes=["t e", "e", "e d", "e d", "e d"])
    assert "causal" in str(d) and d.arguments[1] == [0, 1, 2, 3, 4, 0]
    x, g = rng.standard_normal((45, 16)), rng.standard_normal(16)
    ws = [0.3 * rng.standard_normal((16, 8)) for _ in range(3)]
    with jax.enable_x64(True):
        want = np.asarray(_causal_self_attention(x, g, *ws))
        got = np.asarray(nk.evaluate(d)(*nk.frontend.jaxpr.inputs_of(d, [x, g, *ws])))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_a_gram_matrix_has_two_axes_and_sizes_mode_asks_for_names(rng):
    d = nk.from_jax(lambda x: x @ x.T, S((5, 3), jnp.float32), axes=["n d"])
    assert [a.name for a in d.cod.inside[0].type.axes] == ["n", "n_2"]
    x = rng.standard_normal((5, 3))
    with jax.enable_x64(True):
        np.testing.assert_allclose(np.asarray(nk.evaluate(d)(x, x)), x @ x.T, rtol=1e-12)
    with pytest.raises(nk.NapkinError, match="name the arguments' axes with axes="):
        nk.from_jax(lambda x: x @ x.T, S((5, 3), jnp.float32))


# ------------------------------------------------------------ a table read at an index
def _t5_indexed(q, k, v, table):  # table[h, b]: a bias per head and bucket of j − i
    s = jnp.einsum("hqd,hxd->hqx", q, k)
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s + table[:, jnp.clip(j - i + 16, 0, 31)],
                                                     axis=-1), v)


def test_a_table_indexed_by_a_computed_bucket_is_a_take_with_new_axes(rng):
    F = lambda *s: S(s, jnp.float32)  # noqa: E731
    d = nk.from_jax(_t5_indexed, F(2, 256, 32), F(2, 512, 32), F(2, 512, 32), F(2, 32),
                    axes=["h q d", "h x d", "h x d", "h b"])
    (take,) = [b for b in d.boxes if b.name == "take_b"]
    assert set(take.cod.inside[0].type.names) == {"h", "q", "x"}  # q, x: the index's axes
    # (a search of 4 s, the backward's too: whatever it hands back is checked below —
    # a short search returned a kernel of no inputs and a mask through HBM, both now written)
    opt = nk.optimize(d, dtype="f32", max_seconds=4)
    assert "stream_partition" in [m.rule for m in opt.chain]
    k = opt.fit({"h": 2, "q": 37, "x": 53, "d": 16, "b": 32}).kernel("triton", interpret=True)
    xs = [rng.standard_normal(s).astype(np.float32)
          for s in ((2, 37, 16), (2, 53, 16), (2, 53, 16), (2, 32))]
    with jax.enable_x64(True):
        x64 = [np.float64(x) for x in xs]
        want = _t5_indexed(*x64)
        dwant = jax.grad(lambda *a: jnp.sum(jnp.tanh(_t5_indexed(*a))), argnums=(0, 1, 2, 3))(*x64)
    np.testing.assert_allclose(np.asarray(k(*xs)), want, rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda *a: jnp.sum(jnp.tanh(k(*a))), argnums=(0, 1, 2, 3))(*xs)
    for g, w in zip(got, dwant):  # the table's cotangent: a scatter, summed over q and x
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_a_slice_of_a_named_axis_says_what_to_write():
    def rotate_half(x):
        return jnp.concatenate([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], -1)
    with pytest.raises(nk.NapkinError) as e:
        nk.from_jax(lambda x, c, s: x * c + rotate_half(x) * s, *[S((8, 16), jnp.float32)] * 3,
                    axes=["q d"] * 3)
    msg = str(e.value)
    assert "\n" not in msg and "test_from_jax.py:" in msg
    assert "a slice x[..., :n] of a named axis" in msg and "x @ R" in msg
    with pytest.raises(nk.NapkinError, match=r"primitive slice .* x @ R"):  # at fixed sizes
        nk.from_jax(lambda x: x[:, :8] * x.shape[1] ** -0.5, S((8, 16), jnp.float32),
                    axes=["q d"])



# ------------------------------------------------------------ merged and split axes
def _gqa_repeat(q, k, v):  # q[h, q, d], k and v [g, x, d]: each KV head read by h/g heads
    r = q.shape[0] // k.shape[0]
    k, v = jnp.repeat(k, r, axis=0), jnp.repeat(v, r, axis=0)
    s = jnp.einsum("hqd,hxd->hqx", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, axis=-1), v)


def _heads(x, wq, wk, wv, wo):  # x[t, e], w[e, f] with f = 4 heads · d, o @ wo[f, e]
    t = x.shape[0]
    q, k, v = ((x @ w).reshape(t, 4, -1) for w in (wq, wk, wv))
    s = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -1e30)
    return x + jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v).reshape(t, -1) @ wo


def _f64(diagram, fn, *arrays, rtol=1e-10, atol=1e-12):
    """The diagram, fed fn's arguments through its boundary, equals fn in float64."""
    from napkin.frontend.jaxpr import inputs_of, outputs_of
    with jax.enable_x64(True):
        got = outputs_of(diagram, jax.jit(nk.evaluate(diagram))(*inputs_of(diagram, arrays)))
        want = fn(*arrays)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


def test_gqa_by_jnp_repeat_reads_the_heads_as_kv_head_times_copy(rng):
    d = nk.from_jax(_gqa_repeat, f32(8, 5, 16), f32(2, 7, 16), f32(2, 7, 16),
                    axes=["h q d", "g x d", "g x d"])
    # h = (g, h_1): query head h reads KV head h // 4, as the library's GQA (r = h_1)
    assert [(ob.name, ob.type.names) for ob in d.dom.inside] == \
        [("q", ("g", "h_1", "q", "d")), ("k", ("g", "x", "d")), ("v", ("g", "x", "d"))]
    assert d.sizes == {"q": 5, "d": 16, "g": 2, "x": 7}  # h_1 = 4 is fn's own: fixed
    for g, q, x in ((3, 9, 4), (1, 1, 3)):  # other sizes than traced, h = 4g
        _f64(d, _gqa_repeat, rng.standard_normal((4 * g, q, 16)),
             *(rng.standard_normal((g, x, 16)) for _ in range(2)))
    with pytest.raises(nk.NapkinError, match=r"names h, which the function merges from axes "
                                             r"g × h_1 .* size g instead"):
        nk.optimize(d, sizes={"h": 32})
    opt = nk.optimize(d, sizes={"g": 2, "q": 128, "x": 256, "d": 16}, dtype="f32")
    assert ("stream_partition", "x") in [(m.rule, m.params_dict.get("axis")) for m in opt.chain]
    k = opt.fit({"g": 3, "q": 13, "x": 21, "d": 16}).kernel("triton", interpret=True)
    q, kv = rng.standard_normal((12, 13, 16)), rng.standard_normal((2, 3, 21, 16))
    args32 = [np.float32(a) for a in (q, *kv)]
    with jax.enable_x64(True):
        want = _gqa_repeat(q, *kv)
    got = k(*args32)  # the caller's Q[h, q, d]: split at the boundary, merged back
    assert got.shape == (12, 13, 16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # (jax.grad goes through the boundary's reshapes as through any: the GQA backward
    # kernels themselves are tests/test_kernel_grad.py's)
    with pytest.raises(nk.ShapeError, match=r"argument q: a dimension of size 10 .* must be "
                                            r"a multiple of 4"):
        k(np.zeros((10, 13, 16), np.float32), *args32[1:])


def test_jnp_tile_and_a_merge_into_an_output_are_products_of_axes(rng):
    tiled = lambda q, k: jnp.einsum("hqd,hxd->hqx", q, jnp.tile(k, (3, 1, 1)))  # noqa: E731
    d = nk.from_jax(tiled, f32(6, 5, 4), f32(2, 7, 4), axes=["h q d", "g x d"])
    assert d.dom.inside[0].type.names == ("h_0", "g", "q", "d")  # h = (copy, g): h % g
    _f64(d, tiled, rng.standard_normal((6, 5, 4)), rng.standard_normal((2, 7, 4)))
    flat = nk.from_jax(lambda x: jnp.exp(x).reshape(-1), f32(8, 4), axes=["q d"])
    assert flat.cod.inside[0].type.names == ("q", "d")
    _f64(flat, lambda x: jnp.exp(x).reshape(-1), rng.standard_normal((3, 5)))


def test_a_head_split_reads_the_projection_as_heads_and_head_dims(rng):
    F = lambda *s: S(s, jnp.float32)  # noqa: E731
    d = nk.from_jax(_heads, F(12, 16), *[F(16, 32)] * 3, F(32, 16),
                    axes=["t e", "e f", "e f", "e f", "f e"])
    # f = (f_0, f_1): 4 heads of 8 (fn's numbers); V's head dimension is an axis of its own
    assert [ob.type.names for ob in d.dom.inside][1:5] == \
        [("e", "f_0", "f_1"), ("e", "f_0", "f_1"), ("e", "f_0", "f_1_2"), ("f_0", "f_1_2", "e")]
    assert "softmax_t_2" in str(d) and "causal" in str(d)
    xs = [rng.standard_normal((9, 16)), *(0.3 * rng.standard_normal((16, 32)) for _ in range(3)),
          0.3 * rng.standard_normal((32, 16))]
    _f64(d, _heads, *xs)


def test_regroupings_that_are_not_products_of_axes_are_one_line():
    with pytest.raises(nk.NapkinError, match=r"reshape from \(a, b\) to \(4, 6\) .* regroups "
                                             r"dimensions napkin cannot read as products") as e:
        nk.from_jax(lambda x: x.reshape(4, 6), f32(6, 4), axes=["a b"])
    _one_line(e)
    with pytest.raises(nk.NapkinError, match=r"turns dimensions \(4, 6\) into \(2, 12\): "
                                             r"neither a merge nor a split") as e:
        nk.from_jax(lambda x: x.reshape(2, -1) * math.sqrt(x.shape[0]), f32(4, 6),
                    axes=["a b"])  # read at fixed sizes
    _one_line(e)
    with pytest.raises(nk.NapkinError,
                       match=r"jnp.arange over a merged axis \(q × d, at .*test_from_jax") as e:
        nk.from_jax(lambda x: x.reshape(-1) * jnp.arange(x.size), f32(8, 4), axes=["q d"])
    _one_line(e)


def test_jax_dot_product_attention_with_grouped_heads_imports(rng):
    # jax.nn.dot_product_attention reshapes q's N heads into (K, N/K) itself: the split of an
    # argument's axis, read as the product it is
    def dpa(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    d = nk.from_jax(dpa, f32(2, 12, 8, 16), f32(2, 20, 2, 16), f32(2, 20, 2, 16),
                    axes=["b t n h", "b s k h", "b s k h"])
    assert d.dom.inside[0].type.names == ("b", "t", "k", "n_1", "h")
    assert [b for b in boxes(d) if b in ("causal", "softmax_s")] == ["causal", "softmax_s"]
    xs = [rng.standard_normal((3, 9, 12, 8)), *rng.standard_normal((2, 3, 14, 3, 8))]
    _f64(d, dpa, *xs, rtol=1e-5, atol=1e-6)  # jax computes it in float32; n = 4k, as traced
