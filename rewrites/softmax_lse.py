"""Softmax through its logsumexp: softmax_x(S) = guard(exp(S − L), L), L = logsumexp_x(S).

Matches: one softmax box (no sink) whose probabilities are read other than by one box
that reduces the softmax's axis (softmax-contraction's P·V, which streams the softmax as it
is): by two or more boxes, or by one that keeps the axis or reduces another (a backward's
dV = Pᵀ·dO sums over the queries).  No parameters.  Replacement: L = logsumexp over the axis (a row statistic, streamable with
the logsumexp accumulator), then P = exp(S − L) entry by entry, guarded as softmax is (a
row that kept no entry — L at most the mask's fill, or −∞ — gives zeros).

Why: a softmax keeps its axis, so no stream can take it; its probabilities read by
several boxes (a backward pass reads P for dV, for dS and for the row term Σ dP ⊙ P) would
go through HBM, q·x values.  As exp(S − L), P is elementwise once the row's L is known:
one kernel streams L, and every reader recomputes its P chunk (FlashAttention's backward,
which saves L from the forward).  Applied eagerly where it matches.
Proof: proofs/softmax_lse.py.
"""
from __future__ import annotations

from napkin.core.errors import RuleError
from napkin.core.ir import add_op, ops as op_order, to_diagram, to_graph, view
from napkin.core.op import make_op
from napkin.core.primitives import Map, Reduce, Softmax, Zip
from napkin.core.region import Site, body_at, replace_at
from rewrites.base import Rule, one_op
from rewrites.recompute import readers


class SoftmaxLse(Rule):
    name = "softmax_lse"
    eager = True
    summary = "a softmax several boxes read: exp(S − L) with L its logsumexp, per reader"
    proof = "proofs.softmax_lse"

    def _find(self, program, site, params, graph_of=view):
        g, n = one_op(self.name, program, site, graph_of)
        spec = g.nodes[n]["box"].spec
        if type(spec) is not Softmax:
            raise RuleError(f"softmax_lse: {g.nodes[n]['box'].name} is not a softmax (without "
                            f"a sink)")
        if not _needs_lse(g, n):
            raise RuleError(f"softmax_lse: {g.nodes[n]['box'].name}'s probabilities are read "
                            f"once, by a box reducing {spec.axis} (softmax-contraction streams "
                            f"that softmax as it is), or only as the program's output")
        return g, n

    def check(self, program, site, params):
        self._find(program, site, params)

    def apply(self, program, site, params):
        g, n = self._find(program, site, params, graph_of=to_graph)  # mutated below
        node = g.nodes[n]
        axis = node["box"].spec.axis
        (s,), (p,) = node["ins"], node["outs"]

        def add(spec, ins, name, out=None):
            (w,) = add_op(g, make_op(spec, _ty(g, ins), [out or name], name), ins)
            return w
        lse = add(Reduce("logsumexp", axis), [s], f"logsumexp_{axis}", "L")
        # + (L − L): 0 on a row with a finite L, NaN where L = +∞ — softmax's row of a +∞
        # score is NaN throughout, where exp(s − ∞) alone would be 0 beside it (and a row
        # of L = −∞ is zeroed by the guard whatever its entries)
        nan_where_inf = add(Zip("sub"), [lse, lse], "nan_where_inf")
        shifted = add(Zip("add"), [add(Zip("sub"), [s, lse], "sub"), nan_where_inf], "shift")
        e = add(Map("exp"), [shifted], "exp")
        # the guarded exp takes the softmax's own output wire: every reader reads it as before
        box = make_op(Zip("guard"), _ty(g, [e, lse]), [g.nodes[p]["ob"].name], "guard")
        g.remove_edge(s, n)
        g.remove_edge(n, p)
        g.remove_node(n)
        g.add_node(n, kind="op", box=box, ins=[e, lse], outs=[p])
        g.add_edge(e, n)
        g.add_edge(lse, n)
        g.add_edge(n, p)
        g.nodes[p]["ob"] = box.cod.inside[0]
        return replace_at(program, site.path, to_diagram(g))

    def candidates(self, program, path=()):
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            if type(g.nodes[n]["box"].spec) is Softmax and _needs_lse(g, n):
                yield Site(tuple(path), (i,)), {}


def _needs_lse(g, n) -> bool:
    """Whether softmax op ``n`` is read by more than one box, or by one box that does not
    reduce the softmax's axis."""
    boxes = [m for m, _ in readers(g, n) if m != "output"]
    if len(set(boxes)) != 1:
        return len(set(boxes)) > 1
    axis = g.nodes[n]["box"].spec.axis
    return any(ob.type.has(axis) for ob in g.nodes[boxes[0]]["box"].cod.inside) or \
        len([m for m, _ in readers(g, n)]) > 1


def _ty(g, values):
    from discopy import markov
    return markov.Ty(*(g.nodes[v]["ob"] for v in values))
