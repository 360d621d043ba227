"""Pattern matching and rewriting on the networkx view (napkin.match)."""
import time

import jax
import networkx as nx
import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_ir_roundtrip import random_inputs, random_programs

from napkin import ops
from napkin.arrays import ArrayType, array_types, axes
from napkin.errors import NapkinError, RuleError
from napkin.ir import ops as op_nodes
from napkin.ir import GraphBuilder, to_diagram, to_graph
from napkin.match import (Pattern, explain_no_match, find_matches, instantiate, replace,
                          rewrite, rewrite_all)
from napkin.semantics import evaluate
from napkin.primitives import Contract, Map, Reduce, Softmax, Zip
from napkin.trace import Builder, algorithm

jax.config.update("jax_enable_x64", True)

q, x, d, h, k, e = axes("q x d h k e")


# --------------------------------------------------------------------------- diagrams
@algorithm(Q=(q, d), K=(x, d), V=(x, d), dtype="f64")
def attention(Q, K, V):
    S = ops.contract(Q, K, out=[q, x], as_="S")
    P = ops.softmax(S, x, as_="P")
    return ops.contract(P, V, out=[q, d], as_="O")


@algorithm(Q=(h, q, d), K=(h, k, d), V=(h, k, d), dtype="f64")
def mha(Q, K, V):
    S = ops.contract(Q, K, out=[h, q, k], as_="S")
    P = ops.softmax(S, k, as_="P")
    return ops.contract(P, V, out=[h, q, d], as_="O")


@algorithm(Q=(h, q, d), K=(h, x, d), V=(h, x, d), dtype="f64")
def mha_x(Q, K, V):  # heads woven, same axis names as the pattern
    S = ops.contract(Q, K, out=[h, q, x], as_="S")
    P = ops.softmax(S, x, as_="P")
    return ops.contract(P, V, out=[q, h, d], as_="O")  # output axes in another order


@algorithm(S=(q, x), V=(x, d), dtype="f64")
def softmax_contract(S, V):
    return ops.contract(ops.softmax(S, x), V, out=[q, d])


@algorithm(S=(q, x), V=(x, d), dtype="f64")
def safe_softmax_contract(S, V):
    m = ops.max_(S, x)
    p = ops.exp(S - m)
    return ops.contract(p, V, out=[q, d]) / ops.sum_(p, x)


@algorithm(S=(q, x), dtype="f64")
def softmax_only(S):
    return ops.softmax(S, x)


@algorithm(S=(q, x), dtype="f64")
def softmax_by_logsumexp(S):
    return ops.exp(S - ops.logsumexp(S, x))


@algorithm(S=(q, x), dtype="f64")
def unnormalised_softmax(S):  # wrong on purpose: forgets to normalise
    return ops.exp(S - ops.max_(S, x))


def inputs_for(diagram, seed=0, sizes=None):
    sizes = {"q": 3, "x": 5, "d": 4, "h": 2, "k": 5, "e": 4, **(sizes or {})}
    rng = np.random.default_rng(seed)
    return [rng.normal(size=tuple(sizes[a.name] for a in t.axes)) for t in array_types(diagram.dom)]


def same_meaning(d1, d2, seed=0):
    xs = inputs_for(d1, seed)
    a, b = evaluate(d1)(*xs), evaluate(d2)(*xs)
    a, b = (a,) if not isinstance(a, tuple) else a, (b,) if not isinstance(b, tuple) else b
    return all(np.shape(u) == np.shape(v) and np.allclose(u, v, rtol=1e-9, atol=1e-12)
               for u, v in zip(a, b))


def names(match):
    g = match.host
    return sorted(g.nodes[n]["box"].name for n in match.ops)


# --------------------------------------------------------------------------- matching
def test_softmax_contraction_inside_attention():
    (m,) = find_matches(softmax_contract, attention)
    assert names(m) == ["contract->qd", "softmax_x"]
    g = m.host
    assert [g.nodes[v]["ob"].name for v in m.inputs] == ["S", "V"]
    assert [g.nodes[v]["ob"].name for v in m.outputs] == ["O"]
    assert [g.nodes[v]["ob"].name for v in m.interior] == ["P"]
    assert m.axis_binding == {"q": "q", "x": "x", "d": "d"}
    assert m.extra_axes == ()
    assert explain_no_match(softmax_contract, attention) is None


