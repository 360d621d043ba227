"""Soundness: no rule, certificate or check accepts a wrong program.

One regression test per finding of the soundness issue (fresh tile names,
integer tiles, the checker's own check sizes, −∞ and NaN, check ⇒ apply, low
precision wires), then a property test: random algorithms from the public
primitives, random chains of the rules' own proposals, every rewritten program
compared with its algorithm in float64 (proofs/fuzz.py; the long campaign is
benchmarks/fuzz.py).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, given, settings, strategies as st

import napkin as nk
from napkin import ops
from napkin.core.arrays import Axis
from napkin.certify.certificate import derive, size_symbols
from napkin.certify.checker import check_cases, check_certificate, partitions
from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, view
from napkin.frontend.library import get
from napkin.core.region import Site
from proofs import fuzz
from rewrites import RULES

FLASH = [("group_partition", (), {"axis": "q"}), ("stream_partition", (0,), {"axis": "x"})]


def whole(program, path=()):
    from napkin.core.region import body_at
    return Site(tuple(path), tuple(range(len(op_order(view(body_at(program, path)))))))


def apply(program, rule, params, path=(), ops_=None):
    site = whole(program, path) if ops_ is None else Site(tuple(path), tuple(ops_))
    return RULES[rule].apply(program, site, dict(params))


def same(got, want, rtol=1e-9):
    got = [np.asarray(g, np.float64) for g in (got if isinstance(got, tuple) else (got,))]
    want = [np.asarray(w, np.float64) for w in (want if isinstance(want, tuple) else (want,))]
    why = fuzz.compare(got, want, rtol)
    assert why is None, why
    for g, w in zip(got, want):  # and exactly the same non-finite values
        assert np.array_equal(g[~np.isfinite(w)], w[~np.isfinite(w)], equal_nan=True)


@pytest.fixture
def fresh_memos():
    """Rules memoise the boxes they build; a test that patches a rule needs them rebuilt."""
    from napkin.core import streamed
    from rewrites import base
    base._BUILT.table.clear()
    streamed._AT_LENGTH.table.clear()
    yield
    base._BUILT.table.clear()
    streamed._AT_LENGTH.table.clear()


# ----------------------------------------------------------------------------- 1. fresh tiles
@pytest.mark.parametrize("name,steps,clash", [
    ("attention", [("group_partition", (), {"axis": "q", "size": "d"})], "d"),
    ("attention", [("group_partition", (), {"axis": "q"}),
                   ("stream_partition", (0,), {"axis": "x", "chunk": "d"})], "d"),
    ("rmsnorm_matmul", [("group_partition", (), {"axis": "n", "size": "d"})], "d"),
    ("attention", [("group_partition", (), {"axis": "q", "size": "x"})], "x"),
])
def test_a_tile_named_like_an_axis_is_refused(name, steps, clash):
    with pytest.raises(RuleError, match=f"tile name {clash} is already the name of an axis"):
        derive(name, steps, {}, {})


def test_a_tile_named_like_an_enclosing_or_other_tile_is_refused():
    with pytest.raises(RuleError, match="tile of the group over q that encloses this site"):
        derive("attention", [("group_partition", (), {"axis": "q"}),
                             ("stream_partition", (0,), {"axis": "x", "chunk": "g_q"})], {}, {})
    with pytest.raises(RuleError, match="tile of the stream over x that lies inside"):
        derive("attention", [("stream_partition", (), {"axis": "x", "chunk": "t"}),
                             ("group_partition", (), {"axis": "q", "size": "t"})], {}, {})
    # a size symbol that is not an axis name is taken too
    m = Axis("m", "length")
    D = nk.trace(lambda X: ops.exp(X), {"X": (m,)}, "exp")
    with pytest.raises(RuleError, match="tile name length is already a size symbol"):
        apply(D, "group_partition", {"axis": "m", "size": "length"})


def test_sibling_partitions_of_one_axis_may_share_their_tile():
    """Two layers grouped over q with the same g_q: neither binds it inside the other."""
    q, d = nk.axes("q d")
    D = nk.trace(lambda X: ops.neg(ops.tanh(ops.exp(X))), {"X": (q, d)}, "three")
    P = apply(D, "group_partition", {"axis": "q", "size": "g_q"}, ops_=(0,))
    P = apply(P, "group_partition", {"axis": "q", "size": "g_q"}, ops_=(1,))
    x = np.random.default_rng(0).normal(size=(7, 3))
    same(nk.evaluate(P, {"g_q": 3})(x), nk.evaluate(D)(x))
    # ... but not a partition of another axis (one tile would then mean two things)
    with pytest.raises(RuleError, match="tile name g_q is already the tile of a group over q"):
        apply(P, "group_partition", {"axis": "d", "size": "g_q"}, ops_=(2,))


@pytest.mark.parametrize("names", [("a", "g_a", "s_g_a"), ("q", "x", "s_x")])
def test_the_search_never_picks_a_taken_tile_name(names):
    """An algorithm whose axes are named like the default tiles (a and g_a; a head
    dimension called s_x) gets fresh tiles, and the program still computes it."""
    from napkin.search import search
    r_, c_, h_ = nk.axes(" ".join(names))

    def alg(A, B, C):
        S = ops.contract(A, B, out=(r_, c_))
        return ops.contract(ops.softmax(S, c_), C, out=(r_, h_))
    D = nk.trace(alg, {"A": (r_, h_), "B": (c_, h_), "C": (c_, h_)}, "attention-like")
    r = search(D, "h100", {n: 4096 if n != names[2] else 128 for n in names}, "bf16")
    tiles = {t for t, _ in partitions(r.best.program)}
    assert tiles and not {str(t) for t in tiles} & set(names)
    assert [m.rule for m in r.best.chain] == ["group_partition", "stream_partition"]
    small = {names[0]: 7, names[1]: 9, names[2]: 3}
    tile_values = {str(t): 2 for t in tiles}
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=s) for s in [(7, 3), (9, 3), (9, 3)]]
    same(nk.evaluate(r.best.program, tile_values)(*xs), nk.evaluate(D)(*xs))


# ----------------------------------------------------------------------------- 2. integer tiles
def test_integer_tiles_give_every_box_the_piece_length():
    """Σ_q Σ_x of ones(4, 5), grouped over q by 3 with x streamed inside: 20 (was 30:
    the stream's accumulator kept the nominal 3 rows in the last group of 1)."""
    q, x = nk.axes("q x")
    D = nk.trace(lambda X: ops.sum_(ops.sum_(X, x), q), {"X": (q, x)}, "total")
    P = apply(D, "group_partition", {"axis": "q", "size": 3}, ops_=(0,))
    P = apply(P, "stream_partition", {"axis": "x", "chunk": 2}, path=(0,))
    assert float(nk.evaluate(P)(np.ones((4, 5)))) == 20.0


def test_an_integer_tile_certificate_keeps_the_shape_at_ragged_sizes():
    cert = derive("attention", [("group_partition", (), {"axis": "q", "size": 2}),
                                ("stream_partition", (0,), {"axis": "x", "chunk": 3})],
                  {"q": 7, "x": 10, "d": 4}, {})
    report = check_certificate(cert)
    assert report.ok, report
    from napkin.cli.commands import replay
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=s) for s in [(7, 4), (10, 4), (10, 4)]]
    out = nk.evaluate(replay(cert))(*xs)
    assert out.shape == (7, 4)
    same(out, get("attention").reference(*xs))


