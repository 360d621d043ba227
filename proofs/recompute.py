"""Recompute preserves meaning: an elementwise value computed once per reader.

Statement.  For a box f with one output read by k readers, ``rewrites.recompute``
replaces the one f and its k-way copy by k boxes f, each on the same inputs, each
feeding one reader (a program output keeps the original).  The programs denote the same
function.

Proof (by construction).  The semantics maps a box to its spec's ``evaluate``, a pure
function of the input arrays (no primitive reads state or randomness), and a copy to the
identity on each branch; so f ∘ copy-of-inputs = copy ∘ f — a deterministic box commutes
with copying in a Markov category — and every reader receives f(inputs) on either side.
The checks confirm it on the real rule, for LayerNorm (x − μ read by the variance and by
the normalisation) and a value also read as a program output: every copy is the very box
of the original on the very input wires; both programs give identical sympy expressions
on symbolic entries; bit-identical float64 results (JAX); and the premises are enforced
(a box read once, a reduction, a site of two boxes are refused).  A wrong variant — the
copy of a subtraction on its inputs swapped — fails the symbolic comparison.

``recompute_product`` is the same rewrite at a contraction (the argument never used that
the box is elementwise): checked on a backward's scores S = Q·Kᵀ read by a row
statistic and by exp(S − L) — a copy per reader on the very input wires, identical
symbolic entries, bit-identical float64 — and its premises (an elementwise box is
``recompute``'s; a product read once) are refused.

``recompute_wide`` is the same rewrite at an elementwise box that reads two inputs or
products as large as its value (a residual x + o read by a norm's statistic and by the product it scales),
which ``recompute`` leaves to the search: checked the same way on that residual, and the
eager rule is checked not to propose it (the search's alone).
"""
from __future__ import annotations

import numpy as np
import sympy

from proofs._core import Failed, Proof, numeric, refuses, sample, sym_ctx, sym_inputs

RULE = "recompute"


def _programs():
    import napkin as nk
    from napkin.frontend import ops
    n, d = nk.axes("n d")

    def layernorm(X, G):
        xc = ops.sub(X, ops.mean(X, d))
        r = ops.rsqrt(ops.add_const(ops.mean(ops.square(xc), d), 1e-5))
        return ops.mul(ops.mul(xc, r), G)

    def also_output(X, Y):
        t = ops.tanh(ops.sub(X, Y))
        return ops.sum_(t, d), t
    return [(nk.trace(layernorm, {"X": (n, d), "G": (d,)}, "layernorm"), "sub"),
            (nk.trace(also_output, {"X": (n, d), "Y": (n, d)}, "tanh read twice"), "tanh")]


def _site_of(D, name):
    from napkin.core.ir import ops as op_order, view
    g = view(D)
    return next(i for i, m in enumerate(op_order(g)) if g.nodes[m]["box"].name == name)


def _rewritten(D, index):
    from napkin.core.region import Site
    from rewrites import RULES
    return RULES[RULE].apply(D, Site((), (index,)), {})


def _symbolic_equal(D, R, sizes):
    from napkin.core.semantics import run
    ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
    for u, v in zip(run(D, ctx, *xs), run(R, ctx, *xs)):
        for s, t in zip(np.asarray(u).flat, np.asarray(v).flat):
            if sympy.simplify(sympy.sympify(s) - sympy.sympify(t)) != 0:
                raise Failed(f"expressions differ: {s} against {t}")


def _swapped_copy(D, index):
    """A wrong recompute: the copy of a subtraction reads its inputs the other way round."""
    from discopy import markov
    from napkin.core.ir import ops as op_order, to_diagram, to_graph
    from napkin.core.op import make_op
    R = _rewritten(D, index)
    g = to_graph(R)
    subs = [m for m in op_order(g) if g.nodes[m]["box"].name == "sub"]
    node = g.nodes[subs[-1]]
    node["ins"] = list(reversed(node["ins"]))
    box = node["box"]
    node["box"] = make_op(box.spec, markov.Ty(*(g.nodes[v]["ob"] for v in node["ins"])),
                          [ob.name for ob in box.cod.inside], box.name)
    return to_diagram(g)