def test_multi_head_attention_extra_head_axis():
    (m,) = find_matches(softmax_contract, mha_x)
    assert names(m) == ["contract->qhd", "softmax_x"]
    assert m.extra_axes == ("h",)
    # ... but not when extra axes are forbidden
    assert find_matches(softmax_contract, mha_x, extra_axes=False) == []
    assert "extra axes" in explain_no_match(softmax_contract, mha_x, extra_axes=False)


def test_renamed_axes():
    assert find_matches(softmax_contract, mha) == []
    why = explain_no_match(softmax_contract, mha)
    assert "axis x" in why and "S[h,q,k]" in why
    (m,) = find_matches(softmax_contract, mha, rename_axes=True)
    assert m.axis_binding == {"q": "q", "x": "k", "d": "d"}
    assert m.extra_axes == ("h",)


def test_renaming_is_consistent_and_swaps_names():
    # Host over (x, q) with the roles of the pattern's q and x exchanged.
    @algorithm(S=(x, q), V=(q, d), dtype="f64")
    def swapped(S, V):
        return ops.contract(ops.softmax(S, q), V, out=[x, d])

    (m,) = find_matches(softmax_contract, swapped, rename_axes=True)
    assert m.axis_binding == {"q": "x", "x": "q", "d": "d"}
    assert find_matches(softmax_contract, swapped) == []

    # Softmax over the wrong axis: no binding can make both the softmax axis and
    # the contracted axis agree.
    @algorithm(S=(q, x), V=(x, d), dtype="f64")
    def wrong_axis(S, V):
        return ops.contract(ops.softmax(S, q), V, out=[q, d])

    assert find_matches(softmax_contract, wrong_axis, rename_axes=True) == []
    assert explain_no_match(softmax_contract, wrong_axis, rename_axes=True)


def test_symbolic_sizes_in_parameters_rename():
    @algorithm(S=(q, x), dtype="f64")
    def scaled_pat(S):
        return ops.softmax(ops.scale(S, 1 / sympy.sqrt(x.size)), x)

    @algorithm(S=(q, k), dtype="f64")
    def host(S):
        return ops.softmax(ops.scale(S, 1 / sympy.sqrt(k.size)), k)

    @algorithm(S=(q, k), dtype="f64")
    def other_scale(S):
        return ops.softmax(ops.scale(S, 1 / sympy.sqrt(q.size)), k)

    (m,) = find_matches(scaled_pat, host, rename_axes=True)
    assert m.size_binding == {q.size: q.size, x.size: k.size}
    assert find_matches(scaled_pat, other_scale, rename_axes=True) == []
    assert "scale" in explain_no_match(scaled_pat, other_scale, rename_axes=True)


def test_concrete_sizes_must_agree():
    x4, x8 = axes("x", {"x": 4})[0], axes("x", {"x": 8})[0]

    @algorithm(S=(q, x4), dtype="f64")
    def pat4(S):
        return ops.softmax(S, x4)

    @algorithm(S=(q, x8), dtype="f64")
    def host8(S):
        return ops.softmax(S, x8)

    @algorithm(S=(q, x), dtype="f64")
    def symbolic(S):
        return ops.softmax(S, x)

    assert find_matches(pat4, host8) == []
    assert "has size 4" in explain_no_match(pat4, host8)
    (m,) = find_matches(symbolic, host8)  # a symbolic size binds any size
    assert m.size_binding[x.size] == 8


def test_extra_axis_must_be_woven_not_reduced():
    @algorithm(P=(h, q, x), V=(h, x, d), dtype="f64")
    def sums_heads(P, V):
        return ops.contract(ops.softmax(P, x), V, out=[q, d])  # also sums over h

    assert find_matches(softmax_contract, sums_heads) == []
    assert "extra axis h" in explain_no_match(softmax_contract, sums_heads)