# ----------------------------------------------------------------------------- 3. check sizes
def test_the_checker_chooses_its_own_sizes_and_tiles():
    cert = derive("attention", FLASH, {"q": 8, "x": 8, "d": 4}, {"g_q": 4, "s_x": 4})
    from napkin.cli.commands import replay
    cases = check_cases(cert, [replay(cert)])
    assert cases[0].sizes == cert.sizes and cases[0].tiles == cert.tiles
    assert any(set(c.sizes.values()) == {1} and set(c.tiles.values()) == {1} for c in cases)
    primes = [c for c in cases if "prime" in c.what][0]
    for axis, tile in (("q", "g_q"), ("x", "s_x")):
        n, t = primes.sizes[axis], primes.tiles[tile]
        assert 1 < t < n and n % t, (axis, n, t)   # several pieces, the last one partial
    assert len({tuple(sorted(c.env.items())) for c in cases}) == len(cases)


def test_a_wrong_rule_hidden_at_the_certificates_sizes_is_caught(monkeypatch, fresh_memos):
    """Reinstate the integer-tile bug (a short last piece keeps the nominal size):
    at the certificate's own sizes every tile divides, yet the checker's draws fail it."""
    from napkin.core import streamed
    monkeypatch.setattr(streamed, "at_length",
                        lambda diagram, axis, size, length, ctx: (diagram, ctx.bound(size, length)))
    cert = derive("attention", [("group_partition", (), {"axis": "q", "size": 2}),
                                ("stream_partition", (0,), {"axis": "x", "chunk": 2})],
                  {"q": 8, "x": 8, "d": 4}, {})
    report = check_certificate(cert)
    assert not report.ok
    assert "numeric check" in report.reason and "the certificate's instance" not in report.reason


