"""Weaving: map a diagram over an extra axis, as ``vmap`` does.

The chosen inputs gain the axis (in front); every box that then sees the axis
on an input is re-typed so that its outputs carry it too (its roles now list
the axis as woven); inputs that do not get the axis are broadcast along it.
Because primitives are written against axis names, re-typing is re-inference.
"""
from __future__ import annotations

from discopy import markov

from napkin.arrays import ArrayOb, Axis
from napkin.errors import NapkinError
from napkin.ir import to_diagram, to_graph, ops as op_order
from napkin.op import make_op


def weave(diagram, axis: Axis, inputs=None):
    """``diagram`` woven over ``axis``.

    ``inputs``: names (or positions) of the inputs that carry the axis; by
    default all of them.  The others are broadcast.
    """
    g = to_graph(diagram)
    in_nodes = g.graph["inputs"]
    chosen = set(range(len(in_nodes))) if inputs is None else set()
    for item in inputs or ():
        if isinstance(item, int):
            chosen.add(item)
        else:
            hits = [i for i, v in enumerate(in_nodes) if g.nodes[v]["ob"].name == item]
            if not hits:
                names = [g.nodes[v]["ob"].name for v in in_nodes]
                raise NapkinError(f"weave: no input named {item!r} (inputs: {', '.join(names)})")
            chosen.update(hits)
    for i, v in enumerate(in_nodes):
        ob = g.nodes[v]["ob"]
        if ob.type.has(axis.name):
            raise NapkinError(f"weave: input {ob} already has an axis named {axis.name}")
        if i in chosen:
            g.nodes[v]["ob"] = ArrayOb(ob.name, ob.type.with_axis(axis))
    for n in op_order(g):
        node = g.nodes[n]
        box = node["box"]
        dom_obs = [g.nodes[v]["ob"] for v in node["ins"]]
        if not any(ob.type.has(axis.name) for ob in dom_obs):
            continue
        new = make_op(box.spec.woven(axis.name), markov.Ty(*dom_obs),
                      [ob.name for ob in box.cod.inside], box.name)
        node["box"] = new
        for v, ob in zip(node["outs"], new.cod.inside):
            g.nodes[v]["ob"] = ob
    return to_diagram(g)