def test_interior_wire_escapes():
    @algorithm(Q=(q, d), K=(x, d), V=(x, d), dtype="f64")
    def leaky(Q, K, V):
        S = ops.contract(Q, K, out=[q, x], as_="S")
        P = ops.softmax(S, x, as_="P")
        return ops.contract(P, V, out=[q, d], as_="O"), ops.sum_(P, x, as_="total")

    rejected = []
    assert find_matches(softmax_contract, leaky, rejected=rejected) == []
    assert len(rejected) == 1 and "also used by sum_x" in rejected[0][1]
    why = explain_no_match(softmax_contract, leaky)
    assert why == ("matched softmax_x, contract->qd but the output P of softmax_x is also "
                   "used by sum_x outside the pattern")
    with pytest.raises(RuleError, match="also used by sum_x"):
        rewrite(leaky, softmax_contract, safe_softmax_contract)

    # An interior value that is an output of the host escapes too.
    @algorithm(Q=(q, d), K=(x, d), V=(x, d), dtype="f64")
    def shows_p(Q, K, V):
        P = ops.softmax(ops.contract(Q, K, out=[q, x]), x, as_="P")
        return ops.contract(P, V, out=[q, d]), P

    assert find_matches(softmax_contract, shows_p) == []
    assert "output of the host" in explain_no_match(softmax_contract, shows_p)


def test_non_convex_match_rejected():
    @algorithm(X=(q, d), W=(q, d), dtype="f64")
    def pattern(X, W):
        y = ops.exp(X)
        return y, ops.mul(y, W)

    @algorithm(X=(q, d), dtype="f64")
    def host(X):
        y = ops.exp(X, as_="y")
        w = ops.neg(y, as_="w")  # leaves the pattern at y, re-enters at mul
        return ops.mul(y, w, as_="z")

    assert find_matches(pattern, host) == []
    why = explain_no_match(pattern, host)
    assert "exp → neg → mul" in why and "cycle" in why

    @algorithm(X=(q, d), W=(q, d), dtype="f64")
    def convex_host(X, W):
        y = ops.exp(X, as_="y")
        return ops.mul(y, ops.neg(W), as_="z")

    (m,) = find_matches(pattern, convex_host)
    assert names(m) == ["exp", "mul"]


def test_port_order():
    @algorithm(X=(q, d), Y=(q, d), dtype="f64")
    def pattern(X, Y):
        return ops.sub(ops.exp(X), Y)

    @algorithm(X=(q, d), Y=(q, d), dtype="f64")
    def same_order(X, Y):
        return ops.sub(ops.exp(X, as_="e"), Y, as_="s")

    @algorithm(X=(q, d), Y=(q, d), dtype="f64")
    def other_order(X, Y):
        return ops.sub(Y, ops.exp(X, as_="e"), as_="s")

    assert len(find_matches(pattern, same_order)) == 1
    assert find_matches(pattern, other_order) == []
    assert "another order" in explain_no_match(pattern, other_order)

    # sub(a, b) against sub(b, a) with both operands inputs: the binding follows the ports.
    @algorithm(A=(q, d), B=(q, d), dtype="f64")
    def sub_ab(A, B):
        return ops.sub(A, B)

    (m,) = find_matches(sub_ab, other_order)
    g = m.host
    assert [g.nodes[v]["ob"].name for v in m.inputs] == ["Y", "e"]


def test_commutative_zip_either_order_and_dedup():
    @algorithm(X=(q, d), Y=(q, d), dtype="f64")
    def pattern(X, Y):
        return ops.add(ops.exp(X), Y)

    @algorithm(X=(q, d), Y=(q, d), dtype="f64")
    def swapped(X, Y):
        return ops.add(Y, ops.exp(X))

    assert len(find_matches(pattern, swapped)) == 1

    @algorithm(A=(q, d), B=(q, d), dtype="f64")
    def add_ab(A, B):
        return ops.add(A, B)

    # Two mappings (A->X, B->Y and A->Y, B->X), one set of ops: one match.
    assert len(find_matches(add_ab, swapped)) == 1