def test_the_numeric_check_folds_chunks_without_unrolling():
    """Tracing a stream of 1-wide chunks costs the same at x = 16 and x = 256 (a
    certificate with s_x = 1 at x = 256 took 376 s when every chunk was traced)."""
    from napkin.cli.commands import replay
    cert = derive("attention", FLASH, {"q": 4, "x": 16, "d": 2}, {"g_q": 1, "s_x": 1})
    program = replay(cert)
    sizes = []
    for n in (16, 256):
        f = nk.evaluate(program, {"g_q": 1, "s_x": 1})
        args = [jnp.zeros((5, 2)), jnp.zeros((n, 2)), jnp.zeros((n, 2))]
        sizes.append(len(str(jax.make_jaxpr(f)(*args)).splitlines()))
    assert sizes[0] == sizes[1]


# ----------------------------------------------------------------------------- 5. −∞ and NaN
def _bias_attention():
    q, x, d = nk.axes("q x d")

    def f(Q, K, V, B):
        S = ops.add(ops.contract(Q, K, out=(q, x)), B)
        return ops.contract(ops.softmax(S, x), V, out=(q, d))
    return nk.trace(f, {"Q": (q, d), "K": (x, d), "V": (x, d), "B": (q, x)}, "biased attention")


def _special_rows(shape, chunk):
    B = np.zeros(shape)
    B[0] = -np.inf               # a row of −∞: zeros
    B[1, :chunk] = -np.inf       # a first chunk of −∞ (the running max is −∞)
    B[2, -1] = -np.inf           # −∞ in the ragged last chunk
    B[3, 1] = np.nan             # a NaN logit: a NaN row
    B[4, 0] = 1e4                # a large logit
    return B


def test_streamed_attention_equals_its_algorithm_on_minus_inf_and_nan_rows():
    D = _bias_attention()
    P = apply(apply(D, "group_partition", {"axis": "q"}), "stream_partition", {"axis": "x"},
              path=(0,))
    rng = np.random.default_rng(3)
    Q, K, V = rng.normal(size=(6, 3)), rng.normal(size=(7, 3)), rng.normal(size=(7, 3))
    B = _special_rows((6, 7), 3)
    want = nk.evaluate(D)(Q, K, V, B)
    got = nk.evaluate(P, {"g_q": 4, "s_x": 3})(Q, K, V, B)
    same(got, want)
    want = np.asarray(want)
    assert (want[0] == 0).all() and np.isnan(want[3]).all() and np.isfinite(want[[1, 2, 4, 5]]).all()


