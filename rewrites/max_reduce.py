"""Streamability of max: m ← max(m, max_chunk), from m = −∞.

Proof: proofs/max_reduce.py.
"""
from __future__ import annotations

from napkin.frontend import ops
from rewrites.base import Claim, Streamability, acc_dtype, ob


class MaxReduce(Streamability):
    name = "max"
    summary = "max over the axis: m ← max(m, max over the chunk)"
    proof = "proofs.max_reduce"

    def claims(self, graph, nodes, axis):
        return [Claim(self, [n], list(graph.nodes[n]["ins"]), list(graph.nodes[n]["outs"]))
                for n in nodes if graph.nodes[n]["box"].spec.kind == "reduce"
                and graph.nodes[n]["box"].spec.fn == "max" and graph.nodes[n]["box"].spec.axis == axis]

    def state(self, graph, claim, axis):
        o = ob(graph, claim.outputs[0])
        return [(f"max_{o.name}", o.type.with_dtype(acc_dtype(o.type.dtype)))]

    def init(self, graph, claim, axis):
        (name, t), = self.state(graph, claim, axis)
        return [ops.fill(t, float("-inf"), as_=name)]

    def update(self, graph, claim, axis, state, ins):
        return [ops.maximum(state[0], ops.max_(ins[0], axis), as_=state[0].name)]

    def merge(self, graph, claim, axis, a, b):
        return [ops.maximum(a[0], b[0], as_=a[0].name)]

    def finalize(self, graph, claim, axis, state, extra=()):
        return [state[0]]
