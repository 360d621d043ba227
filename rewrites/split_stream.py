"""Split-K: the parts of a stream fold in parallel, and the accumulator's merge joins them.

Matches: one group box whose body is one stream box over ``axis`` with a merge (the
body's inputs and outputs are the stream's own), or such a stream box on its own.
Parameters: ``axis`` (the stream's), ``size`` (the tile of one part: default
``p_<axis>``).

    group q [ stream x ]
      ⇒  group q [ group x (p_x, stacked along x_parts) [ stream x, finalize = its state ] ]
         ; group q [ stream x_parts (1) [ update = merge ] , finalize ]

The first program folds each part of the keys from the empty state, all parts in
parallel (a grid axis more: flash-decoding's blocks over the keys), and writes one
partial state per part; the second folds the partial states with the accumulator's merge,
in order, from the empty state, and finalises.  Proof: proofs/split_stream.py — the merge
law merge(state(x), state(y)) = state(x ⊕ y) with the empty state its unit, proved per
accumulator by the stream partition's proof, makes the fold of the parts' states the fold
of the whole axis; the checks replay the rule on the real accumulators.
"""
from __future__ import annotations

import dataclasses

from discopy import markov

from napkin.core.arrays import array_types
from napkin.core.errors import RuleError
from napkin.core.ir import GraphBuilder, ops as op_order, to_diagram, view
from napkin.core.op import make_op
from napkin.core.region import Site, body_at, inline, region, relabel, replace_at
from napkin.core.streamed import Group, Stream
from napkin.frontend import ops
from napkin.frontend.trace import trace
from rewrites import tiles
from rewrites.base import Rule, one_op, replacement
from rewrites.stream_partition import replay


def parts_axis(axis: str) -> str:
    """The name of the axis that holds one partial state per part of ``axis``."""
    return f"{axis}_parts"


class SplitStream(Rule):
    name = "split_stream"
    params = ("axis", "size")
    summary = ("split a stream's axis into parts folded in parallel, then merge the "
               "partial states with the accumulator's merge (split-K)")
    proof = "proofs.split_stream"
    last = True

    def _find(self, program, site, params):
        axis = params.get("axis")
        if not isinstance(axis, str):
            raise RuleError("split_stream needs a parameter axis (the stream's axis)")
        g, n = one_op(self.name, program, site, view,
                      "one box: a group whose body is one stream, or a stream")
        node = g.nodes[n]
        outers, stream_box, why = lone_groups(node["box"])
        if why:
            raise RuleError(f"split_stream: {why}")
        spec = stream_box.spec
        if getattr(spec, "kind", None) != "stream":
            raise RuleError(f"split_stream: {stream_box.name} is not a stream")
        if spec.axis != axis:
            raise RuleError(f"split_stream: {stream_box.name} streams {spec.axis}, not {axis}")
        if spec.merge is None:
            raise RuleError(f"split_stream: the accumulator of {stream_box.name} "
                            f"({spec.rule}) has no merge: its chunks fold only in order")
        for group in outers:
            lacking = [o for o in spec.init.cod.inside if not o.type.has(group.spec.axis)]
            if lacking:
                raise RuleError(f"split_stream: the state {lacking[0]} of {stream_box.name} "
                                f"lacks the axis {group.spec.axis} of {group.name}: a group's "
                                f"partial states are written tile by tile along it")
        parts = parts_axis(axis)
        if any(t.has(parts) for t in array_types(stream_box.dom)):
            raise RuleError(f"split_stream: axis {parts} already exists")
        reg = region(g, site.ops)
        size = tiles.choose(program, site.path, reg.boxes(), params.get("size"), "group", axis,
                            f"p_{axis}", f"cannot split {axis}")
        return g, reg, node, outers, stream_box, size

    def check(self, program, site, params):
        self._find(program, site, params)

    def apply(self, program, site, params):
        g, reg, node, outers, stream_box, size = self._find(program, site, params)

        def make():
            return split(outers, stream_box, size, node["box"])
        pieces = replacement(self.name, (stream_box.spec.axis, size), reg, make)
        return replace_at(program, site.path, to_diagram(inline(reg, pieces)))

    def candidates(self, program, path=()):
        """Every group of one mergeable stream, and every such stream, at the top level
        (a kernel of its own: a split inside a kernel's body has no grid to run on)."""
        if path:
            return
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            _, box, why = lone_groups(g.nodes[n]["box"])
            if not why and box.spec.kind == "stream" and box.spec.merge is not None:
                yield Site(tuple(path), (i,)), {"axis": box.spec.axis}


