"""Recompute: an elementwise box whose result several boxes read runs once per reader.

Matches: one elementwise primitive box (a map, a zip, a comparison, a select, a cast, a
mask) whose output is read by two or more boxes, or by a box and the program's outputs.
No parameters.  Replacement: one copy of the box per reader, each on the same inputs
(the program's outputs keep the original).  Premise: the box is a pure function of its
inputs — every primitive is — so f(x) copied equals f applied to x copied (a
deterministic box commutes with the copy of a Markov category).

Why: LayerNorm's x − μ is read by the variance and by the normalisation; the variance
streams over d only with a copy of its own (its region would otherwise hand x − μ, which
keeps d, out of the stream).  FlashAttention recomputes P in its backward the same way:
recomputing an elementwise value is cheaper than storing it.  The cost model prices the
extra work; the search chooses.  Proof: proofs/recompute.py.
"""
from __future__ import annotations

from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, to_diagram, to_graph, view
from napkin.core.region import Site, body_at, replace_at
from rewrites.base import Rule


def readers(graph, n) -> list:
    """(op node, port) of every read of op ``n``'s one output, in topological order, and
    ("output", position) for the program's outputs."""
    (v,) = graph.nodes[n]["outs"]
    order = {m: i for i, m in enumerate(op_order(graph))}
    out = sorted(((m, p) for m in set(graph.successors(v))
                  for p, u in enumerate(graph.nodes[m]["ins"]) if u == v),
                 key=lambda mp: (order[mp[0]], mp[1]))
    out += [("output", j) for j, u in enumerate(graph.graph["outputs"]) if u == v]
    return out


class Recompute(Rule):
    name = "recompute"
    eager = True
    summary = "an elementwise value several boxes read: computed once per reader"
    proof = "proofs.recompute"

    def _find(self, program, site, params, graph_of=view):
        if params:
            raise RuleError(f"recompute takes no parameters; got {', '.join(sorted(params))}")
        g = graph_of(body_at(program, site.path))
        order = op_order(g)
        if len(site.ops) != 1 or not 0 <= site.ops[0] < len(order):
            raise RuleError("recompute applies at one box (a site of one op)")
        n = order[site.ops[0]]
        box = g.nodes[n]["box"]
        if not getattr(box.spec, "elementwise", False) or box.spec.kind in ("group", "stream"):
            raise RuleError(f"recompute: {box.name} is not an elementwise box (only entry-by-"
                            f"entry work is recomputed)")
        if len(g.nodes[n]["outs"]) != 1:
            raise RuleError(f"recompute: {box.name} has {len(g.nodes[n]['outs'])} outputs")
        reads = readers(g, n)
        if len(reads) < 2:
            raise RuleError(f"recompute: {box.name}'s result is read once; nothing to recompute")
        return g, n, reads

    def check(self, program, site, params):
        self._find(program, site, params)

    def apply(self, program, site, params):
        g, n, reads = self._find(program, site, params, graph_of=to_graph)  # mutated below
        node = g.nodes[n]
        (v,) = node["outs"]
        fresh = max(g.nodes) + 1
        keep = next((r for r in reads if r[0] == "output"), reads[0])
        for m, port in reads:
            if (m, port) == keep or m == "output":
                continue
            op, w = fresh, fresh + 1
            fresh += 2
            g.add_node(w, kind="value", ob=g.nodes[v]["ob"])
            g.add_node(op, kind="op", box=node["box"], ins=list(node["ins"]), outs=[w])
            for u in node["ins"]:
                g.add_edge(u, op)
            g.add_edge(op, w)
            ins = list(g.nodes[m]["ins"])
            ins[port] = w
            g.nodes[m]["ins"] = ins
            if v not in ins:
                g.remove_edge(v, m)
            g.add_edge(w, m)
        return replace_at(program, site.path, to_diagram(g))

    def candidates(self, program, path=()):
        """Every elementwise box read more than once whose value carries an axis that one
        of its readers reduces (there a copy of its own lets the reduction stream)."""
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            box = g.nodes[n]["box"]
            if not getattr(box.spec, "elementwise", False) or len(g.nodes[n]["outs"]) != 1:
                continue
            reads = readers(g, n)
            if len(reads) < 2:
                continue
            axes = set(g.nodes[g.nodes[n]["outs"][0]]["ob"].type.names)
            if any(m != "output" and axes - {a for ob in g.nodes[m]["box"].cod.inside
                                             for a in ob.type.names}
                   for m, _ in reads):
                yield Site(tuple(path), (i,)), {}