def prove():
    from napkin.core.ir import ops as op_order, view
    proof = Proof(RULE, __name__, __doc__)
    cases = [(D, _site_of(D, name)) for D, name in _programs()]

    def structure():
        out = []
        for D, i in cases:
            g0 = view(D)
            box = g0.nodes[op_order(g0)[i]]["box"]
            R = _rewritten(D, i)
            g = view(R)
            copies = [m for m in op_order(g) if g.nodes[m]["box"] is box]
            if len(copies) != 2:
                raise Failed(f"{D}: {len(copies)} copies of {box.name}, not one per reader")
            if len({tuple(g.nodes[m]["ins"]) for m in copies}) != 1:
                raise Failed("the copies read different wires")
            if any(len(list(g.successors(g.nodes[m]["outs"][0]))) > 1 for m in copies):
                raise Failed("a copy is still read twice")
            if R.dom != D.dom or R.cod != D.cod:
                raise Failed("the program's type changed")
            out.append(f"{box.name}: 2 copies of the one box on the same wires")
        return "; ".join(out)
    proof.check("each copy is the original box on the original input wires", structure,
                "structure")

    def symbolic():
        for D, i in cases:
            _symbolic_equal(D, _rewritten(D, i), {"n": 2, "d": 3})
        return "LayerNorm and a value also read as an output, |n| = 2, |d| = 3: equal"
    proof.check("identical sympy expressions on symbolic entries", symbolic)

    def bits():
        out = []
        for D, i in cases:
            xs = sample(D, {"n": 5, "d": 7}, np.random.default_rng(21))
            out.append(numeric(D, _rewritten(D, i), xs, tol=0))
        return "; ".join(out)
    proof.check("bit-identical float64 results (JAX)", bits, "numeric")

    def wrong():
        D, i = cases[0]
        try:
            _symbolic_equal(D, _swapped_copy(D, i), {"n": 2, "d": 3})
        except Failed as e:
            return f"a copy with its inputs swapped is caught: {str(e)[:120]}"
        raise Failed("a copy of x − μ computing μ − x passed the comparison")
    proof.check("a wrong variant (a subtraction's copy on swapped inputs) fails", wrong,
                "numeric")

    def premises():
        from napkin.core.region import Site
        from rewrites import RULES
        D, i = cases[0]
        rule = RULES[RULE]
        return "; ".join([
            refuses(lambda: rule.check(D, Site((), (_site_of(D, "rsqrt"),)), {}), "read once"),
            refuses(lambda: rule.check(D, Site((), (_site_of(D, "mean_d"),)), {}),
                    "not an elementwise box"),
            refuses(lambda: rule.check(D, Site((), (i, i + 1)), {}), "one box")])
    proof.check("premises enforced: a value read once, a reduction, a site of two boxes",
                premises, "premise")
    _products(proof)
    _wide(proof)
    return proof.result()


def _copied_alike(D, R, at, sym_sizes: dict, num_sizes: dict, seed: int) -> str:
    """That ``R`` is ``D`` with its box at ``at`` copied once per reader (two readers), each
    copy on the original's wires, and means the same: on symbolic entries, then in float64
    bit for bit (the numeric comparison's words)."""
    from napkin.core.ir import ops as op_order, view
    g0, g = view(D), view(R)
    box = g0.nodes[op_order(g0)[at]]["box"]
    copies = [m for m in op_order(g) if g.nodes[m]["box"] is box]
    if len(copies) != 2 or len({tuple(g.nodes[m]["ins"]) for m in copies}) != 1:
        raise Failed(f"{len(copies)} copies of {box.name}, not one per reader on the same "
                     f"wires")
    _symbolic_equal(D, R, sym_sizes)
    return numeric(D, R, sample(D, num_sizes, np.random.default_rng(seed)), tol=0)


def _products(proof):
    """recompute_product's obligations, on the scores a backward pass reads twice."""
    import napkin as nk
    from napkin.core.region import Site
    from napkin.frontend import ops
    from rewrites import RULES
    q, x, d = nk.axes("q x d")

    def scores(Q, K):
        S = ops.contract(Q, K, out=(q, x))
        L = ops.logsumexp(S, x)
        return ops.exp(ops.sub(S, L))
    D = nk.trace(scores, {"Q": (q, d), "K": (x, d)}, "S read twice")
    rule = RULES["recompute_product"]
    R = rule.apply(D, Site((), (0,)), {})

    def structure():
        same = _copied_alike(D, R, 0, {"q": 2, "x": 3, "d": 2}, {"q": 5, "x": 7, "d": 3}, 22)
        return f"Q·Kᵀ: 2 copies on the same wires; symbolic entries equal; {same}"
    proof.check("recompute_product: a product read twice, one copy per reader, same meaning",
                structure, "numeric")

    def premises():
        return "; ".join([
            refuses(lambda: rule.check(D, Site((), (2,)), {}), "not a contraction"),
            refuses(lambda: rule.check(R, Site((), (0,)), {}), "read once")])
    proof.check("recompute_product's premises: an elementwise box, a product read once",
                premises, "premise")


def _wide(proof):
    """recompute_wide's obligations, on a pre-norm residual read by the norm and the GEMM."""
    import napkin as nk
    from napkin.core.region import Site
    from napkin.frontend import ops
    from rewrites import RULES
    t, e, f = nk.axes("t e f")

    def residual(X, O, W):
        h = ops.add(X, O)
        r = ops.rsqrt(ops.add_const(ops.mean(ops.square(h), e), 1e-6))
        return ops.contract(ops.mul(h, r), W, out=(t, f))
    D = nk.trace(residual, {"X": (t, e), "O": (t, e), "W": (e, f)}, "x + o read twice")
    at = _site_of(D, "add")
    rule = RULES["recompute_wide"]

    def structure():
        R = rule.apply(D, Site((), (at,)), {})
        same = _copied_alike(D, R, at, {"t": 2, "e": 2, "f": 2}, {"t": 5, "e": 7, "f": 3}, 23)
        eager = [site.ops for site, _ in RULES[RULE].candidates(D)]
        if (at,) in eager or (at,) not in [site.ops for site, _ in rule.candidates(D)]:
            raise Failed("the eager recompute proposes x + o, or recompute_wide does not")
        return (f"x + o: 2 copies on the same wires; symbolic entries equal; left to the "
                f"search; {same}")
    proof.check("recompute_wide: a residual read twice, one copy per reader, same meaning",
                structure, "numeric")
