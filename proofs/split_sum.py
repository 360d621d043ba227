"""Splitting a sum over several axes preserves meaning (Fubini for finite sums).

Statement.  For a contraction C with inputs X_1 … X_n, output axes O and summed axes
S = {a} ∪ B (B not empty), ``rewrites.split_sum`` at ``axis = a`` gives

    C'(X) = Σ_a P,   P[O, a] = Σ_{B} Π_i X_i        (the partial sums along a)

where C(X)[O] = Σ_{a, B} Π_i X_i.

Proof.  A contraction's meaning is the einsum over its summed axes: for each output index
o, the sum of the product over every combination of the summed axes' indices
(``Contract.evaluate``).  That index set is the finite product {a} × B, and a sum over a
finite product is the iterated sum, in either order, whatever the terms (addition is
associative and commutative: Fubini for finite sums).  P keeps a as an output axis, so P's
einsum sums over B alone, for each (o, a); the second contraction, of P alone with output
O, sums P over a.  Their composite is Σ_a Σ_B Π_i X_i = C(X) at every o, for every size of
every axis.  The checks confirm each step on the real rule: the rewritten program holds the
partial contraction (output O then a) and a sum of it alone (output O); the two programs
give identical sympy expressions on symbolic entries, for a sum of one computed value over
two axes and a product of two operands over three; float64 results equal to within rounding
on ALiBi's dslopes (its backward, at ragged sizes); and the premises are enforced (an axis
the box does not sum, a box that sums one axis, a box that is not a contraction).  A wrong
variant fails: the second sum written as a max over a.
"""
from __future__ import annotations

import numpy as np

from proofs._core import (Failed, Proof, apply_rule, compare, library, numeric, refuses,
                          sample, sym_ctx, sym_inputs)

RULE = "split_sum"


def _summed_over_two():
    """Σ_{q,x} exp(A[h,q,x]) · B[q,x] → [h] (a sum of one computed value) and
    Σ_{r,q,x} A[h,r,q,x] · C[r,q,x] → [h] (a product of two operands, three summed axes)."""
    from napkin.core.arrays import axes
    from napkin.frontend import ops
    from napkin.frontend.trace import Array, trace
    h, r, q, x = axes("h r q x")
    one = trace(lambda A, B: ops.contract(ops.mul(ops.exp(A), B), out=(h,)),
                {"A": Array(h, q, x, dtype="f64"), "B": Array(q, x, dtype="f64")},
                "sum over q and x")
    two = trace(lambda A, C: ops.contract(A, C, out=(h,)),
                {"A": Array(h, r, q, x, dtype="f64"), "C": Array(r, q, x, dtype="f64")},
                "product over r, q and x")
    return {"one": one, "two": two}


def _contracts(program):
    return [b for b in program.boxes if getattr(b, "spec", None) is not None
            and b.spec.kind == "contract"]


def prove():
    from napkin.core.ir import ops as op_order, view
    from napkin.core.semantics import run
    proof = Proof(RULE, __name__, __doc__)
    named = _summed_over_two()
    one = named["one"]
    last = lambda d: (len(op_order(view(d))) - 1,)  # noqa: E731 - the contraction: last op
    split = {}

    def structure():
        out = []
        for name, axis in (("one", "q"), ("one", "x"), ("two", "r"), ("two", "x")):
            D = named[name]
            S = apply_rule(RULE, D, {"axis": axis}, ops=last(D))
            partial, whole = _contracts(S)
            (want,) = _contracts(D)
            if partial.spec.out != (*want.spec.out, axis):
                raise Failed(f"{name}: the partial sums keep {partial.spec.out}, not "
                             f"{(*want.spec.out, axis)}")
            if len(whole.dom) != 1 or whole.spec.out != want.spec.out or \
                    whole.cod != want.cod or S.dom != D.dom or S.cod != D.cod:
                raise Failed(f"{name}: the second sum is not the partial's alone into "
                             f"the output")
            split[(name, axis)] = S
            out.append(f"{name} at {axis}: {partial.spec.out} then {whole.spec.out}")
        return "; ".join(out)
    proof.check("a partial contraction keeping the axis, then a sum of it alone", structure,
                "structure")

    def symbolic():
        out = []
        for name, sizes in (("one", {"h": 2, "q": 3, "x": 2}),
                            ("two", {"h": 2, "r": 2, "q": 2, "x": 3})):
            D = named[name]
            ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
            (want,) = run(D, ctx, *xs)
            for (which, axis), S in split.items():
                if which == name:
                    (got,) = run(S, ctx, *xs)
                    out.append(f"{name} at {axis} ({compare(want, got)})")
        if len(out) != len(split):
            raise Failed("the structure check built no split program to compare")
        return "identical expressions: " + ", ".join(out)
    proof.check("identical sympy expressions on symbolic entries", symbolic)

    def alibi():
        from napkin.frontend.grad import grad
        D = grad(library("alibi_attention", "f64"), wrt="slopes")
        n = next(i for i, k in enumerate(op_order(view(D)))
                 if view(D).nodes[k]["box"].spec.kind == "contract"
                 and len(view(D).nodes[k]["box"].spec.out) == 1)
        sizes = {"h": 2, "q": 7, "x": 11, "d": 3}
        xs = sample(D, sizes, np.random.default_rng(41))
        details = []
        for axis in ("q", "x"):
            S = apply_rule(RULE, D, {"axis": axis}, ops=(n,))
            if len(_contracts(S)) != len(_contracts(D)) + 1:
                raise Failed(f"split at {axis}: no partial contraction in the program")
            details.append(numeric(D, S, xs, tol=1e-12))
        return f"ALiBi dslopes at {sizes}, split at q and at x: " + "; ".join(details)
    proof.check("float64 results equal on ALiBi's dslopes (ragged)", alibi, "numeric")

    def premises():
        S = split[("one", "q")]
        return "; ".join([
            refuses(lambda: apply_rule(RULE, one, {"axis": "h"}, ops=last(one)),
                    "does not sum axis 'h'"),
            refuses(lambda: apply_rule(RULE, S, {"axis": "q"}, ops=last(S)), "sums q alone"),
            refuses(lambda: apply_rule(RULE, one, {"axis": "q"}, ops=(0,)),
                    "not a contraction")])
    proof.check("premises enforced: an axis not summed, one summed axis, not a contraction",
                premises, "premise")

    def wrong():
        from napkin.core.diagram import ty
        from napkin.core.ir import to_diagram, to_graph
        from napkin.core.op import make_op
        from napkin.core.primitives import Reduce
        S = split[("one", "q")]
        g = to_graph(S)
        n = op_order(g)[-1]
        node = g.nodes[n]
        node["box"] = make_op(Reduce("max", "q"), ty(tuple(g.nodes[v]["ob"]
                                                          for v in node["ins"])),
                              out_names=[node["box"].cod.inside[0].name])
        W = to_diagram(g)
        sizes = {"h": 2, "q": 5, "x": 3}
        xs = sample(one, sizes, np.random.default_rng(43))
        try:
            numeric(one, W, xs)
        except Failed as e:
            return f"the outer sum as a max over q differs: {e}"
        raise Failed("a max over q in place of the outer sum went unnoticed")
    proof.check("a wrong variant fails (the outer sum as a max)", wrong, "numeric")
    return proof.result()
