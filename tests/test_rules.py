"""Rules: each applies where its premises hold, says why where they don't,
and the rewritten program means the same as the algorithm."""
import numpy as np
import pytest
import sympy

import napkin as nk
from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, to_graph
from napkin.frontend.library import get
from napkin.core.region import Site, body_at
from rewrites import RULES, STREAMABILITY

group, stream = RULES["group_partition"], RULES["stream_partition"]


def whole(program, path=()):
    return Site(tuple(path), tuple(range(len(op_order(to_graph(body_at(program, path)))))))


def derive(name, steps):
    p = get(name).diagram()
    for rule, path, params in steps:
        site = whole(p, path) if "ops" not in params else Site(tuple(path), params.pop("ops"))
        p = RULES[rule].apply(p, site, dict(params))
    return p


def check(name, program, sizes, tiles, seed=0, scale=1.0):
    alg = get(name)
    xs = alg.sample(np.random.default_rng(seed), sizes, scale=scale)
    out, ref = np.asarray(nk.evaluate(program, tiles)(*xs)), np.asarray(alg.reference(*xs))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


FLASH = [("group_partition", (), {"axis": "q"}), ("stream_partition", (0,), {"axis": "x"})]


@pytest.mark.parametrize("name", ["attention", "causal_attention", "sliding_window_attention",
                                  "softcap_attention"])
@pytest.mark.parametrize("tiles", [dict(g_q=4, s_x=3), dict(g_q=2, s_x=1), dict(g_q=64, s_x=64)])
def test_flash_attention_derivation_is_exact(name, tiles):
    p = derive(name, FLASH)
    check(name, p, dict(q=7, x=9, d=4), tiles)
    check(name, p, dict(q=5, x=5, d=3), tiles, seed=1, scale=40.0)  # large logits


def test_flash_attention_uses_softmax_contraction_accumulator():
    p = derive("attention", FLASH)
    (g,) = [b for b in p.boxes if getattr(b, "data", None) is not None and b.data.kind == "group"]
    (s,) = [b for b in g.data.body.boxes if getattr(b, "data", None) is not None]
    assert s.data.kind == "stream" and s.data.rule == "softmax_contraction"
    assert [ob.name for ob in s.data.init.cod.inside] == ["mu", "z", "o"]
    # nothing of size q×x leaves the group: the stream's outputs lack x
    assert all(not ob.type.has("x") for ob in s.cod.inside)


@pytest.mark.parametrize("name,steps,sizes,tiles", [
    ("matmul", [("group_partition", (), {"axis": "a"}), ("group_partition", (0,), {"axis": "c"}),
                ("stream_partition", (0, 0), {"axis": "b"})], dict(a=7, b=9, c=5), dict(g_a=3, g_c=2, s_b=4)),
    ("batched_matmul", [("group_partition", (), {"axis": "batch", "size": 1}),
                        ("stream_partition", (0,), {"axis": "b"})], dict(batch=2, a=3, b=7, c=2), dict(s_b=3)),
    ("mha", [("group_partition", (), {"axis": "h"}), ("group_partition", (0,), {"axis": "q"}),
             ("stream_partition", (0, 0), {"axis": "x"})], dict(h=3, q=5, x=7, d=3), dict(g_h=2, g_q=4, s_x=4)),
    ("gqa", [("head_grouping", (), {"axis": "k"}), ("group_partition", (0,), {"axis": "q"}),
             ("stream_partition", (0, 0), {"axis": "x"})], dict(k=2, r=4, q=5, x=7, d=3), dict(g_q=4, s_x=4)),
    ("mqa", [("group_partition", (), {"axis": "q"}), ("stream_partition", (0,), {"axis": "x"})],
     dict(h=4, q=5, x=7, d=3), dict(g_q=4, s_x=4)),
    ("logsumexp", [("stream_partition", (), {"axis": "v"})], dict(n=3, v=11), dict(s_v=4)),
    ("cross_entropy", [("group_partition", (), {"axis": "n"}), ("stream_partition", (0,), {"axis": "v"})],
     dict(n=5, v=11), dict(g_n=2, s_v=4)),
    ("linear_cross_entropy", [("group_partition", (), {"axis": "n"}),
                              ("stream_partition", (0,), {"axis": "v"})], dict(n=5, v=11, d=3), dict(g_n=2, s_v=4)),
    ("rmsnorm_matmul", [("normalized_contraction", (), {"ops": (6,)}),
                        ("group_partition", (), {"axis": "n"}), ("stream_partition", (0,), {"axis": "d"})],
     dict(n=5, d=11, e=3), dict(g_n=2, s_d=4)),
])
def test_derivations_are_exact(name, steps, sizes, tiles):
    check(name, derive(name, steps), sizes, tiles)