def lone_groups(box) -> tuple[list, object, str]:
    """(the groups from ``box`` down, each the whole body of the one around it, outermost
    first; the box inside the last; why the descent stopped short of it, or "")."""
    outers = []
    while getattr(box.spec, "kind", None) == "group":
        if box.spec.stack is not None:
            return outers, box, f"{box.name} already holds partial states"
        inner = view(box.spec.body)
        order = op_order(inner)
        if len(order) != 1:
            return outers, box, (f"the body of {box.name} is {len(order)} boxes, not one "
                                 f"stream (the parts' states must be all the group writes)")
        only = inner.nodes[order[0]]
        if only["ins"] != inner.graph["inputs"] or only["outs"] != inner.graph["outputs"]:
            return outers, box, (f"the box in {box.name} does not read and write the "
                                 f"group's own wires in order")
        outers.append(box)
        box = only["box"]
    return outers, box, ""


def split(outers, stream_box, size, box):
    """The two boxes that replace ``box`` (the groups ``outers`` around ``stream_box``,
    outermost first, or the stream itself), as one diagram: the parts' states, then their
    merge, each inside the same groups."""
    spec = stream_box.spec
    axis, parts = spec.axis, parts_axis(spec.axis)
    names = [o.name for o in spec.init.cod.inside]
    state = [(o.name, o.type) for o in spec.init.cod.inside]
    sdom = stream_box.dom                     # the stream's wires, inside ``outer``
    fixed = [o for o in sdom.inside if not o.type.has(axis)]
    fixed_pairs = [(o.name, o.type) for o in fixed]

    # the parts: each folds its keys from the empty state and hands the state on as it is
    keep = trace(lambda *a: list(a[:len(state)]), state + fixed_pairs, "state")
    part = relabel(one_box(dataclasses.replace(spec, finalize=keep), sdom, names,
                           stream_box.name), axis, size)
    partials = Group(axis, size, part, outers[-1].spec.level if outers else "smem",
                     stack=parts)
    split_box = make_op(partials, sdom, names, f"split {axis}")
    stacked = list(split_box.cod.inside)

    # the merge: a stream over the partial states, one at a time, folding with the merge
    merge = view(spec.merge)

    def update(*args):
        acc, chunk = list(args[:len(state)]), args[len(state):2 * len(state)]
        one = [ops.sum_(c, parts, as_=n) for c, n in zip(chunk, names)]
        env = dict(zip(merge.graph["inputs"], acc + one))
        replay(merge, op_order(merge), env)
        return [env[v] for v in merge.graph["outputs"]]
    at_one = [(o.name, o.type.resize(parts, 1)) for o in stacked]
    merging = Stream(parts, 1, spec.init, trace(update, state + at_one + fixed_pairs, "merge"),
                     spec.finalize, spec.rule, spec.merge)
    outs = [o.name for o in box.cod.inside]
    merge_dom = markov.Ty(*stacked, *fixed)
    merge_box = make_op(merging, merge_dom, outs, f"merge {parts}")
    first, second = split_box, merge_box
    for group in reversed(outers):  # the same groups around each, innermost first
        states = [o.name for o in first.cod.inside]
        wrapped = make_op(dataclasses.replace(group.spec, body=one_box(
            first.spec, first.dom, states, first.name)), group.dom, states, group.name)
        second = make_op(dataclasses.replace(group.spec, body=one_box(
            second.spec, second.dom, outs, second.name)),
            markov.Ty(*wrapped.cod.inside, *[o for o in group.dom.inside
                                             if not o.type.has(axis)]), outs, group.name)
        first = wrapped
    b = GraphBuilder()
    ins = [b.input(o) for o in box.dom.inside]
    states = b.op(first, ins)
    rest = [w for o, w in zip(box.dom.inside, ins) if not o.type.has(axis)]
    return to_diagram(b.finish(b.op(second, list(states) + rest)))


def one_box(spec, dom, names, label):
    """A diagram of one box of ``spec`` on the wires ``dom``."""
    b = GraphBuilder()
    ins = [b.input(o) for o in dom.inside]
    return to_diagram(b.finish(b.op(make_op(spec, dom, names, label), ins)))
