"""Canonical identity of programs: equal up to the order of independent boxes, and
nothing more (checked against networkx's isomorphism matcher)."""
import itertools

from networkx.algorithms.isomorphism import DiGraphMatcher

from napkin.search.canonical import canonical_hash, labelled_graph, same_program
from napkin.certify.certificate import fingerprint
from napkin.core.ir import relabel, to_diagram, to_graph
from napkin.frontend.library import get
from napkin.search import search


def reordered(diagram):
    """The same program emitted with independent boxes in the opposite order."""
    g = to_graph(diagram)
    return to_diagram(relabel(g, {n: max(g.nodes) - n for n in g.nodes}))


def test_emission_order_changes_the_fingerprint_not_the_identity():
    d = get("rmsnorm_matmul").diagram()
    r = reordered(d)
    assert fingerprint(r) != fingerprint(d)  # the layers really are in another order
    assert canonical_hash(r) == canonical_hash(d) and same_program(d, r)


def test_different_programs_differ():
    a, c = get("attention").diagram(), get("causal_attention").diagram()
    assert canonical_hash(a) != canonical_hash(c) and not same_program(a, c)
    # operand order is part of the identity: S = Q·Kᵀ is not S = K·Qᵀ
    from napkin import ops
    import napkin as nk
    q, x, d = nk.axes("q x d")
    qk = nk.trace(lambda Q, K: ops.contract(Q, K, out=(q, x)), {"Q": (q, d), "K": (x, d)})
    kq = nk.trace(lambda Q, K: ops.contract(K, Q, out=(q, x)), {"Q": (q, d), "K": (x, d)})
    assert canonical_hash(qk) != canonical_hash(kq)


def test_search_states_are_distinct_programs_and_isomorphic_ones_share_a_state():
    """Every pair of a search's states that networkx's matcher finds isomorphic (the
    labels, nested bodies by identity) would be one state: there is none.  Programs
    with different multisets of labels cannot be isomorphic; the rest are matched."""
    r = search(get("rmsnorm_matmul").diagram(), "h100", dict(n=1024, d=1024, e=1024), "bf16",
               max_states=150)
    programs = [r.graph.nodes[n]["state"].program for n in r.graph.nodes]
    assert len({canonical_hash(p) for p in programs}) == len(programs)
    by_shape = {}
    for p in programs:
        g = labelled_graph(p)
        by_shape.setdefault(tuple(sorted(d["label"] for _, d in g.nodes(data=True))), []).append(g)
    match = lambda ga, gb: DiGraphMatcher(  # noqa: E731
        ga, gb, node_match=lambda x, y: x["label"] == y["label"],
        edge_match=lambda x, y: x["port"] == y["port"]).is_isomorphic()
    for graphs in by_shape.values():
        for ga, gb in itertools.combinations(graphs, 2):
            assert not match(ga, gb)
    assert r.states == len(programs) > 50
    # the same check does see an emission-order variant as the same program
    d = get("rmsnorm_matmul").diagram()
    assert match(labelled_graph(d), labelled_graph(reordered(d)))