def test_symbolic_tiles_need_values():
    p = derive("attention", FLASH)
    alg = get("attention")
    xs = alg.sample(np.random.default_rng(0), dict(q=3, x=3, d=2))
    with pytest.raises(nk.NapkinError, match="tile size g_q has no value"):
        nk.evaluate(p)(*xs)


@pytest.mark.parametrize("name,rule,path,params,msg", [
    ("softmax", "stream_partition", (), {"axis": "v"},
     "cannot stream softmax_v over v: its output P[n,v] keeps axis v (stream partition needs v reduced"),
    ("attention", "stream_partition", (), {"axis": "q"}, "its output O[q,d] keeps axis q"),
    ("attention", "stream_partition", (), {"axis": "z"}, "no input of the region carries axis z"),
    ("attention", "group_partition", (), {"axis": "x"}, "cannot group x: softmax_x mixes entries along axis x"),
    ("attention", "group_partition", (), {"axis": "d"}, "cannot group d: QK^T is not woven over d"),
    ("rmsnorm_matmul", "stream_partition", (), {"axis": "d"}, "depends on a reduction over d"),
    ("attention", "head_grouping", (), {"axis": "q"}, "no query-head axis is broadcast"),
    ("attention", "group_partition", (), {}, "needs a parameter axis"),
    ("attention", "group_partition", (), {"axis": "q", "size": "2.5"},
     "group_partition size must be a positive integer or a tile name such as g_q, got '2.5'"),
    ("attention", "group_partition", (), {"axis": "q", "size": 0}, "got 0"),
    ("attention", "group_partition", (), {"axis": "q", "size": True}, "got True"),
    ("attention", "stream_partition", (), {"axis": "x", "chunk": -4}, "stream_partition chunk must"),
])
def test_rules_say_why_they_do_not_apply(name, rule, path, params, msg):
    p = get(name).diagram()
    with pytest.raises(RuleError) as e:
        RULES[rule].apply(p, whole(p, path), params)
    assert msg in str(e.value)


def test_softmax_alone_inside_a_group_is_still_not_streamable():
    p = derive("attention", [("group_partition", (), {"axis": "q"})])
    body = body_at(p, (0,))
    ops = op_order(to_graph(body))
    # only QK^T, scale and softmax: the softmax output leaves the region
    with pytest.raises(RuleError, match="keeps axis x"):
        stream.apply(p, Site((0,), tuple(range(len(ops) - 1))), {"axis": "x"})


def test_sites_are_checked():
    p = get("attention").diagram()
    with pytest.raises(RuleError, match="site names op #9"):
        group.apply(p, Site((), (0, 9)), {"axis": "q"})
    with pytest.raises(RuleError, match="not a group"):
        stream.apply(p, Site((0,), (0,)), {"axis": "x"})
    with pytest.raises(RuleError, match="not convex"):
        # QK^T and softmax without the scale between them
        group.apply(p, Site((), (0, 2)), {"axis": "q"})