def test_streamed_logsumexp_equals_its_algorithm_on_minus_inf_and_nan_rows():
    D = get("logsumexp").diagram()
    P = apply(apply(D, "group_partition", {"axis": "n"}), "stream_partition", {"axis": "v"},
              path=(0,))
    L = np.random.default_rng(4).normal(size=(6, 7)) + _special_rows((6, 7), 3)
    want = nk.evaluate(D)(L)
    same(nk.evaluate(P, {"g_n": 4, "s_v": 3})(L), want)
    assert np.asarray(want)[0] == -np.inf and np.isnan(np.asarray(want)[3])


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernels_equal_their_algorithm_on_minus_inf_and_nan_rows():
    from napkin.lower import lower
    D = _bias_attention()
    P = apply(apply(D, "group_partition", {"axis": "q"}), "stream_partition", {"axis": "x"},
              path=(0,))
    k = lower(P, {"g_q": 16, "s_x": 16}, name="biased")
    rng = np.random.default_rng(5)
    Q, K, V = [rng.normal(size=s).astype(np.float32) for s in [(20, 16), (37, 16), (37, 16)]]
    B = _special_rows((20, 37), 16).astype(np.float32)
    same(k(Q, K, V, B), nk.evaluate(D)(Q, K, V, B), rtol=1e-5)
    L = get("logsumexp").diagram()
    k = lower(apply(apply(L, "group_partition", {"axis": "n"}), "stream_partition",
                    {"axis": "v"}, path=(0,)), {"g_n": 16, "s_v": 16}, name="lse")
    X = (rng.normal(size=(20, 37)) + _special_rows((20, 37), 16)).astype(np.float32)
    same(k(X), nk.evaluate(L)(X), rtol=1e-5)


