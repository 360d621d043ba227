"""Streamability of softmax-contraction (the attention core, FlashAttention).

Claims: ``softmax`` over the axis whose output is used only by one contraction
that sums over the axis (P·V).  State (μ, z, o) = (−∞, 0, 0); per chunk of
scores x and the other contraction inputs v:
μ′ = max(μ, max x); m = μ′ where finite, else 0; δ = exp(μ − m);
z′ = δz + Σ exp(x − m); o′ = δo + Σ exp(x − m)·v; result o · (1/z), or 0 for a
row that kept no key (μ still the mask's fill, or −∞: as softmax gives).  The
shift m is μ′ itself whenever μ′ is finite; for a row that has seen only −∞ it
is 0, so δ and the exponentials are exp(−∞) = 0 rather than exp(−∞ + ∞) = NaN.
A NaN score makes the row NaN, as jax.nn.softmax does.

With an attention sink s (``ops.softmax(x, axis, sink=s)``: one extra logit per row
with no value) the state and the update are the same, and the sink folds into the
finalize, which reads s (``Claim.extra``): μ* = max(μ, s), m* = μ* where finite else 0,
δ* = exp(μ − m*), z* = δ*z + exp(s − m*), o* = δ*o, result o* · guard(1/z*, μ*).  A row
whose scores were all masked ends with z* = 1 from the sink and o* = 0: zeros.
Proof: proofs/softmax_contraction.py.
"""
from __future__ import annotations

from napkin.frontend import ops
from rewrites.base import Claim, Streamability, acc_dtype, ob
from rewrites.logsumexp import rescaled_max


class SoftmaxContraction(Streamability):
    name = "softmax_contraction"
    summary = "softmax over the axis contracted over it: (μ, z, o) with rescale exp(μ − μ′)"
    proof = "proofs.softmax_contraction"
    boxes_per_claim = 2  # the softmax and the contraction: before sum_contraction takes the latter

    def claims(self, graph, nodes, axis):
        out, pool = [], set(nodes)
        for n in nodes:
            spec = graph.nodes[n]["box"].spec
            if spec.kind != "softmax" or spec.axis != axis:
                continue
            (p,) = graph.nodes[n]["outs"]
            users = list(graph.successors(p))
            if len(users) != 1 or p in graph.graph["outputs"] or users[0] not in pool:
                continue
            c = users[0]
            cspec = graph.nodes[c]["box"].spec
            if cspec.kind != "contract" or axis in cspec.out or graph.nodes[c]["ins"].count(p) != 1:
                continue
            s_type = ob(graph, graph.nodes[n]["ins"][0]).type.without(axis)
            o_type = ob(graph, graph.nodes[c]["outs"][0]).type
            if not set(s_type.names) <= set(o_type.names):
                continue  # the rescale δ must broadcast onto the output
            others = [v for v in graph.nodes[c]["ins"] if v != p]
            sink = list(graph.nodes[n]["ins"][1:])  # the sink logit: the finalize's alone
            out.append(Claim(self, [n, c], [graph.nodes[n]["ins"][0], *others],
                             list(graph.nodes[c]["outs"]),
                             {"out": cspec.out, "port": graph.nodes[c]["ins"].index(p)},
                             extra=sink))
        return out

    def state(self, graph, claim, axis):
        s = ob(graph, claim.inputs[0]).type.without(axis)
        o = ob(graph, claim.outputs[0]).type
        return [("mu", s.with_dtype(acc_dtype(s.dtype))), ("z", s.with_dtype(acc_dtype(s.dtype))),
                ("o", o.with_dtype(acc_dtype(o.dtype)))]

    def init(self, graph, claim, axis):
        (_, ts), _, (_, to) = self.state(graph, claim, axis)
        return [ops.fill(ts, float("-inf"), as_="mu"), ops.fill(ts, 0.0, as_="z"),
                ops.fill(to, 0.0, as_="o")]

    def update(self, graph, claim, axis, state, ins):
        mu, z, o = state
        x, others = ins[0], list(ins[1:])
        mu2 = ops.maximum(mu, ops.max_(x, axis), as_="mu")
        # a running max of ±∞ shifts by 0: exp then gives 0 or ∞, not exp(∞ − ∞) = NaN
        shift = ops.finite_or_zero(mu2, as_="shift")
        delta = ops.exp(ops.sub(mu, shift), as_="delta")
        p = ops.exp(ops.sub(x, shift), as_="p")
        z2 = ops.add(ops.mul(z, delta), ops.sum_(p, axis), as_="z")
        low = [v.type.dtype for v in others if v.type.dtype in ("bf16", "f16", "fp8")]
        if low:  # as FlashAttention does: p·V on the tensor cores in V's precision
            p = ops.cast(p, low[0], as_="p")
        args = others[:claim.data["port"]] + [p] + others[claim.data["port"]:]
        pv = ops.contract(*args, out=list(claim.data["out"]), name="Σ p·v")
        o2 = ops.add(ops.mul(o, delta), pv, as_="o")
        return [mu2, z2, o2]

    def merge(self, graph, claim, axis, a, b):
        mu, (da, db) = rescaled_max(a[0], b[0])
        z = ops.add(ops.mul(a[1], da), ops.mul(b[1], db), as_="z")
        o = ops.add(ops.mul(a[2], da), ops.mul(b[2], db), as_="o")
        return [mu, z, o]

    def finalize(self, graph, claim, axis, state, extra=()):
        mu, z, o = state
        if extra:  # the sink s: one more logit, mass without a value
            (s,) = extra
            mu_s = ops.maximum(mu, s, as_="mu")
            shift = ops.finite_or_zero(mu_s, as_="shift")
            delta = ops.exp(ops.sub(mu, shift), as_="delta")
            z = ops.add(ops.mul(z, delta), ops.exp(ops.sub(s, shift)), as_="z")
            o = ops.mul(o, delta, as_="o")
            mu = mu_s
        # a row whose running max is still the mask's fill kept no key: zeros,
        # as softmax itself gives (napkin.core.primitives.MASKED)
        # o · guard(1/z, μ): the guard acts on a row vector, so the output can
        # overwrite o in place (the paper's memory count)
        return [ops.mul(o, ops.guard(ops.recip(z), mu), as_=ob(graph, claim.outputs[0]).name)]
