"""Canonical identity of a program: the same boxes on the same wires, whatever order
the emitter wrote independent boxes in.

A diagram's fingerprint (napkin.certify.certificate) renders its layers in order, which is
what a certificate must pin down; but two chains of rewrites can emit one program
with independent boxes in different orders.  For deduplicating a search's states
the identity is the program's graph up to isomorphism:

* :func:`canonical_hash` — hash-consing: every value is named by a hash of what
  computes it (its box's spec, the names of the box's inputs in port order, its
  output port), inputs by their position; the program's hash covers the multiset of
  its boxes and the names of its outputs.  Nested bodies enter a group's or a
  stream's spec by their own canonical hash.  For these port-ordered graphs this is
  a canonical form: equal hashes mean isomorphic programs (up to sha256 collisions).
* :func:`same_program` — the isomorphism check behind the hash, by networkx's VF2
  matcher on the same labels: what the search runs when two programs share a hash
  but not a fingerprint, so a collision could never merge two programs.
"""
from __future__ import annotations

import dataclasses
import hashlib

import networkx as nx
from networkx.algorithms.isomorphism import DiGraphMatcher

from napkin.certify.certificate import is_diagram, render_value
from napkin.core.ir import ops as op_order, view
from napkin.core.memo import IdentityMemo

_GRAPHS, _HASHES, _LABELS, _SAME = (IdentityMemo(20000), IdentityMemo(20000),
                                    IdentityMemo(), IdentityMemo())


def _spec_label(spec) -> str:
    return _LABELS.get((spec,), lambda: _spec_label_uncached(spec))


def _spec_label_uncached(spec) -> str:
    fields = []
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        text = f"#{canonical_hash(value)}" if is_diagram(value) else render_value(value)
        fields.append(f"{f.name}={text}")
    return f"{spec.kind}(" + ",".join(fields) + ")"


def labelled_graph(diagram) -> nx.DiGraph:
    """The program as a graph whose labels say everything but the emission order."""
    return _GRAPHS.get((diagram,), lambda: _labelled_graph(diagram))


def _labelled_graph(diagram) -> nx.DiGraph:
    g = view(diagram)
    out = nx.DiGraph()
    ends: dict = {}
    for i, v in enumerate(g.graph["inputs"]):
        ends.setdefault(v, []).append(f"in{i}")
    for j, v in enumerate(g.graph["outputs"]):
        ends.setdefault(v, []).append(f"out{j}")
    for n, data in g.nodes(data=True):
        if data["kind"] == "value":
            out.add_node(n, label=render_value(data["ob"].type) + ",".join(ends.get(n, [])),
                         spec=None)
        else:
            spec = data["box"].spec
            out.add_node(n, label=_spec_label(spec), spec=spec)
            for port, v in enumerate(data["ins"]):
                # a value read twice by one box: both ports on one edge
                old = out.edges[v, n]["port"] + "," if out.has_edge(v, n) else ""
                out.add_edge(v, n, port=f"{old}i{port}")
            for port, v in enumerate(data["outs"]):
                out.add_edge(n, v, port=f"o{port}")
    return out


def canonical_hash(diagram) -> str:
    """The hash-consed name of the program (memoised per diagram object)."""
    return _HASHES.get((diagram,), lambda: _canonical_hash(diagram))


def _canonical_hash(diagram) -> str:
    g = view(diagram)
    name = {v: _sha(f"in{i}:{render_value(g.nodes[v]['ob'].type)}")
            for i, v in enumerate(g.graph["inputs"])}
    boxes = []
    for n in op_order(g):  # any topological order gives the same names
        node = g.nodes[n]
        h = _sha(_spec_label(node["box"].spec) + "(" + ",".join(name[v] for v in node["ins"]) + ")")
        boxes.append(h)
        for k, v in enumerate(node["outs"]):
            name[v] = _sha(f"{h}.{k}:{render_value(g.nodes[v]['ob'].type)}")
    return _sha("|".join(sorted(boxes)) + "->" + ",".join(name[v] for v in g.graph["outputs"]))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def same_program(a, b) -> bool:
    """True when ``a`` and ``b`` are one program up to the order of independent boxes."""
    return a is b or _SAME.get((a, b), lambda: _isomorphic(a, b))


def _isomorphic(a, b) -> bool:
    ga, gb = labelled_graph(a), labelled_graph(b)
    if ga.number_of_nodes() != gb.number_of_nodes() or canonical_hash(a) != canonical_hash(b):
        return False

    def nodes_match(x, y):
        if x["label"] != y["label"]:
            return False
        if x["spec"] is None:
            return True
        return all(same_program(p, q) for p, q in zip(getattr(x["spec"], "bodies", ()),
                                                      getattr(y["spec"], "bodies", ())))

    return DiGraphMatcher(ga, gb, node_match=nodes_match,
                          edge_match=lambda x, y: x["port"] == y["port"]).is_isomorphic()
