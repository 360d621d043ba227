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
recomputing an elementwise value is cheaper than storing it.  Applied eagerly — except to
a box that reads two or more arrays as large as its value that are the program's inputs or
products' results (a residual x + o, :func:`wide`): a copy per reader then reads more than
the value itself, each time a reader reads it (per column tile of the projection it feeds),
and one value written once can be cheaper; that recompute (``recompute_wide``) the search
chooses on the cost model.

``recompute_product`` is the same rewrite at a contraction (a matrix product): the scores
S = Q·Kᵀ that a backward pass reads for its row statistics and again for P = exp(S − L)
are recomputed per reader — one kernel streams each copy over a different axis, where one
S would go through HBM, q·x values.  Recomputing a product costs FLOPs, not only bytes:
the search chooses, on the cost model (not eager).  Proof: proofs/recompute.py (the
argument holds for any deterministic box).
"""
from __future__ import annotations

from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, to_diagram, to_graph, view
from napkin.core.region import Site, body_at, replace_at
from rewrites.base import Rule, one_op


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


def _reaches_reduction(g, n) -> bool:
    """Whether a reader of op ``n``'s value — directly, or through elementwise boxes (P read
    by two guards, each feeding a contraction) — reduces one of its axes."""
    axes = set(g.nodes[g.nodes[n]["outs"][0]]["ob"].type.names)
    seen, work = set(), [n]
    while work:
        for m, _ in readers(g, work.pop()):
            if m == "output" or m in seen:
                continue
            seen.add(m)
            if axes - {a for ob in g.nodes[m]["box"].cod.inside for a in ob.type.names}:
                return True
            if getattr(g.nodes[m]["box"].spec, "elementwise", False) and \
                    len(g.nodes[m]["outs"]) == 1:
                work.append(m)
    return False


def wide(graph, n) -> bool:
    """Whether op ``n`` reads two or more arrays carrying every axis of its value that a
    kernel reads from memory or makes with the tensor cores — the program's inputs, a
    product's results (a residual x + o) — so that a copy per reader reads or recomputes
    more than the value itself.  (A backward's dS = P ⊙ (dP − D) reads values recomputed
    elementwise in the kernels that read it: copied eagerly, as before.)"""
    (v,) = graph.nodes[n]["outs"]
    axes = set(graph.nodes[v]["ob"].type.names)

    def heavy(u) -> bool:
        maker = next(iter(graph.predecessors(u)), None)
        return maker is None or graph.nodes[maker]["box"].spec.kind == "contract"
    return sum(axes <= set(graph.nodes[u]["ob"].type.names) and heavy(u)
               for u in graph.nodes[n]["ins"]) >= 2


class Recompute(Rule):
    name = "recompute"
    eager = True
    summary = "an elementwise value several boxes read: computed once per reader"
    proof = "proofs.recompute"
    what = "an elementwise box"  # the boxes it recomputes, in words
    offers_wide = False  # proposes the wide boxes (:func:`wide`), and only those

    def recomputes(self, spec) -> bool:
        return bool(getattr(spec, "elementwise", False)) and spec.kind not in ("group", "stream")

    def _find(self, program, site, params, graph_of=view):
        g, n = one_op(self.name, program, site, graph_of)
        box = g.nodes[n]["box"]
        if not self.recomputes(box.spec):
            raise RuleError(f"{self.name}: {box.name} is not {self.what} ({self.name} "
                            f"recomputes only those)")
        if len(g.nodes[n]["outs"]) != 1:
            raise RuleError(f"{self.name}: {box.name} has {len(g.nodes[n]['outs'])} outputs")
        reads = readers(g, n)
        if len(reads) < 2:
            raise RuleError(f"{self.name}: {box.name}'s result is read once; nothing to "
                            f"recompute")
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
        """Every elementwise box read more than once whose value carries an axis that a
        reader reduces, directly or through elementwise boxes (there a copy of its own
        lets the reduction stream)."""
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            box = g.nodes[n]["box"]
            if not self.recomputes(box.spec) or len(g.nodes[n]["outs"]) != 1:
                continue
            reads = readers(g, n)
            if len(reads) < 2:
                continue
            if wide(g, n) == self.offers_wide and _reaches_reduction(g, n):
                yield Site(tuple(path), (i,)), {}


class RecomputeWide(Recompute):
    name = "recompute_wide"
    eager = False  # a copy that reads more than the value: the cost model decides
    summary = ("an elementwise value read by several boxes that reads two or more inputs or "
               "products as large as itself (a residual add): computed once per reader (the "
               "search decides)")
    offers_wide = True


class RecomputeProduct(Recompute):
    name = "recompute_product"
    eager = False  # a product's copy costs FLOPs: the cost model decides
    summary = "a contraction several boxes read: computed once per reader (the search decides)"
    what = "a contraction"

    def recomputes(self, spec) -> bool:
        return spec.kind == "contract"

    def candidates(self, program, path=()):
        """Every contraction read by two or more boxes (a reader that reduces an axis may
        sit behind elementwise boxes: the scale of S = Q·Kᵀ/√d)."""
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            if self.recomputes(g.nodes[n]["box"].spec) and len(g.nodes[n]["outs"]) == 1 \
                    and sum(m != "output" for m, _ in readers(g, n)) >= 2:
                yield Site(tuple(path), (i,)), {}
