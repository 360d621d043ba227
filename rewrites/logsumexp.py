"""Streamability of logsumexp: state (μ, z) = (running max, Σ exp(x − μ)).

μ′ = max(μ, max_chunk x); m = μ′ where finite, else 0;
z′ = z·exp(μ − m) + Σ_chunk exp(x − m); result μ + log z.  The shift m equals μ′
unless no finite entry has been seen: a row of −∞ then gives μ + log z =
−∞ + log 0 = −∞, as logsumexp does, instead of NaN.  Proof: proofs/logsumexp.py.
"""
from __future__ import annotations

from napkin.frontend import ops
from rewrites.base import Claim, Streamability, acc_dtype, ob


def rescaled_max(mu_a, mu_b):
    """(μ, (δa, δb)) for merging two running maxima: μ = max(μa, μb) and each side's
    rescale exp(μᵢ − m), m = μ where finite, else 0 (two states that saw only −∞ keep
    z = 0 rather than exp(−∞ + ∞) = NaN)."""
    mu = ops.maximum(mu_a, mu_b, as_="mu")
    shift = ops.finite_or_zero(mu, as_="shift")
    return mu, (ops.exp(ops.sub(mu_a, shift), as_="delta"),
                ops.exp(ops.sub(mu_b, shift), as_="delta"))


class LogSumExp(Streamability):
    name = "logsumexp"
    summary = "logsumexp over the axis: (μ, z) with rescale exp(μ − μ′)"
    proof = "proofs.logsumexp"

    def claims(self, graph, nodes, axis):
        return [Claim(self, [n], list(graph.nodes[n]["ins"]), list(graph.nodes[n]["outs"]))
                for n in nodes if graph.nodes[n]["box"].spec.kind == "reduce"
                and graph.nodes[n]["box"].spec.fn == "logsumexp"
                and graph.nodes[n]["box"].spec.axis == axis]

    def state(self, graph, claim, axis):
        t = ob(graph, claim.outputs[0]).type
        t = t.with_dtype(acc_dtype(t.dtype))
        return [("mu", t), ("z", t)]

    def init(self, graph, claim, axis):
        (_, t), _ = self.state(graph, claim, axis)
        return [ops.fill(t, float("-inf"), as_="mu"), ops.fill(t, 0.0, as_="z")]

    def update(self, graph, claim, axis, state, ins):
        mu, z = state
        x = ins[0]
        mu2 = ops.maximum(mu, ops.max_(x, axis), as_="mu")
        # a running max of ±∞ shifts by 0: exp then gives 0 or ∞, not exp(∞ − ∞) = NaN
        shift = ops.finite_or_zero(mu2, as_="shift")
        delta = ops.exp(ops.sub(mu, shift), as_="delta")
        z2 = ops.add(ops.mul(z, delta), ops.sum_(ops.exp(ops.sub(x, shift)), axis), as_="z")
        return [mu2, z2]

    def merge(self, graph, claim, axis, a, b):
        mu, deltas = rescaled_max(a[0], b[0])
        z = ops.add(ops.mul(a[1], deltas[0]), ops.mul(b[1], deltas[1]), as_="z")
        return [mu, z]

    def finalize(self, graph, claim, axis, state, extra=()):
        mu, z = state
        return [ops.add(mu, ops.log(z), as_=ob(graph, claim.outputs[0]).name)]
