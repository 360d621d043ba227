"""Split a sum over several axes into two sums, one after the other (Fubini).

Matches: one contraction box that sums two or more axes (axes of its inputs its output
lacks).  Parameters: ``axis`` — one of them, kept by the first sum and summed by the second.
Replacement: the contraction into its output's axes and ``axis`` (the partial sums along
``axis``), then a sum over ``axis`` of that one value:
Σ_{a, B} f = Σ_a (Σ_B f).  ALiBi's dslopes_h = Σ_{q,x} dS·(q − x) then streams the keys per
query tile, as dQ does, and sums the rows after, instead of writing [h, q, x] to main memory
to reduce it in two more kernels (no rule streams two axes of one sum in one loop nest).
Proof: proofs/split_sum.py (finite sums commute and associate).
"""
from __future__ import annotations

from napkin.core.diagram import ty
from napkin.core.errors import RuleError
from napkin.core.ir import add_op, ops as op_order, to_diagram, to_graph, view
from napkin.core.op import make_op
from napkin.core.primitives import Contract
from napkin.core.region import Site, body_at, replace_at
from rewrites.base import Rule, one_op


def summed_axes(box) -> list[str]:
    """The axes a contraction box sums: its inputs' axes its output lacks, in input order."""
    out = set(box.outs[0].names)
    return list(dict.fromkeys(a for t in box.ins for a in t.names if a not in out))


class SplitSum(Rule):
    name = "split_sum"
    params = ("axis",)
    summary = "a sum over several axes as two sums, one after the other (Fubini)"
    proof = "proofs.split_sum"
    rooted = True

    def _site(self, program, site, params):
        g, n = one_op(self.name, program, site, to_graph, "one contraction")
        box = g.nodes[n]["box"]
        axis = params.get("axis")
        if box.spec.kind != "contract":
            raise RuleError(f"split_sum: {box.name} is a {box.spec.kind}, not a contraction")
        summed = summed_axes(box)
        if axis not in summed:
            raise RuleError(f"split_sum: {box.name} does not sum axis {axis!r} (it sums "
                            f"{', '.join(summed) or 'none'})")
        if len(summed) < 2:
            raise RuleError(f"split_sum: {box.name} sums {axis} alone: nothing to split")
        return g, n, box, axis

    def check(self, program, site, params):
        self._site(program, site, params)

    def apply(self, program, site, params):
        g, n, box, axis = self._site(program, site, params)
        node = g.nodes[n]
        partial = make_op(Contract((*box.spec.out, axis)), box.dom,
                          out_names=[f"{box.cod.inside[0].name}_{axis}"])
        (sums,) = add_op(g, partial, node["ins"])
        for v in dict.fromkeys(node["ins"]):
            g.remove_edge(v, n)
        g.add_edge(sums, n)
        node["ins"] = [sums]
        node["box"] = make_op(Contract(box.spec.out), ty((partial.cod.inside[0],)),
                              out_names=[box.cod.inside[0].name], name=box.name)
        return replace_at(program, site.path, to_diagram(g))

    def candidates(self, program, path=()):
        """Each sum (a contraction of one operand) over several axes of a value computed in
        the body, at each of its summed axes.  (A product of two operands is left whole: its
        partial sums along an axis would be a tensor the size of the product's output
        times that axis — GQA's dK per query head.)"""
        g = view(body_at(program, path))
        inputs = set(g.graph["inputs"])
        for i, n in enumerate(op_order(g)):
            box = g.nodes[n]["box"]
            if box.spec.kind != "contract" or len(box.ins) != 1 or \
                    g.nodes[n]["ins"][0] in inputs:
                continue
            summed = summed_axes(box)
            if len(summed) >= 2:
                for axis in summed:
                    yield Site(tuple(path), (i,)), {"axis": axis}