def test_relabel_level_moves_down_only():
    p = derive("attention", [("group_partition", (), {"axis": "q"})])
    lower = RULES["relabel_level"].apply(p, Site((), (0,)), {"level": "registers"})
    (g,) = [b for b in lower.boxes if getattr(b, "data", None) is not None]
    assert g.data.level == "registers"
    with pytest.raises(RuleError, match="not below"):
        RULES["relabel_level"].apply(lower, Site((), (0,)), {"level": "smem"})


def test_groups_nest_down_the_hierarchy_and_regroups_get_their_own_tile():
    """A regroup of an axis must sit at a higher level than the group it wraps, and
    with a tile size of its own (otherwise group → relabel → group never ends)."""
    p = derive("attention", [("group_partition", (), {"axis": "q"})])
    with pytest.raises(RuleError, match="already groups q at smem"):
        group.apply(p, whole(p), {"axis": "q", "level": "smem"})
    lower = RULES["relabel_level"].apply(p, Site((), (0,)), {"level": "registers"})
    outer = group.apply(lower, whole(lower), {"axis": "q"})  # smem above registers: allowed
    (g,) = [b for b in outer.boxes if getattr(b, "data", None) is not None]
    (inner,) = [b for b in g.data.body.boxes if getattr(b, "data", None) is not None]
    assert str(g.data.size) == "g_q_smem" and str(inner.data.size) == "g_q"
    check("attention", outer, dict(q=7, x=5, d=3), dict(g_q_smem=4, g_q=2))
    with pytest.raises(RuleError, match="regroup only at a higher level"):
        RULES["relabel_level"].apply(outer, Site((), (0,)), {"level": "registers"})
    with pytest.raises(RuleError, match="nest down the memory hierarchy"):
        group.apply(p, whole(p), {"axis": "q", "level": "registers"})


def test_candidates_that_check_preserve_meaning():
    p = get("attention").diagram()
    proposals = list(group.candidates(p)) + list(stream.candidates(p))
    applied = 0
    for site, params in proposals:
        for r in (group, stream):
            if _applies(r, p, site, params):
                new = r.apply(p, site, params)
                tiles = {f"{k}_{params['axis']}": 2 for k in ("g", "s")}
                check("attention", new, dict(q=5, x=6, d=3), tiles)
                applied += 1
    assert applied >= 3  # group q (whole), group x/d (sub-regions), ...


def _applies(rule, p, site, params):
    try:
        rule.check(p, site, params)
        return True
    except RuleError:
        return False


def test_streamability_rules_have_proofs_named():
    for r in [*RULES.values(), *STREAMABILITY]:
        assert r.proof.startswith("proofs.") and r.summary


def test_a_softmax_whose_output_is_not_contracted_says_why_it_cannot_stream():
    """Σ_v softmax(X)[n, v] reduces v, but by a sum, not a contraction: the premise fails with
    one line that names the axis and the condition that would let it stream."""
    from napkin import ops
    n, v = nk.axes("n v")
    p = nk.trace(lambda X: ops.sum_(ops.softmax(X, v), v), {"X": (n, v)}, "softmax_sum")
    with pytest.raises(RuleError) as e:
        stream.apply(p, whole(p), {"axis": "v"})
    assert str(e.value).startswith("cannot stream over v: ")
    assert str(e.value).endswith("(softmax over an axis streams only when its output is "
                                 "contracted over that axis)")
    assert "\n" not in str(e.value)


