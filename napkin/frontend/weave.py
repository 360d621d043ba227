"""Weaving: map a diagram over an extra axis, as ``vmap`` does, and back.

The chosen inputs gain the axis (in front); every box that then sees the axis
on an input is re-typed so that its outputs carry it too (its roles now list
the axis as woven); inputs that do not get the axis are broadcast along it.
Because primitives are written against axis names, re-typing is re-inference.

:func:`unweave` is the inverse for an axis every box only carries: a kernel whose
grid runs that axis one index per program drops it from its body (a block with a
unit batch axis costs Triton layout conversions through shared memory).
"""
from __future__ import annotations

from discopy import markov

from napkin.core.arrays import ArrayOb, Axis, array_types
from napkin.core.errors import NapkinError
from napkin.core.ir import GraphBuilder, to_diagram, to_graph, ops as op_order
from napkin.core.op import make_op


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


def unweavable(diagram, axis: str) -> str:
    """Why ``axis`` cannot be dropped from ``diagram`` ("" when it can): a box that
    reduces, contracts, masks or partitions over it reads its index, not just carries it."""
    from napkin.core.ir import primitive_boxes
    from napkin.core.primitives import roles
    for box in primitive_boxes(diagram):
        spec = box.spec
        ins, outs = array_types(box.dom), array_types(box.cod)
        if axis in roles(ins, outs)["reduced"]:
            return f"{box.name} reduces over {axis}"
        if getattr(spec, "axis", None) == axis or axis in (getattr(spec, "q", None),
                                                            getattr(spec, "k", None)):
            return f"{box.name} reads the index of {axis}"
    return ""


def unweave(diagram, axis: str):
    """``diagram`` with ``axis`` dropped from every wire and box (nested bodies too); the
    caller checks :func:`unweavable` first, as the axis must be one every box carries."""
    g, b = to_graph(diagram), GraphBuilder()
    env = {v: b.input(_without(g.nodes[v]["ob"], axis)) for v in g.graph["inputs"]}
    for n in op_order(g):
        node = g.nodes[n]
        box = node["box"]
        dom = markov.Ty(*(b.graph.nodes[env[v]]["ob"] for v in node["ins"]))
        new = make_op(box.spec.unwoven(axis), dom, [ob.name for ob in box.cod.inside], box.name)
        for v, w in zip(node["outs"], b.op(new, [env[v] for v in node["ins"]])):
            env[v] = w
    return to_diagram(b.finish([env[v] for v in g.graph["outputs"]]))


def _without(ob, axis):
    return ArrayOb(ob.name, ob.type.without(axis)) if ob.type.has(axis) else ob