@pytest.mark.parametrize("n", [4, 8, 16, 64, 96])
def test_one_nan_rule_at_every_size(n):
    """A query row of −∞ makes NaN scores: the diagram's meaning (the checker's ground truth)
    gives a NaN row at every size, as the plain-jnp reference does (XLA's CPU max drops a
    NaN once it vectorises, from about 64 entries: the backend's max keeps it)."""
    alg = get("causal_attention")
    rng = np.random.default_rng(n)
    Q, K, V = (rng.standard_normal((n, 16)) for _ in range(3))
    Q[1] = -np.inf
    with jax.enable_x64(True):
        want = np.asarray(alg.reference(Q, K, V))
        got = np.asarray(nk.evaluate(alg.diagram(), {"q": n, "x": n, "d": 16})(Q, K, V))
    assert np.isnan(got[1]).all() and np.isnan(want[1]).all()
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    assert np.allclose(got[np.isfinite(want)], want[np.isfinite(want)])


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_the_kernel_follows_the_diagram_on_infinite_keys():
    """+∞ in K: the rows that see that key are NaN, those that mask it are finite — in the
    kernel (streamed, tiles skipped above the diagonal) as in the diagram."""
    n = 96
    o = nk.optimize("causal_attention", sizes={"q": n, "x": n, "d": 16}, dtype="f32")
    o = o.with_tiles({t: 32 for t in o.tiles})
    rng = np.random.default_rng(7)
    Q, K, V = (rng.standard_normal((n, 16)).astype(np.float32) for _ in range(3))
    K[[40, 70]] = np.inf
    got = np.asarray(o.kernel(interpret=True)(Q, K, V))
    with jax.enable_x64(True):
        want = np.asarray(nk.evaluate(get("causal_attention").diagram(),
                                      {"q": n, "x": n, "d": 16})(*(np.float64(a) for a in
                                                                   (Q, K, V))))
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    assert (~np.isfinite(want[40:])).all() and np.isfinite(want[:40]).all()
    assert np.allclose(got[:40], want[:40], rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_a_product_with_infinity_over_a_ragged_tail_is_the_unstreamed_meaning():
    """Σ_b X1[a]·X2[b] with X1 = −∞ and X2 = [1, −1, 1, −1, 5]: under IEEE every product is
    ±∞ and the sum NaN.  Summing X2 first (X1 · Σ X2) gives −∞ unstreamed and −∞ · 0 = NaN
    for the first chunk of 4: the meaning forms the product before the sum, and the kernel
    pads the tail with 0 in every factor (a padded 0 times −∞ would be NaN)."""
    from napkin.lower import lower
    a, b = nk.axes("a b")
    D = nk.trace(lambda X1, X2: ops.contract(X1, X2, out=(a,)), {"X1": (a,), "X2": (b,)}, "rag")
    P = RULES["stream_partition"].apply(D, Site((), (0,)), {"axis": "b", "chunk": "s_b"})
    X1 = np.array([-np.inf, 1, 2, 3, 4], np.float32)
    for X2 in ([1, -1, 1, -1, 5], [1, 2, 3, 4, 5]):
        X2 = np.array(X2, np.float32)
        want = np.asarray(nk.evaluate(D)(X1, X2))
        assert (np.isnan(want[0]) if X2.min() < 0 else want[0] == -np.inf)
        same(nk.evaluate(P, {"s_b": 4})(X1, X2), want)
        same(lower(P, {"s_b": 4}, name="rag")(X1, X2), want, rtol=1e-6)


def test_a_size_only_a_constant_names_is_asked_for_and_bound_in_kernels():
    """1/sqrt(b) where no input carries b: evaluation says how to give b; a searched
    kernel binds it as the search saw it."""
    a, b = nk.axes("a b")
    D = nk.trace(lambda X: ops.scale(X, 1 / sympy.sqrt(b.size)), {"X": (a,)}, "constant_size")
    with pytest.raises(nk.NapkinError, match=r"no input carries an axis of size b .*sizes=\{'b'"):
        nk.evaluate(D)(np.ones(3))
    assert np.allclose(nk.evaluate(D, {"b": 4})(np.ones(3)), 0.5)
    o = nk.optimize(D, sizes={"a": 8, "b": 16}, dtype="f32")
    assert np.allclose(o.kernel(interpret=True)(np.ones(8, np.float32)), 0.25)


# ----------------------------------------------------------------------------- 6. check ⇒ apply
def _checks_then_applies(program, rule, site, params):
    RULES[rule].check(program, site, params)
    return RULES[rule].apply(program, site, params)


def test_a_reduction_of_a_reduction_is_refused_by_check_not_a_crash():
    a, b = nk.axes("a b")
    D = nk.trace(lambda X, Y: ops.contract(Y, ops.contract(X, X, out=()), out=(a,)),
                 {"X": (a, b), "Y": (a, b)}, "nested sums")
    with pytest.raises(RuleError, match="depends on a reduction over b"):
        RULES["stream_partition"].check(D, whole(D), {"axis": "b"})


def test_a_quotient_used_twice_is_not_factored_out():
    q, x = nk.axes("q x")
    D = nk.trace(lambda N, Dn: ops.contract(ops.div(N, Dn), ops.div(N, Dn), out=(q,)),
                 {"N": (q, x), "Dn": (q,)}, "P·P")
    D2 = nk.trace(lambda N, Dn: (lambda P: ops.contract(P, P, out=(q,)))(ops.div(N, Dn)),
                  {"N": (q, x), "Dn": (q,)}, "P·P shared")
    for prog in (D, D2):
        for i in range(len(op_order(view(prog)))):
            site = Site((), (i,))
            try:
                RULES["normalized_contraction"].check(prog, site, {})
            except RuleError:
                continue
            _checks_then_applies(prog, "normalized_contraction", site, {})


def test_a_factor_carrying_an_output_axis_alone_is_not_factored_out():
    q, x, d = nk.axes("q x d")
    D = nk.trace(lambda N, Dn, V: ops.contract(ops.div(N, Dn), V, out=(q, d)),
                 {"N": (x,), "Dn": (q,), "V": (x, d)}, "n/D·v")
    with pytest.raises(RuleError, match="every output axis"):
        RULES["normalized_contraction"].check(D, Site((), (1,)), {})
    from napkin.search import search
    r = search(D, "h100", {"q": 1024, "x": 1024, "d": 64}, "bf16")
    assert r.best.feasible
    assert not any("is in no input" in why for why in r.refused.values())


def test_a_rule_that_crashes_is_a_refusal_in_the_search(monkeypatch, fresh_memos):
    from napkin.search import search
    from rewrites.stream_partition import StreamPartition

    def broken(self, program, site, params):
        raise KeyError(8)
    monkeypatch.setattr(StreamPartition, "apply", broken)
    # keys few enough that a q tile (64 rows at least: the tensor cores) holds them all
    r = search(get("attention").diagram(), "h100", {"q": 1024, "x": 256, "d": 64}, "bf16")
    assert all(m.rule != "stream_partition" for m in r.best.chain)
    assert "KeyError" in r.refused[("stream_partition", "x")]


def test_a_rule_whose_proposals_crash_is_a_refusal_in_the_search(monkeypatch, fresh_memos):
    from napkin.search import search
    from rewrites.relabel_level import RelabelLevel

    def broken(self, program, path=()):
        raise IndexError("no proposals today")
        yield
    monkeypatch.setattr(RelabelLevel, "candidates", broken)
    r = search(get("attention").diagram(), "h100", {"q": 1024, "x": 1024, "d": 64}, "bf16")
    assert [m.rule for m in r.best.chain] == ["group_partition", "stream_partition"]
    assert "IndexError: no proposals today" in r.refused[("relabel_level", None)]


# ----------------------------------------------------------------------------- 7. dtypes
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32", "f64"])
def test_flash_attention_verifies_at_every_float_dtype(dtype):
    cert = derive("attention", FLASH, {"q": 8, "x": 10, "d": 4}, {"g_q": 3, "s_x": 3},
                  dtype=dtype)
    report = check_certificate(cert)
    assert report.ok, report
    assert report.dtype == dtype
    assert report.max_error <= 1e-9


def test_a_cast_the_algorithm_does_not_have_fails_the_dtype_check(monkeypatch, fresh_memos):
    """A stream that rounds p to bf16 in an f32 program is exact over the reals but
    not at the program's own dtypes: the check at the wires' dtypes refuses it."""
    from rewrites import softmax_contraction
    original = softmax_contraction.SoftmaxContraction.update

    def rounding(self, graph, claim, axis, state, ins):
        x = ops.cast(ops.cast(ins[0], "bf16"), "f32")
        return original(self, graph, claim, axis, state, [x, *ins[1:]])
    monkeypatch.setattr(softmax_contraction.SoftmaxContraction, "update", rounding)
    cert = derive("attention", FLASH, {"q": 8, "x": 10, "d": 4}, {"g_q": 3, "s_x": 3})
    report = check_certificate(cert)
    assert not report.ok and "at the wires' dtypes" in report.reason, report


@pytest.mark.parametrize("dtype", ["int8", "int32", "bool"])
def test_integer_wires_are_refused_by_the_stream_premise(dtype):
    with pytest.raises(RuleError, match="accumulators are floating-point"):
        derive("matmul", [("stream_partition", (), {"axis": "b"})], {}, {}, dtype=dtype)


# ----------------------------------------------------------------------------- property test
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_chains_of_rule_applications_preserve_meaning(data):
    """Random algorithms (colliding axis names, symbolic and integer sizes), chains of
    the rules' own proposals with default, integer and clashing tile names, at
    ragged, prime and size-1 sizes, on inputs with ±1e4, −∞, NaN and rows of −∞."""
    ch = fuzz.HypothesisChooser(data)
    alg = fuzz.random_algorithm(ch)
    programs, chain, findings, _ = fuzz.random_chain(alg, ch)
    findings += fuzz.check_chain(alg, programs, chain, ch, special=ch.boolean(0.7))
    assert not findings, "; ".join(f"{f.kind}: {f.detail} — {fuzz.describe(alg, f.chain)}"
                                   for f in findings)