def test_two_reductions_over_one_input_stream_as_one_loop():
    """SwiGLU's gate and up projections read the same normed rows: besides a stream per
    reduction, stream_partition offers both at once — one loop over the shared input's
    chunks carrying two accumulators, the expert's dual-GEMM kernel with the norm as its
    prologue — and the program is the algorithm (float64, ragged sizes) and runs as one
    kernel in interpret mode."""
    import jax
    import jax.numpy as jnp
    from napkin.lower import lower
    from napkin.search.engine import apply_move, eager_moves, moves
    from proofs._core import numeric, sample

    def gate_up(x, g, w1, w3):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g
        return jax.nn.silu(h @ w1) * (h @ w3)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    D = nk.from_jax(gate_up, f32(13, 10), f32(10), f32(10, 7), f32(10, 7),
                    axes=["t e", "e", "e f", "e f"])
    P, _ = eager_moves(D)

    def move(prog, rule, axis, n_ops=None):
        return apply_move(prog, next(m for m in moves(prog) if m.rule == rule
                                     and dict(m.params).get("axis") == axis
                                     and (n_ops is None or len(m.site.ops) == n_ops)))
    P = move(P, "group_partition", "t")
    stream_sites = [m.site.ops for m in moves(P) if m.rule == "stream_partition"]
    both = max(stream_sites, key=len)
    assert len(both) == 6 and sorted(map(len, stream_sites)) == [2, 3, 3, 6]
    P = move(move(P, "stream_partition", "e", 2), "stream_partition", "e", 6)
    streams = [b for b in body_at(P, (0,)).boxes if getattr(b, "data", None) is not None
               and b.data.kind == "stream"]
    assert len(streams) == 2 and streams[1].data.n_state == 2  # gate's and up's sums
    # registers: the two accumulators, and not again the outputs the finalize writes over
    # them (a stream's landed output is live from the next step on)
    from napkin.cost import cost
    from napkin.hardware import get_hardware
    (k,) = cost(P, get_hardware("h100").two_level(), "bf16").kernels
    for regs in k.registers:
        sym = {str(s): s for s in regs.free_symbols}
        if "f" in sym:
            assert sympy.expand(regs).coeff(sym["f"] * sym["g_t"]) == 2, regs
    sizes = {"t": 13, "e": 10, "f": 7}
    xs = sample(D, sizes, np.random.default_rng(7))
    for tiles in ({"g_t": 4, "s_e": 3}, {"g_t": 13, "s_e": 4}):
        numeric(D, P, xs, sizes_rhs=tiles, tol=1e-12)
    kernel = lower(P, {"g_t": 4, "s_e": 4}, name="gate_up")  # ragged: 13 rows, 10 = 4+4+2
    got = np.asarray(kernel(*[np.asarray(x, np.float32) for x in xs], interpret=True))
    with jax.enable_x64(True):
        want = np.asarray(gate_up(*[np.asarray(x, np.float64) for x in xs]))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_every_reduction_reading_one_input_streams_as_one_loop():
    """Q, K and V projections of one x (beside a box that does not read it): besides each
    GEMM's own stream and each pair, all three at once — one pass over x's chunks with three
    accumulators — float64-exact at ragged sizes."""
    from napkin import ops
    from proofs._core import numeric, sample
    t, e, d = nk.axes("t e d")

    def qkv(X, Wq, Wk, Wv, B):
        return (*(ops.contract(X, W, out=(t, d)) for W in (Wq, Wk, Wv)), ops.tanh(B))
    D = nk.trace(qkv, {"X": (t, e), "Wq": (e, d), "Wk": (e, d), "Wv": (e, d), "B": (t, d)},
                 "qkv")
    sites = [site.ops for site, params in RULES["stream_partition"].candidates(D)
             if params["axis"] == "e"]
    assert sorted(map(len, sites)) == [1, 1, 1, 2, 2, 2, 3, 4]
    (three,) = [site for site in sites if len(site) == 3]
    P = RULES["stream_partition"].apply(D, Site((), three), {"axis": "e"})
    (stream,) = [b for b in P.boxes if getattr(getattr(b, "data", None), "kind", "") == "stream"]
    assert stream.data.n_state == 3
    sizes = {"t": 7, "e": 11, "d": 5}
    numeric(D, P, sample(D, sizes, np.random.default_rng(2)), sizes_rhs={"s_e": 4}, tol=1e-12)
