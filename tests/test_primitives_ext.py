"""The primitives of issue 14: gelu (both forms), max/min with a constant, c − x and c / x,
positions (iota), take_along_axis, comparisons and where, softmax with a sink.

For each: the JAX meaning against an independent float64 numpy reference, the sympy
meaning against the JAX one, FLOPs, label and declared facts, the kernel spelling (the
Recorder writes it, the written code runs), and for the index-reading ones the program
grouped and streamed by the rules (ragged tiles).  Negative tests: wrong accumulators
fail their proofs; bad inputs are one NapkinError line naming the array or axis."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy

import napkin as nk
from napkin import ops
from napkin.core.backend import SYMPY
from napkin.core.errors import NapkinError, RuleError
from napkin.core.flops import flops
from napkin.core.ir import ops as op_order, to_graph
from napkin.frontend.library import get
from napkin.core.primitives import EvalContext, Map
from napkin.core.region import Site, body_at
from napkin.frontend.sampling import sample
from napkin.core.semantics import box_function
from rewrites import RULES

q, x, d, n, v, h = nk.axes("q x d n v h")


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def f64(*axes_):
    return nk.Array(*axes_, dtype="f64")


def run(diagram, *xs, sizes=None):
    out = jax.jit(nk.evaluate(diagram, sizes))(*xs)  # one compiled program: fast
    return [np.asarray(o) for o in out] if isinstance(out, tuple) else np.asarray(out)


def only_box(diagram):
    (box,) = [b for b in diagram.boxes if getattr(b, "spec", None) is not None]
    return box


def sympy_meaning(diagram, *xs, sizes=None):
    """The diagram evaluated with the SYMPY backend on exact numbers, as floats."""
    from napkin.core.semantics import run as run_diagram
    env = {sympy.Symbol(k, integer=True, positive=True): val for k, val in (sizes or {}).items()}
    for ob, a in zip(diagram.dom.inside, xs):  # bind symbolic sizes from the shapes
        for ax, s in zip(ob.type.axes, np.shape(a)):
            if isinstance(ax.size, sympy.Symbol):
                env[ax.size] = s
    args = [np.vectorize(lambda e: sympy.Rational(e) if np.isfinite(e) else sympy.sympify(e),
                         otypes=[object])(np.asarray(a, np.float64))
            if np.asarray(a).dtype.kind == "f" else np.asarray(a) for a in xs]
    (out,) = run_diagram(diagram, EvalContext(env, {}, SYMPY), *args)
    return np.vectorize(lambda e: float(sympy.N(e, 30)) if not isinstance(e, (bool, np.bool_))
                        and e not in (sympy.true, sympy.false) else bool(e),
                        otypes=[object])(np.asarray(out, dtype=object)).astype(
        np.float64 if not isinstance(np.asarray(out, dtype=object).flat[0],
                                     (bool, np.bool_, sympy.logic.boolalg.BooleanAtom))
        else bool)


def written(diagram, *xs, offsets=None, sizes=None):
    """The kernel spelling: the Recorder writes the diagram's boxes, the written lines run
    (jax.numpy) on ``xs``; returns the outputs."""
    from napkin.lower.emit import GLOBALS, Recorder, Var, Writer
    from napkin.core.semantics import fold_boxes
    w = Writer()
    rec = Recorder(w)
    ins = []
    for ob, a in zip(diagram.dom.inside, xs):
        name = w.reserve(f"in_{len(ins)}")
        ins.append(Var(w, name, jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype),
                       temp=False))
    env = {sympy.Symbol(k, integer=True, positive=True): val for k, val in (sizes or {}).items()}
    for ob, a in zip(diagram.dom.inside, xs):
        for ax, s in zip(ob.type.axes, np.shape(a)):
            if isinstance(ax.size, sympy.Symbol):
                env[ax.size] = s
    ctx = EvalContext(env, dict(offsets or {}), rec)
    outs = fold_boxes(diagram, ins, lambda box, args: box_function(box, ctx)(*args))
    w.line("return ({},)".format(", ".join(str(o) for o in outs)))  # read: kept live
    src = "def kernel({}):\n".format(", ".join(v.name for v in ins))
    src += "".join(f"    {line}\n" for line in w.text().splitlines())
    ns = dict(GLOBALS)
    exec(src, ns)
    return [np.asarray(o) for o in ns["kernel"](*[jnp.asarray(a) for a in xs])], w.text()


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


def whole(p, path=()):
    return Site(tuple(path), tuple(range(len(op_order(to_graph(body_at(p, path)))))))


# --------------------------------------------------------------------------- gelu
GELU_X = np.concatenate([np.linspace(-12, 12, 241), [-40.0, -30.0, -9.5, 0.0, 1e-8, -1e-8,
                                                       9.5, 30.0, 40.0, 1e4, -1e4]])


def gelu_exact_ref(z):
    # x·(1 + erf(x/√2))/2 = x·erfc(−x/√2)/2, the latter without cancellation far out
    return np.array([t * math.erfc(-t / math.sqrt(2)) / 2 for t in z])


def gelu_tanh_ref(z):
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_meaning_matches_an_independent_reference(approximate):
    D = nk.trace(lambda X: ops.gelu(X, approximate=approximate), {"X": f64(n)})
    got = run(D, GELU_X)
    ref = (gelu_tanh_ref if approximate else gelu_exact_ref)(GELU_X)
    # far in the negative tail both sides are the cancellation of 1 + tanh (or of erf)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14 if approximate else 1e-300)
    box = only_box(D)
    assert box.spec.transcendental and box.spec.elementwise
    assert box.name == ("gelu_tanh" if approximate else "gelu")
    assert flops(D) == n.size
    small = np.array([-3.0, -0.7, 0.0, 0.4, 2.5])
    np.testing.assert_allclose(sympy_meaning(D, small), run(D, small), rtol=1e-13)


def test_erf_spelling_matches_jax_erf_in_float64():
    """The Recorder's erf (Numerical Recipes' erfc: fractional error < 1.2e-7) against
    jax.scipy.special.erf, float64, over a wide range and at large |x|."""
    from jax.scipy.special import erf, erfc
    z = np.concatenate([np.linspace(-8, 8, 4001), [-1e4, -50.0, -27.0, 27.0, 50.0, 1e4, 0.0]])
    from napkin.lower.emit import GLOBALS, Recorder, Var, Writer
    w = Writer()
    rec = Recorder(w)
    var = Var(w, w.reserve("z"), jax.ShapeDtypeStruct(z.shape, jnp.float64), temp=False)
    out = rec.erf(var)
    w.line(f"return {out}")
    ns = dict(GLOBALS)
    exec("def f(z):\n" + "".join(f"    {ln}\n" for ln in w.text().splitlines()), ns)
    got = np.asarray(ns["f"](jnp.asarray(z)))
    want = np.asarray(erf(jnp.asarray(z)))
    bound = 1.2e-7 * np.asarray(erfc(jnp.abs(jnp.asarray(z)))) + 1e-15
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    assert np.all(np.isfinite(got)) and got[-3] == 1.0 and got[-7] == -1.0
    assert "erf" not in w.text()  # no lax.erf: Pallas Triton cannot lower it


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_kernel_spelling(approximate):
    D = nk.trace(lambda X: ops.gelu(X, approximate=approximate), {"X": f64(n)})
    (got,), text = written(D, GELU_X)
    ref = (gelu_tanh_ref if approximate else gelu_exact_ref)(GELU_X)
    if approximate:
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)
    else:  # the erfc fit's fractional error carries over, in the negative tail too
        mask = np.abs(ref) > 1e-300
        assert np.max(np.abs(got - ref)[mask] / np.abs(ref)[mask]) < 1.3e-7
        assert "erf" not in text
    # float32 and bfloat16 kernels: in f32, the result rounded once
    for dt, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)):
        z = np.linspace(-6, 6, 97)
        D32 = nk.trace(lambda X: ops.gelu(X, approximate=approximate),
                       {"X": nk.Array(n, dtype="f32" if dt == jnp.float32 else "bf16")})
        (g,), _ = written(D32, jnp.asarray(z, dt))
        assert g.dtype == dt
        assert rel(g, (gelu_tanh_ref if approximate else gelu_exact_ref)(z)) < tol


# --------------------------------------------------------------------------- max/min with c
def test_max_min_with_a_constant_on_either_side_and_c_minus_x():
    X = np.array([[-1.0, 0.5, 0.5000001, 2.0], [0.5, -7.0, 3.0, 0.49]])  # ties with 0.5
    cases = [(lambda A: ops.maximum(A, 0.5), np.maximum(X, 0.5)),
             (lambda A: ops.maximum(2.0, A), np.maximum(2.0, X)),
             (lambda A: ops.minimum(A, 0.5), np.minimum(X, 0.5)),
             (lambda A: ops.minimum(-1, A), np.minimum(-1.0, X)),
             (lambda A: 1.5 - A, 1.5 - X), (lambda A: ops.sub(3, A), 3 - X),
             (lambda A: 2.0 / A, 2.0 / X), (lambda A: ops.div(-1.0, A), -1.0 / X)]
    for fn, ref in cases:
        D = nk.trace(fn, {"X": f64(q, x)})
        np.testing.assert_array_equal(run(D, X), ref)
        np.testing.assert_allclose(sympy_meaning(D, X), ref, rtol=1e-13)
        (got,), _ = written(D, X)
        np.testing.assert_array_equal(got, ref)
    D = nk.trace(lambda A: ops.maximum(A, 0.5), {"X": f64(q, x)})
    box = only_box(D)
    assert box.name == "max_const(0.5)" and flops(D) == q.size * x.size
    # max(fill, c) is c, not the fill: a mask's fill does not pass through a max
    assert box.spec.absorbs("NEG", 0, (), "x") is None
    assert Map("min_const", 0.5).absorbs("NEG", 0, (), "x") == "NEG"


# --------------------------------------------------------------------------- comparisons, where
CMP = {"less": np.less, "less_equal": np.less_equal, "greater": np.greater,
       "greater_equal": np.greater_equal, "equal": np.equal, "not_equal": np.not_equal}


@pytest.mark.parametrize("name", sorted(CMP))
def test_comparisons_either_side_numbers_bool_output(name):
    A = np.array([[0.0, 1.0, 2.0], [2.0, -1.0, 1.0]])
    B = np.array([1.0, 1.0, 2.0])
    f, ref = getattr(ops, name), CMP[name]
    for fn, want in ((lambda a, b: f(a, b), ref(A, B)), (lambda a, b: f(a, 1.0), ref(A, 1.0)),
                     (lambda a, b: f(1, a), ref(1, A))):
        D = nk.trace(lambda a, b: ops.where(fn(a, b), a, -5.0), {"A": f64(q, x), "B": f64(x)})
        assert [ob.type.dtype for b in D.boxes if getattr(b, "spec", None) is not None
                and b.spec.kind == "compare" for ob in b.cod.inside] == ["bool"]
        np.testing.assert_array_equal(run(D, A, B), np.where(want, A, -5.0))
        np.testing.assert_allclose(sympy_meaning(D, A, B), np.where(want, A, -5.0))
        (got,), _ = written(D, A, B)
        np.testing.assert_array_equal(got, np.where(want, A, -5.0))
    D = nk.trace(lambda a, b: f(a, b), {"A": f64(q, x), "B": f64(x)})
    assert D.cod.inside[0].type.dtype == "bool"
    np.testing.assert_array_equal(run(D, A, B), ref(A, B))


def test_where_broadcasts_promotes_and_takes_numbers():
    C = np.array([True, False, True])
    A = np.arange(6.0).reshape(2, 3)
    D = nk.trace(lambda c, a, b: ops.where(c, a, b),
                 {"C": nk.Array(x, dtype="bool"), "A": f64(q, x), "B": nk.Array(q, dtype="f32")})
    assert D.cod.inside[0].type.dtype == "f64" and D.cod.inside[0].type.names == ("x", "q")
    B = np.array([-1.0, -2.0], np.float32)
    np.testing.assert_array_equal(run(D, C, A, B), np.where(C[:, None], A.T, B[None, :]))
    D2 = nk.trace(lambda c: ops.where(c, 1.0, 0), {"C": nk.Array(x, dtype="bool")})
    np.testing.assert_array_equal(run(D2, C), [1.0, 0.0, 1.0])
    assert D2.cod.inside[0].type.dtype == "f32"
    D3 = nk.trace(lambda c, i: ops.where(c, i, 0.5),
                  {"C": nk.Array(x, dtype="bool"), "I": nk.Array(x, dtype="int32")})
    assert D3.cod.inside[0].type.dtype == "f32"  # a float constant beside integers
    with pytest.raises(NapkinError, match=r"where: the condition .* has dtype f64, not bool"):
        nk.trace(lambda a: ops.where(a, a, 0.0), {"A": f64(x)})


# --------------------------------------------------------------------------- positions
def test_positions_global_index_and_errors():
    D = nk.trace(lambda S: ops.sub(S, ops.sub(ops.positions(q), ops.positions(x))),
                 {"S": f64(q, x)})
    S = np.zeros((4, 6))
    ref = -(np.arange(4)[:, None] - np.arange(6)[None, :])
    np.testing.assert_array_equal(run(D, S), ref)
    np.testing.assert_array_equal(sympy_meaning(D, S), ref)
    pos = [b for b in D.boxes if getattr(b, "spec", None) is not None
           and b.spec.kind == "positions"]
    assert [b.name for b in pos] == ["positions_q", "positions_x"]
    assert all(len(b.dom) == 0 and b.spec.flops((), ()) == 0 for b in pos)
    # the kernel spelling reads the tile's offset, as a mask does
    (got,), text = written(D, S, offsets={"q": 8, "x": 32})
    np.testing.assert_array_equal(got, -((8 + np.arange(4))[:, None] - (32 + np.arange(6))))
    assert "jnp.arange(" in text
    with pytest.raises(NapkinError, match="positions: 'q' is not an Axis with a size"):
        nk.trace(lambda S: ops.add(S, ops.positions("q")), {"S": f64(q, x)})


def alibi_like():
    """S[q,x] − slope·(q − x) under a causal mask, softmax over x, times V (one head)."""
    def fn(S, V, slope):
        rel = ops.sub(ops.positions(q), ops.positions(x))
        T = ops.causal_mask(ops.sub(S, ops.mul(slope, rel)), q, x)
        return ops.contract(ops.softmax(T, x), V, out=(q, d))
    return nk.trace(fn, {"S": f64(q, x), "V": f64(x, d), "slope": f64()})


def alibi_ref(S, V, slope):
    nq, nx = S.shape
    T = S - slope * (np.arange(nq)[:, None] - np.arange(nx)[None, :])
    keep = np.arange(nx)[None, :] <= np.arange(nq)[:, None]
    T = np.where(keep, T, -np.inf)
    P = np.exp(T - T.max(1, keepdims=True))
    return (P / P.sum(1, keepdims=True)) @ V


@pytest.mark.parametrize("tiles", [dict(g_q=3, s_x=4), dict(g_q=2, s_x=1), dict(g_q=16, s_x=16)])
def test_positions_inside_a_group_and_a_stream(tiles):
    D = alibi_like()
    rng = np.random.default_rng(0)
    S, V, slope = rng.normal(size=(7, 9)), rng.normal(size=(9, 3)), np.array(0.7)
    ref = alibi_ref(S, V, slope)
    np.testing.assert_allclose(run(D, S, V, slope), ref, rtol=1e-12)
    G = RULES["group_partition"].apply(D, whole(D), {"axis": "q"})
    (g,) = [b for b in G.boxes if getattr(b, "spec", None) is not None]
    assert g.spec.kind == "group"  # positions along x (no inputs) replayed in every group
    np.testing.assert_allclose(run(G, S, V, slope, sizes=tiles), ref, rtol=1e-12)
    P = RULES["stream_partition"].apply(G, whole(G, (0,)), {"axis": "x"})
    np.testing.assert_allclose(run(P, S, V, slope, sizes=tiles), ref, rtol=1e-12)
    # integer tiles that divide nothing: the ragged last piece relabelled to its length
    G3 = RULES["group_partition"].apply(D, whole(D), {"axis": "q", "size": 3})
    P3 = RULES["stream_partition"].apply(G3, whole(G3, (0,)), {"axis": "x", "chunk": 4})
    np.testing.assert_allclose(run(P3, S, V, slope), ref, rtol=1e-12)


def test_positions_along_the_stream_are_pre_boxes_replayed_per_chunk():
    from napkin.core.ir import view
    from napkin.core.region import region
    from rewrites.stream_partition import analyse
    D = alibi_like()
    g = view(D)
    claims, pre, post = analyse(g, region(g, whole(D).ops), "x")
    name = lambda m: g.nodes[m]["box"].name  # noqa: E731
    assert "positions_x" in [name(m) for m in pre]
    assert "positions_q" in [name(m) for m in pre] and "positions_q" in [name(m) for m in post]
    assert [c.rule.name for c in claims] == ["softmax_contraction"]
    # built: both positions replayed per chunk, none in the finalize (nothing reads them)
    (st,) = [b.spec for b in RULES["stream_partition"].apply(D, whole(D), {"axis": "x"}).boxes
             if getattr(b, "spec", None) is not None]
    boxes = lambda dg: [b.name for b in dg.boxes if getattr(b, "spec", None) is not None]  # noqa
    assert {"positions_q", "positions_x"} <= set(boxes(st.update))
    assert not any(b.startswith("positions") for b in boxes(st.finalize))


def test_alibi_groups_heads_inside_query_groups_constants_replayed():
    """rel = positions(q) − positions(x) lacks h: a constant, replayed in every head group."""
    alg = get("alibi_attention")
    D = alg.diagram("f64")
    P = RULES["group_partition"].apply(D, whole(D), {"axis": "q"})
    P = RULES["group_partition"].apply(P, whole(P, (0,)), {"axis": "h"})
    P = RULES["stream_partition"].apply(P, whole(P, (0, 0)), {"axis": "x"})
    xs = alg.sample(np.random.default_rng(6), dict(h=3, q=7, x=9, d=2))
    np.testing.assert_allclose(run(P, *xs, sizes={"g_q": 3, "g_h": 2, "s_x": 4}),
                               np.asarray(alg.reference(*xs)), rtol=1e-12)


def test_group_partition_replays_a_constant_but_refuses_one_that_leaves():
    def fn(S):
        p = ops.positions(x)
        return ops.add(S, p), p
    D = nk.trace(fn, {"S": f64(q, x)})
    with pytest.raises(RuleError, match="lacks it"):
        RULES["group_partition"].apply(D, whole(D), {"axis": "q"})
    sites = [s for s, p in RULES["group_partition"].candidates(D) if p["axis"] == "q"]
    assert sites and all(len(s.ops) == 1 for s in sites)  # positions_x is an output: outside
    G = RULES["group_partition"].apply(D, sites[0], {"axis": "q", "size": 2})
    S = np.arange(15.0).reshape(5, 3)
    got = run(G, S)
    np.testing.assert_array_equal(got[0], S + np.arange(3))
    np.testing.assert_array_equal(got[1], np.arange(3))


# --------------------------------------------------------------------------- take_along_axis
def take_program(index_axes=(n,)):
    return nk.trace(lambda L, I: ops.take_along_axis(L, I, v),
                    {"L": f64(n, v, d), "I": nk.Array(*index_axes, dtype="int32")})


def test_take_along_axis_matches_numpy_and_out_of_range_picks_zero():
    rng = np.random.default_rng(1)
    L = rng.normal(size=(4, 7, 3))
    idx = np.array([0, 6, 3, -1], np.int32)  # −1: out of range, picks 0
    D = take_program()
    want = np.take_along_axis(L, np.clip(idx, 0, 6)[:, None, None], axis=1)[:, 0]
    want[3] = 0.0
    np.testing.assert_array_equal(run(D, L, idx), want)
    np.testing.assert_allclose(sympy_meaning(D, L, idx), want, rtol=1e-13)
    (got,), text = written(D, L, idx)
    np.testing.assert_array_equal(got, want)
    assert "take" not in text and "gather" not in text  # a compare, a select, a sum
    # an index with fewer axes is broadcast; the picked entry is exact (NaN elsewhere: no trace)
    L[:, 2, :] = np.nan
    Db = take_program((d,))
    idx_d = np.array([1, 5, 0], np.int32)
    np.testing.assert_array_equal(run(Db, L, idx_d), L[:, idx_d, np.arange(3)])
    box = only_box(D)
    assert box.name == "take_v" and flops(D) == n.size * v.size * d.size
    assert box.spec.neutral("v") == 0.0 and box.spec.neutral("n") is None
    assert box.spec.absorbs("ZERO", 0, (), "v") == "ABSORBED"
    assert box.spec.absorbs("NEG", 0, (), "v") is None


def test_take_along_axis_streams_with_the_sum_accumulator_in_groups_and_ragged_chunks():
    alg = get("cross_entropy")
    D = alg.diagram("f64")
    rng = np.random.default_rng(2)
    xs = alg.sample(rng, dict(n=7, v=13))
    assert xs[1].dtype == np.int32 and xs[1].min() >= 0 and xs[1].max() < 13
    xs[1][:3] = [0, 12, 9]      # the first chunk, the ragged last one, one in between
    ref = np.asarray(alg.reference(*xs))
    G = RULES["group_partition"].apply(D, whole(D), {"axis": "n"})
    P = RULES["stream_partition"].apply(G, whole(G, (0,)), {"axis": "v"})
    (stream,) = [b for g in P.boxes if getattr(g, "spec", None) is not None
                 for b in g.spec.body.boxes if getattr(b, "spec", None) is not None]
    assert stream.spec.rule == "logsumexp+sum_contraction"  # one pass over v
    for tiles in (dict(g_n=3, s_v=4), dict(g_n=2, s_v=1), dict(g_n=7, s_v=13)):
        np.testing.assert_allclose(run(P, *xs, sizes=tiles), ref, rtol=1e-12)


def test_take_along_axis_bad_inputs_are_one_line_naming_the_array():
    with pytest.raises(NapkinError, match=r"take_along_axis: the index I\[n\] has dtype f64; an "
                                          r"index is an integer array"):
        nk.trace(lambda L, I: ops.take_along_axis(L, I, v), {"L": f64(n, v), "I": f64(n)})
    with pytest.raises(NapkinError, match=r"the index I\[n,v\] has axis v, the axis it takes"):
        nk.trace(lambda L, I: ops.take_along_axis(L, I, v),
                 {"L": f64(n, v), "I": nk.Array(n, v, dtype="int32")})
    with pytest.raises(NapkinError, match=r"the index I\[h\] has axis h, which the array L"):
        nk.trace(lambda L, I: ops.take_along_axis(L, I, v),
                 {"L": f64(n, v), "I": nk.Array(h, dtype="int32")})
    with pytest.raises(NapkinError, match=r"the array L\[n\] has no axis v"):
        nk.trace(lambda L, I: ops.take_along_axis(L, I, v),
                 {"L": f64(n), "I": nk.Array(n, dtype="int32")})


def test_sampling_index_kind_and_integer_dtypes():
    D = take_program()
    L, idx = sample(D, {"n": 50, "v": 3, "d": 2}, np.random.default_rng(0),
                    kinds={"I": "index:v"})
    assert L.dtype == np.float64 and idx.dtype == np.int32
    assert set(np.unique(idx)) == {0, 1, 2}
    _, raw = sample(D, {"n": 50, "v": 3, "d": 2}, np.random.default_rng(0), dtype=np.float32)
    assert raw.dtype == np.int32  # an int32 input keeps its dtype whatever the float dtype
    with pytest.raises(NapkinError, match="index along axis z, which no input has"):
        sample(D, {"n": 2, "v": 3, "d": 2}, np.random.default_rng(0), kinds={"I": "index:z"})


# --------------------------------------------------------------------------- softmax with a sink
def sink_ref(S, s):
    m = np.maximum(S.max(-1, keepdims=True), s[..., None])
    e = np.exp(S - m)
    return e / (e.sum(-1, keepdims=True) + np.exp(s[..., None] - m))


def test_softmax_with_a_sink():
    rng = np.random.default_rng(3)
    S, s = rng.normal(size=(2, 4, 5)) * 3, rng.normal(size=2)
    D = nk.trace(lambda S, s: ops.softmax(S, x, sink=s), {"S": f64(h, q, x), "s": f64(h)})
    got = run(D, S, s)
    np.testing.assert_allclose(got, sink_ref(S, s[:, None]), rtol=1e-13)
    assert np.all(got.sum(-1) < 1)  # the sink takes mass
    np.testing.assert_allclose(sympy_meaning(D, S[:, :2, :3], s), sink_ref(S[:, :2, :3],
                                                                           s[:, None]), rtol=1e-12)
    (w,), _ = written(D, S, s)
    np.testing.assert_allclose(w, sink_ref(S, s[:, None]), rtol=1e-13)
    # a fully masked row keeps the sink: zeros (no NaN); no sink and nothing kept: zeros
    S2 = S.copy()
    S2[0, 0] = -1e30
    S2[1, 1] = -np.inf
    s2 = s.copy()
    np.testing.assert_array_equal(run(D, S2, s2)[0, 0], 0.0)
    np.testing.assert_array_equal(run(D, S2, s2)[1, 1], 0.0)
    s2[1] = -np.inf
    out = run(D, S2, s2)
    assert np.isfinite(out).all() and np.all(out[1, 1] == 0.0)
    np.testing.assert_allclose(out[1, 0], sink_ref(S2[1, 0], np.array(-np.inf)), rtol=1e-13)
    box = only_box(D)
    assert box.name == "softmax_x+sink" and box.spec.kind == "softmax"
    assert sympy.expand(flops(D) - 5 * h.size * q.size * x.size - 3 * h.size * q.size) == 0


def test_sink_errors_name_the_array():
    with pytest.raises(NapkinError, match=r"softmax: the sink s\[q,x\] has the softmax axis x"):
        nk.trace(lambda S, s: ops.softmax(S, x, sink=s), {"S": f64(q, x), "s": f64(q, x)})
    with pytest.raises(NapkinError, match=r"the sink s\[h\] has axis h, which the scores"):
        nk.trace(lambda S, s: ops.softmax(S, x, sink=s), {"S": f64(q, x), "s": f64(h)})


def test_sink_attention_streams_with_the_softmax_contraction_accumulator():
    alg = get("sink_attention")
    D = alg.diagram("f64")
    xs = alg.sample(np.random.default_rng(4), dict(h=2, q=5, x=11, d=3), scale=3.0)
    xs[3][1] = 8.0  # a dominant sink on head 1
    ref = np.asarray(alg.reference(*xs))
    G = RULES["group_partition"].apply(D, whole(D), {"axis": "q"})
    P = RULES["stream_partition"].apply(G, whole(G, (0,)), {"axis": "x"})
    (stream,) = [b for g in P.boxes if getattr(g, "spec", None) is not None
                 for b in g.spec.body.boxes if getattr(b, "spec", None) is not None]
    assert stream.spec.rule == "softmax_contraction"
    assert "sink" in [ob.name for ob in stream.spec.finalize.dom.inside]
    for tiles in (dict(g_q=2, s_x=4), dict(g_q=5, s_x=1)):
        np.testing.assert_allclose(run(P, *xs, sizes=tiles), ref, rtol=1e-12)


def test_a_sink_computed_inside_the_stream_region_reaches_the_finalize():
    """The sink scaled by a box inside the region (an invariant): replayed before the
    claim's finalize reads it."""
    def fn(S, V, s):
        return ops.contract(ops.softmax(S, x, sink=ops.scale(s, 2.0)), V, out=(q, d))
    D = nk.trace(fn, {"S": f64(q, x), "V": f64(x, d), "s": f64(q)})
    rng = np.random.default_rng(5)
    S, V, s = rng.normal(size=(3, 7)), rng.normal(size=(7, 2)), rng.normal(size=3)
    P = RULES["stream_partition"].apply(D, whole(D), {"axis": "x"})
    np.testing.assert_allclose(run(P, S, V, s, sizes={"s_x": 3}),
                               sink_ref(S, 2 * s) @ V, rtol=1e-12)


# --------------------------------------------------------------------------- wrong accumulators
@pytest.mark.parametrize("name", [
    "wrong: take_along_axis streamed with chunk-local positions (the offset ignored)",
    "wrong: softmax_contraction with the sink added in every update"])
def test_wrong_accumulators_fail_their_proofs(name):
    from proofs.wrong_variants import prove_variant
    r = prove_variant(name)
    assert not r.ok
    assert any("accumulator law" in o.description for o in r.failed)
    assert "counterexample" in r.detail
    assert all(o.ok for o in r.obligations if "base case" in o.description)
    assert any(o.kind == "numeric" for o in r.failed)


def test_an_integer_index_passes_the_float_premise_an_integer_value_does_not():
    D = take_program()
    RULES["stream_partition"].check(D, whole(D), {"axis": "v"})
    Di = nk.trace(lambda L, I: ops.take_along_axis(L, I, v),
                  {"L": nk.Array(n, v, dtype="int32"), "I": nk.Array(n, dtype="int32")})
    with pytest.raises(RuleError, match="accumulators are floating-point"):
        RULES["stream_partition"].check(Di, whole(Di), {"axis": "v"})
