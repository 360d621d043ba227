"""Streamability of sums and contractions: acc ← acc + Σ_chunk.

Claims: a contraction whose output lacks the streamed axis (it sums over it),
``sum`` / ``mean`` reductions over the axis, and ``take_along_axis`` over it (its
meaning is the sum over the axis of x where the global position equals the index: a
chunk adds the entry the index names when it falls in the chunk — the chunk's offset
read from the context, as masks read it — and 0 otherwise; the integer index is a
fixed input, read whole by every update, never accumulated).  State: the output
(float32 for low-precision inputs), initialised to 0; a mean is finalised by 1/|axis|.
Proof: proofs/sum_contraction.py.
"""
from __future__ import annotations

import sympy

from napkin.frontend import ops
from rewrites.base import Claim, Streamability, acc_dtype, ob


class SumContraction(Streamability):
    name = "sum_contraction"
    summary = "sum / contraction over the axis: acc + Σ over the chunk"
    proof = "proofs.sum_contraction"

    def claims(self, graph, nodes, axis):
        out = []
        for n in nodes:
            node = graph.nodes[n]
            spec = node["box"].spec
            ins = [ob(graph, v).type for v in node["ins"]]
            if not any(t.has(axis) for t in ins):
                continue
            if (spec.kind == "contract" and axis not in spec.out) or \
                    (spec.kind == "reduce" and spec.axis == axis and spec.fn in ("sum", "mean")) \
                    or (spec.kind == "take" and spec.axis == axis):
                out.append(Claim(self, [n], list(node["ins"]), list(node["outs"])))
        return out

    def state(self, graph, claim, axis):
        o = ob(graph, claim.outputs[0])
        return [(f"acc_{o.name}", o.type.with_dtype(acc_dtype(o.type.dtype)))]

    def init(self, graph, claim, axis):
        (name, t), = self.state(graph, claim, axis)
        return [ops.fill(t, 0.0, as_=name)]

    def update(self, graph, claim, axis, state, ins):
        spec = graph.nodes[claim.nodes[0]]["box"].spec
        if spec.kind == "contract":
            part = ops.contract(*ins, out=list(spec.out), name="Σ chunk")
        elif spec.kind == "take":  # the entry the index names, where it falls in the chunk
            part = ops.apply(spec, *ins, name="Σ chunk")[0]
        else:
            part = ops.sum_(ins[0], axis, name="Σ chunk")
        return [ops.add(state[0], part, as_=state[0].name)]

    def merge(self, graph, claim, axis, a, b):
        return [ops.add(a[0], b[0], as_=a[0].name)]

    def finalize(self, graph, claim, axis, state, extra=()):
        spec = graph.nodes[claim.nodes[0]]["box"].spec
        o = ob(graph, claim.outputs[0])
        if spec.kind == "reduce" and spec.fn == "mean":
            size = ob(graph, claim.inputs[0]).type.axis(axis).size
            return [ops.scale(state[0], 1 / sympy.sympify(size), as_=o.name)]
        return [ops.cast(state[0], o.type.dtype, as_=o.name)] if state[0].type.dtype != o.type.dtype \
            else [state[0]]
