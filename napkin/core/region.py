"""Sites and regions: where a rule applies, and cutting a region out.

A *site* addresses a set of boxes in a (possibly nested) streamed program:
``path`` descends through group boxes (each entry is the op index of a group in
the enclosing body), ``ops`` are op indices in that body.  Op indices follow
:func:`napkin.core.ir.ops` (a deterministic topological order), so a site written in
a certificate means the same boxes whenever the same program is rebuilt.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import networkx as nx
from discopy import markov

from napkin.core.arrays import ArrayOb
from napkin.core.errors import RuleError
from napkin.core.memo import IdentityMemo
from napkin.core.ir import GraphBuilder, ops as op_order, to_diagram, to_graph, view
from napkin.core.op import make_op


@dataclass(frozen=True)
class Site:
    path: tuple[int, ...] = ()
    ops: tuple[int, ...] = ()

    def to_json(self):
        return {"path": list(self.path), "ops": list(self.ops)}

    @classmethod
    def from_json(cls, data):
        return cls(tuple(int(i) for i in data.get("path", ())), tuple(int(i) for i in data["ops"]))

    def __str__(self):
        where = "".join(f"/group#{i}" for i in self.path) or "/"
        return f"{where} ops {list(self.ops)}"


def body_at(diagram, path):
    """The diagram at ``path`` (descending through group boxes)."""
    d = diagram
    for depth, i in enumerate(path):
        g = view(d)
        order = op_order(g)
        if not 0 <= i < len(order):
            raise RuleError(f"site path step {depth}: no op #{i} (the body has {len(order)})")
        box = g.nodes[order[i]]["box"]
        if getattr(box.spec, "kind", None) != "group":
            raise RuleError(f"site path step {depth}: op #{i} ({box.name}) is not a group")
        d = box.spec.body
    return d


def replace_at(diagram, path, new_body):
    """``diagram`` with the body at ``path`` replaced (groups rebuilt outward)."""
    if not path:
        return new_body
    g = to_graph(diagram)
    order = op_order(g)
    node = g.nodes[order[path[0]]]
    spec = node["box"].spec
    inner = replace_at(spec.body, path[1:], new_body)
    new_spec = dataclasses.replace(spec, body=inner)
    dom = markov.Ty(*(g.nodes[v]["ob"] for v in node["ins"]))
    node["box"] = make_op(new_spec, dom, [ob.name for ob in node["box"].cod.inside], node["box"].name)
    return to_diagram(g)


@dataclass
class Region:
    """A convex set of op nodes of a graph, with its boundary."""
    graph: nx.DiGraph
    nodes: list[int]      # op nodes, topological order
    inputs: list[int]     # values entering, by first use
    outputs: list[int]    # values leaving (used outside or graph outputs)

    def boxes(self):
        return [self.graph.nodes[n]["box"] for n in self.nodes]


def region(graph: nx.DiGraph, op_indices) -> Region:
    order = op_order(graph)
    bad = [i for i in op_indices if not 0 <= i < len(order)]
    if bad:
        raise RuleError(f"site names op #{bad[0]} but the body has ops #0..#{len(order) - 1}")
    if not op_indices:
        raise RuleError("a site needs at least one op")
    chosen = [order[i] for i in sorted(set(op_indices))]
    inside = set(chosen)
    produced = {v for n in chosen for v in graph.nodes[n]["outs"]}
    inputs = []
    for n in chosen:
        for v in graph.nodes[n]["ins"]:
            if v not in produced and v not in inputs:
                inputs.append(v)
    graph_out = set(graph.graph["outputs"])
    outputs = [v for n in chosen for v in graph.nodes[n]["outs"]
               if v in graph_out or any(c not in inside for c in graph.successors(v))]
    # Convexity: nothing outside may sit between two boxes of the region.
    outside_desc = set()
    for v in outputs:
        for c in graph.successors(v):
            if c not in inside:
                outside_desc |= nx.descendants(graph, c) | {c}
    if outside_desc & inside:
        n = next(iter(outside_desc & inside))
        raise RuleError(f"the region is not convex: {graph.nodes[n]['box'].name} depends on a box "
                        f"outside the region that depends on the region")
    return Region(graph, chosen, inputs, outputs)


def region_key(reg: Region) -> tuple[tuple, tuple]:
    """The content of a region as ``(wiring, objects)``: its boxes and input
    objects, to compare by identity (:class:`napkin.core.memo.IdentityMemo`), and how
    the boxes are wired, by position.  Two programs that share the boxes of a
    region (the search reaches one region from many states) give it one key."""
    g = reg.graph
    where = {v: ("in", i) for i, v in enumerate(reg.inputs)}
    wiring, boxes = [], []
    for j, n in enumerate(reg.nodes):
        node = g.nodes[n]
        wiring.append(tuple(where[v] for v in node["ins"]))
        boxes.append(node["box"])
        where.update({v: (j, k) for k, v in enumerate(node["outs"])})
    wiring.append(tuple(where[v] for v in reg.outputs))
    return tuple(wiring), (*boxes, *(g.nodes[v]["ob"] for v in reg.inputs))


def region_diagram(reg: Region, axis: str | None = None, size=None):
    """The region as a diagram of its own; with ``axis``, that axis is
    relabelled to ``size`` on every wire (boxes re-inferred, nested bodies too)."""
    g, b = reg.graph, GraphBuilder()
    env = {v: b.input(_resized(g.nodes[v]["ob"], axis, size)) for v in reg.inputs}
    for n in reg.nodes:
        node = g.nodes[n]
        box = node["box"]
        dom = markov.Ty(*(b.graph.nodes[env[v]]["ob"] for v in node["ins"]))
        spec = box.spec.relabelled(axis, size) if axis else box.spec
        new = make_op(spec, dom, [ob.name for ob in box.cod.inside], box.name)
        for v, w in zip(node["outs"], b.op(new, [env[v] for v in node["ins"]])):
            env[v] = w
    return to_diagram(b.finish([env[v] for v in reg.outputs]))


_RELABELLED = IdentityMemo(20000)


def relabel(diagram, axis: str, size):
    """``diagram`` with ``axis`` relabelled to ``size`` everywhere (q → g_q); memoised (a
    search relabels the same bodies from state after state)."""
    def make():
        g = to_graph(diagram)
        return region_diagram(Region(g, op_order(g), list(g.graph["inputs"]),
                                     list(g.graph["outputs"])), axis, size)
    return _RELABELLED.get((diagram,), make, (axis, size))


def _resized(ob, axis, size):
    if axis and ob.type.has(axis):
        return ArrayOb(ob.name, ob.type.resize(axis, size))
    return ob


def splice(reg: Region, box) -> nx.DiGraph:
    """A copy of the graph with the region replaced by one box (same boundary)."""
    g = reg.graph.copy()
    for n in g.nodes:
        if g.nodes[n]["kind"] == "op":
            g.nodes[n]["ins"] = list(g.nodes[n]["ins"])
    n_new = max(g.nodes) + 1
    interior = {v for n in reg.nodes for v in g.nodes[n]["outs"]} - set(reg.outputs)
    g.remove_nodes_from(reg.nodes)
    g.remove_nodes_from(interior)
    for v, ob in zip(reg.outputs, box.cod.inside):
        g.nodes[v]["ob"] = ob
    g.add_node(n_new, kind="op", box=box, ins=list(reg.inputs), outs=list(reg.outputs))
    for v in reg.inputs:
        g.add_edge(v, n_new)
    for v in reg.outputs:
        g.add_edge(n_new, v)
    return g


def inline(reg: Region, diagram) -> nx.DiGraph:
    """A copy of the graph with the region replaced by the boxes of ``diagram``
    (whose dom/cod match the region's inputs/outputs)."""
    sub = to_graph(diagram)
    if len(sub.graph["inputs"]) != len(reg.inputs) or len(sub.graph["outputs"]) != len(reg.outputs):
        raise RuleError("replacement does not fit the region's boundary")
    g = reg.graph.copy()
    interior = {v for n in reg.nodes for v in g.nodes[n]["outs"]} - set(reg.outputs)
    g.remove_nodes_from(reg.nodes)
    g.remove_nodes_from(interior)
    fresh = iter(range(max(g.nodes) + 1, max(g.nodes) + 2 + sub.number_of_nodes()))
    env = dict(zip(sub.graph["inputs"], reg.inputs))
    env.update(zip(sub.graph["outputs"], reg.outputs))
    if set(sub.graph["inputs"]) & set(sub.graph["outputs"]):
        raise RuleError("replacement passes an input straight through; not supported by inline")
    for v in sub.nodes:
        if sub.nodes[v]["kind"] == "value" and v not in env:
            env[v] = next(fresh)
            g.add_node(env[v], kind="value", ob=sub.nodes[v]["ob"])
    for v, w in zip(sub.graph["outputs"], reg.outputs):
        g.nodes[w]["ob"] = sub.nodes[v]["ob"]
    for n in op_order(sub):
        node = sub.nodes[n]
        m = next(fresh)
        g.add_node(m, kind="op", box=node["box"], ins=[env[v] for v in node["ins"]],
                   outs=[env[v] for v in node["outs"]])
        for v in node["ins"]:
            g.add_edge(env[v], m)
        for v in node["outs"]:
            g.add_edge(m, env[v])
    return g