def test_custom_node_predicate_any_map():
    @algorithm(S=(q, x), dtype="f64")
    def map_then_sum(S):
        return ops.sum_(ops.exp(S), x)

    @algorithm(S=(q, x), dtype="f64")
    def host(S):
        return ops.sum_(ops.tanh(S), x), ops.sum_(ops.exp(S), x)

    assert len(find_matches(map_then_sum, host)) == 1
    any_map = Pattern(map_then_sum, node_match=lambda p, hb: p.data.kind == hb.data.kind)
    assert len(find_matches(any_map, host)) == 2


def test_no_such_op_explained():
    @algorithm(S=(q, x), dtype="f64")
    def host(S):
        return ops.exp(S)

    assert explain_no_match(softmax_only, host) == "no host op matches the pattern's softmax_x"


def test_pattern_validation():
    @algorithm(A=(q, d), B=(q, d), dtype="f64")
    def unused_input(A, B):
        return ops.exp(A)

    @algorithm(A=(q, d), dtype="f64")
    def identity(A):
        return A

    with pytest.raises(NapkinError, match="unused"):
        Pattern(unused_input)
    with pytest.raises(NapkinError, match="at least one op"):
        Pattern(identity)


def test_many_matches_fast():
    # A host of 550 ops, built straight as a graph (emitting the diagram is not timed here).
    b = Builder("deep")
    Q, K, V = (b.input(n, ArrayType(t)) for n, t in (("Q", (q, d)), ("K", (x, d)), ("V", (x, d))))

    def op(spec, *args):
        return b.apply(spec, list(args))[0]

    for _ in range(50):
        S = op(Map("scale", 0.5), op(Contract(("q", "x")), Q, K))
        O = op(Map("tanh"), op(Contract(("q", "d")), op(Softmax("x"), S), V))
        s = op(Reduce("sum", "x"), op(Map("exp"), S))
        Q = op(Zip("mul"), op(Zip("add"), Q, O), op(Map("sigmoid"), s))
    g = b.gb.finish([Q.node])
    assert len(op_nodes(g)) >= 500
    for pattern in (Pattern(softmax_contract), Pattern(softmax_contract, rename_axes=True)):
        t = time.perf_counter()
        found = find_matches(pattern, g)
        assert time.perf_counter() - t < 1.0
        assert len(found) == 50


# --------------------------------------------------------------------------- replacing
def test_replace_softmax_by_logsumexp_form_keeps_meaning():
    m = find_matches(softmax_only, attention)[0]
    g = replace(to_graph(attention), m, softmax_by_logsumexp)
    new = to_diagram(g)
    assert new.dom == attention.dom and new.cod == attention.cod
    assert "softmax_x" not in [b.name for b in new.boxes]
    assert "logsumexp_x" in [b.name for b in new.boxes]
    assert same_meaning(attention, new)
    # the diagram-level shortcut gives the same
    assert same_meaning(attention, rewrite(attention, softmax_only, softmax_by_logsumexp))


def test_replace_that_changes_meaning_is_detected():
    new = rewrite(attention, softmax_only, unnormalised_softmax)
    assert new.dom == attention.dom and new.cod == attention.cod
    assert not same_meaning(attention, new)


def test_rewrite_in_multi_head_with_renaming_retypes_replacement():
    p = Pattern(softmax_contract, rename_axes=True)
    new = rewrite(mha, p, safe_softmax_contract)
    assert new.dom == mha.dom and new.cod == mha.cod
    assert {"max_k", "sum_k", "contract->hqd"} <= {b.name for b in new.boxes}
    assert same_meaning(mha, new)


def test_rewrite_transposes_to_host_output_order():
    # mha_x's output is [q,h,d]; the retyped replacement computes [h,q,d].
    new = rewrite(mha_x, softmax_contract, safe_softmax_contract)
    assert new.cod == mha_x.cod
    assert "transpose" in [b.name for b in new.boxes]
    assert same_meaning(mha_x, new)


