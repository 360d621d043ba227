"""Canonical identity of a program: the same boxes on the same wires, whatever order
the emitter wrote independent boxes in.

A diagram's fingerprint (napkin.certificate) renders its layers in order, which is
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

from napkin.certificate import render_value
from napkin.ir import ops as op_order, view

_GRAPHS: dict = {}   # id(diagram) -> (diagram, labelled graph)
_HASHES: dict = {}   # id(diagram) -> (diagram, hash)


def _is_diagram(value) -> bool:
    return hasattr(value, "boxes") and hasattr(value, "dom") and hasattr(value, "cod")


def _nested(spec) -> list:
    return [getattr(spec, f.name) for f in dataclasses.fields(spec)
            if _is_diagram(getattr(spec, f.name))]


_LABELS: dict = {}   # id(spec) -> (spec, label)


def _spec_label(spec) -> str:
    hit = _LABELS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    label = _spec_label_uncached(spec)
    if len(_LABELS) > 50000:
        _LABELS.clear()
    _LABELS[id(spec)] = (spec, label)
    return label


def _spec_label_uncached(spec) -> str:
    fields = []
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        text = f"#{canonical_hash(value)}" if _is_diagram(value) else render_value(value)
        fields.append(f"{f.name}={text}")
    return f"{spec.kind}(" + ",".join(fields) + ")"


def labelled_graph(diagram) -> nx.DiGraph:
    """The program as a graph whose labels say everything but the emission order."""
    hit = _GRAPHS.get(id(diagram))
    if hit is not None and hit[0] is diagram:
        return hit[1]
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
            spec = data["box"].data
            out.add_node(n, label=_spec_label(spec), spec=spec)
            for port, v in enumerate(data["ins"]):
                # a value read twice by one box: both ports on one edge
                old = out.edges[v, n]["port"] + "," if out.has_edge(v, n) else ""
                out.add_edge(v, n, port=f"{old}i{port}")
            for port, v in enumerate(data["outs"]):
                out.add_edge(n, v, port=f"o{port}")
    if len(_GRAPHS) > 20000:
        _GRAPHS.clear()
    _GRAPHS[id(diagram)] = (diagram, out)  # holding the diagram keeps its id unique
    return out


def canonical_hash(diagram) -> str:
    """The hash-consed name of the program (memoised per diagram object)."""
    hit = _HASHES.get(id(diagram))
    if hit is not None and hit[0] is diagram:
        return hit[1]
    g = view(diagram)
    name = {v: _sha(f"in{i}:{render_value(g.nodes[v]['ob'].type)}")
            for i, v in enumerate(g.graph["inputs"])}
    boxes = []
    for n in op_order(g):  # any topological order gives the same names
        node = g.nodes[n]
        h = _sha(_spec_label(node["box"].data) + "(" + ",".join(name[v] for v in node["ins"]) + ")")
        boxes.append(h)
        for k, v in enumerate(node["outs"]):
            name[v] = _sha(f"{h}.{k}:{render_value(g.nodes[v]['ob'].type)}")
    h = _sha("|".join(sorted(boxes)) + "->" + ",".join(name[v] for v in g.graph["outputs"]))
    if len(_HASHES) > 20000:
        _HASHES.clear()
    _HASHES[id(diagram)] = (diagram, h)
    return h


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_SAME: dict = {}      # (id(a), id(b)) -> (a, b, verdict)


def same_program(a, b) -> bool:
    """True when ``a`` and ``b`` are one program up to the order of independent boxes."""
    if a is b:
        return True
    hit = _SAME.get((id(a), id(b)))
    if hit is not None and hit[0] is a and hit[1] is b:
        return hit[2]
    verdict = _isomorphic(a, b)
    if len(_SAME) > 50000:
        _SAME.clear()
    _SAME[(id(a), id(b))] = (a, b, verdict)
    return verdict


def _isomorphic(a, b) -> bool:
    ga, gb = labelled_graph(a), labelled_graph(b)
    if ga.number_of_nodes() != gb.number_of_nodes() or canonical_hash(a) != canonical_hash(b):
        return False

    def nodes_match(x, y):
        if x["label"] != y["label"]:
            return False
        if x["spec"] is None:
            return True
        return all(same_program(p, q) for p, q in zip(_nested(x["spec"]), _nested(y["spec"])))

    return DiGraphMatcher(ga, gb, node_match=nodes_match,
                          edge_match=lambda x, y: x["port"] == y["port"]).is_isomorphic()
