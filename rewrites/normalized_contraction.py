"""Normalised contraction: pull a factor that lacks the summed axes out of a
contraction, Σ_x (n_x / D)·v_x = (Σ_x n_x·v_x) / D (and likewise for ·D).

This is what makes a₁(x)/b(Σ a₂(x)) followed by a contraction streamable: after
the factor is out, the numerator contraction and the normaliser Σ a₂(x) are
two plain sums, so the stream partition's accumulator is (o, z) with
B((o, z), (x, y)) = (o + Σ a₁(x)·y, z + Σ a₂(x)) and the result o / b(z).
Sigmoid- or L2-normalised attention and RMSNorm → matmul stream this way.

Matches: a contraction one of whose inputs is ``div(n, D)`` or ``mul(n, D)``
(used only there, at one port) where D has no axis the contraction sums over,
every axis of D is an output axis, and every output axis is still carried by n
or the other inputs.  Parameters: none (the site is the contraction).
Proof: proofs/normalized_contraction.py.
"""
from __future__ import annotations

from napkin.frontend import ops
from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, to_diagram, to_graph, view
from napkin.core.region import Site, body_at, inline, region, replace_at
from napkin.frontend.trace import trace
from rewrites.base import Rule, ob


def _factor(graph, c):
    """(port, zip node, numerator value, factor value) or a reason string."""
    spec = graph.nodes[c]["box"].spec
    if spec.kind != "contract":
        return f"{graph.nodes[c]['box'].name} is not a contraction"
    summed = {a for v in graph.nodes[c]["ins"] for a in ob(graph, v).type.names} - set(spec.out)
    for port, v in enumerate(graph.nodes[c]["ins"]):
        preds = list(graph.predecessors(v))
        if not preds:
            continue
        z = preds[0]
        zspec = graph.nodes[z]["box"].spec
        if zspec.kind != "zip" or zspec.fn not in ("div", "mul"):
            continue
        if list(graph.successors(v)) != [c] or v in graph.graph["outputs"] \
                or graph.nodes[c]["ins"].count(v) != 1:
            continue  # the quotient must feed this one port only (n/D·n/D is not (n·n/D)/D)
        num, den = graph.nodes[z]["ins"]
        candidates = [(num, den)] if zspec.fn == "div" else [(num, den), (den, num)]
        others = {a for u in graph.nodes[c]["ins"] if u != v for a in ob(graph, u).type.names}
        for n_, d_ in candidates:
            dt = ob(graph, d_).type
            if summed & set(dt.names):
                continue
            if not set(dt.names) <= set(spec.out):
                continue
            if not set(spec.out) <= others | set(ob(graph, n_).type.names):
                continue  # an output axis only the factor carries: Σ n·v would lack it
            return port, z, n_, d_, zspec.fn
    return (f"no input of {graph.nodes[c]['box'].name} is a quotient or product n/D or n·D, "
            f"used by it once, whose factor D lacks the summed axes {sorted(summed)}, has only "
            f"output axes, and leaves every output axis on n or the other inputs")


class NormalizedContraction(Rule):
    name = "normalized_contraction"
    summary = "Σ_x (n/D)·v = (Σ_x n·v)/D for D without x: normalisers leave the stream"
    proof = "proofs.normalized_contraction"

    def _find(self, program, site):
        body = body_at(program, site.path)
        g = to_graph(body)
        if len(site.ops) != 1:
            raise RuleError("normalized_contraction applies at one contraction (a site of one op)")
        order = op_order(g)
        if not 0 <= site.ops[0] < len(order):
            raise RuleError(f"site names op #{site.ops[0]} but the body has {len(order)} ops")
        c = order[site.ops[0]]
        found = _factor(g, c)
        if isinstance(found, str):
            raise RuleError(f"cannot factor out of the contraction: {found}")
        (out,) = g.nodes[c]["outs"]
        if not list(g.successors(out)) and out not in g.graph["outputs"]:
            raise RuleError(f"cannot factor out of {g.nodes[c]['box'].name}: its result is "
                            f"discarded (nothing to rewrite)")
        return g, c, found

    def check(self, program, site, params):
        self._find(program, site)

    def apply(self, program, site, params):
        g, c, (port, z, num, den, fn) = self._find(program, site)
        order = op_order(g)
        reg = region(g, [order.index(z), order.index(c)])
        spec = g.nodes[c]["box"].spec
        out_ob = ob(g, g.nodes[c]["outs"][0])
        others = [v for i, v in enumerate(g.nodes[c]["ins"]) if i != port]

        def rhs(*args):
            env = dict(zip(reg.inputs, args))
            xs = [env[v] for v in others]
            part = ops.contract(*xs[:port], env[num], *xs[port:], out=list(spec.out),
                                name=g.nodes[c]["box"].name)
            combine = ops.div if fn == "div" else ops.mul
            return combine(part, env[den], as_=out_ob.name)
        new = trace(rhs, [(ob(g, v).name, ob(g, v).type) for v in reg.inputs], "factored")
        return replace_at(program, site.path, to_diagram(inline(reg, new)))

    def candidates(self, program, path=()):
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            if not isinstance(_factor(g, n), str):
                yield Site(tuple(path), (i,)), {}