def test_replacement_output_is_an_input():
    @algorithm(A=(q, d), dtype="f64")
    def double_neg(A):
        return ops.neg(ops.neg(A))

    @algorithm(A=(q, d), dtype="f64")
    def ident(A):
        return A

    @algorithm(X=(q, d), dtype="f64")
    def host(X):
        y = ops.neg(ops.neg(ops.tanh(X)))
        return ops.exp(y), y

    new = rewrite(host, double_neg, ident)
    assert [b.name for b in new.boxes if hasattr(b, "spec")] == ["tanh", "exp"]
    assert same_meaning(host, new)


def test_rewrite_all_sites():
    @algorithm(Q=(q, d), K=(x, d), V=(x, d), dtype="f64")
    def two_layers(Q, K, V):
        for _ in range(2):
            Q = ops.contract(ops.softmax(ops.contract(Q, K, out=[q, x]), x), V, out=[q, d])
        return Q

    new, n = rewrite_all(two_layers, softmax_only, softmax_by_logsumexp)
    assert n == 2
    assert not any(b.name == "softmax_x" for b in new.boxes)
    assert same_meaning(two_layers, new)
    with pytest.raises(RuleError, match="still matches"):
        rewrite_all(two_layers, softmax_only, softmax_only, max_steps=3)


def test_replace_without_retype_checks_types():
    host = to_graph(mha)
    m = find_matches(Pattern(softmax_contract, rename_axes=True), host)[0]
    with pytest.raises(RuleError, match="replacement input 0"):
        replace(host, m, safe_softmax_contract, retype=False)
    # Built directly on the host's types, it goes in as is.
    ready = instantiate(safe_softmax_contract, [host.nodes[v]["ob"].type for v in m.inputs],
                        m.axis_binding, m.size_binding)
    assert same_meaning(mha, to_diagram(replace(host, m, ready, retype=False)))


def test_replacement_arity_checked():
    m = find_matches(softmax_only, attention)[0]
    with pytest.raises(RuleError, match="inputs"):
        replace(to_graph(attention), m, softmax_contract)


# --------------------------------------------------------------------------- random sites
def _extract(host, site):
    """The sub-graph of ``host`` on the op nodes ``site``, as a pattern graph:
    inputs are the values it reads from outside, outputs the values it
    produces that are used outside or are host outputs."""
    b = GraphBuilder()
    env = {}
    produced = {v for o in site for v in host.nodes[o]["outs"]}
    order = [o for o in op_nodes(host) if o in site]
    for o in order:
        for v in host.nodes[o]["ins"]:
            if v not in produced and v not in env:
                env[v] = b.input(host.nodes[v]["ob"])
    for o in order:
        node = host.nodes[o]
        env.update(zip(node["outs"], b.op(node["box"], [env[v] for v in node["ins"]])))
    host_outputs = set(host.graph["outputs"])
    outs = [v for o in order for v in host.nodes[o]["outs"]
            if v in host_outputs or any(c not in site for c in host.successors(v))]
    return b.finish([env[v] for v in outs])


def _convex(host, site):
    closure = set()
    for o in site:
        closure |= nx.descendants(host, o) & {a for s in site for a in nx.ancestors(host, s)}
    return all(host.nodes[n]["kind"] == "value" or n in site for n in closure)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(max_ops=6), st.data())
def test_random_sites_match_and_identity_rewrite(program, data):
    b, outputs = program
    host = b.gb.finish([o.node for o in outputs])
    edges = [(o1, o2) for o1 in op_nodes(host) for v in host.nodes[o1]["outs"]
             for o2 in host.successors(v)]
    assume(edges)
    site = set(data.draw(st.sampled_from(edges)))
    pattern = Pattern(_extract(host, site))
    found = [m for m in find_matches(pattern, host) if m.ops == site]
    if not _convex(host, site):
        assert not found
        return
    assert len(found) == 1
    new = replace(host, found[0], pattern.graph)
    assert len(op_nodes(new)) == len(op_nodes(host))
    d, d2 = to_diagram(host), to_diagram(new)
    assert d2.dom == d.dom and d2.cod == d.cod
    xs = random_inputs(d, 5)
    a, c = evaluate(d)(*xs), evaluate(d2)(*xs)
    a, c = (a, c) if isinstance(a, tuple) else ((a,), (c,))
    for u, v in zip(a, c):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-12, atol=1e-12)
