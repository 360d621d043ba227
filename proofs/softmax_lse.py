"""Softmax through its logsumexp preserves meaning: softmax_x(S) = guard(exp(S − L), L) with
L = logsumexp_x(S).

Statement.  For every row of S along x, ``rewrites.softmax_lse`` replaces softmax_x(S)
by exp(S − L) with L = log Σ_x exp(S), zeroed where L is at most the mask threshold, and
the programs denote the same function.

Proof.  On a row with finite entries, exp(s − L) = exp(s) / Σ_x exp(s') — softmax's
definition — and the symbolic check confirms it entry by entry on the real rule's
output (rows of 3, symbolic entries; sympy compares exp of both sides).  The guard:
softmax zeroes a row whose maximum m is at most the threshold −5·10²⁹ (the mask's fill
−10³⁰, or −∞); L = m + log Σ exp(s − m) lies in [m, m + log|x|], and |x| < 10²⁹, so
L is at most the threshold exactly when m is (for m = −∞, L = −∞) — the two guards zero
the same rows.  A row with a +∞ score has softmax NaN throughout (∞ − ∞ in its shift), and
L = +∞: the shift adds L − L, which is 0 for a finite L and NaN for L = +∞.  Numerically (float64): random rows, rows of ±10⁴, rows with masked
entries, rows masked whole and rows of −∞ agree; the premises (a softmax read once by
a box reducing its axis, a softmax with a sink, a site of two boxes) are refused.  A wrong
variant (the shift by the row maximum instead of L) fails both checks.
"""
from __future__ import annotations

import numpy as np

from proofs._core import Failed, Proof, compare, numeric, refuses, sym_ctx, sym_inputs

RULE = "softmax_lse"


def _programs():
    import napkin as nk
    from napkin.frontend import ops
    q, x, d = nk.axes("q x d")

    def backward_like(S, V):  # P read twice: by P·V and as an output (a backward's dS)
        P = ops.softmax(S, x)
        return ops.contract(P, V, out=(q, d)), ops.mul(P, S)

    def transposed(S, G):  # P read once, summed over the other axis (dV = Pᵀ·dO)
        return ops.contract(ops.softmax(S, x), G, out=(x, d))
    return [nk.trace(backward_like, {"S": (q, x), "V": (x, d)}, "softmax read twice"),
            nk.trace(transposed, {"S": (q, x), "G": (q, d)}, "softmax summed over q")]


def _softmax_index(D):
    from napkin.core.ir import ops as op_order, view
    g = view(D)
    return next(i for i, n in enumerate(op_order(g)) if g.nodes[n]["box"].spec.kind == "softmax")


def _rewritten(D):
    from napkin.core.region import Site
    from rewrites import RULES
    return RULES[RULE].apply(D, Site((), (_softmax_index(D),)), {})


def _by_max(D):
    """A wrong variant: P = exp(S − max_x S), never normalised."""
    import napkin as nk
    from napkin.frontend import ops
    q, x, d = nk.axes("q x d")

    def wrong(S, V):
        P = ops.exp(ops.sub(S, ops.max_(S, x)))
        return ops.contract(P, V, out=(q, d)), ops.mul(P, S)
    return nk.trace(wrong, {"S": (q, x), "V": (x, d)}, "shifted by the max")


def _symbolic(D, R):
    from napkin.core.semantics import run
    sizes = {"q": 2, "x": 3, "d": 2}
    ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
    return compare(list(run(D, ctx, *xs)), list(run(R, ctx, *xs)), sizes)


def _rows(rng, shape):
    s = rng.standard_normal(shape)
    big = s * 1e4
    masked = s.copy()
    masked[:, : shape[1] // 2] = -1e30  # half of every row masked
    masked[0, :] = -1e30                # one row masked whole
    inf = s.copy()
    inf[1, :] = -np.inf                 # one row of −∞
    inf[2, 3] = np.inf                  # a +∞ score: softmax's row is NaN throughout
    inf[3, 0] = np.nan                  # a NaN score: NaN throughout too
    return [s, big, masked, inf]


def prove():
    from napkin.core.region import Site
    from rewrites import RULES
    proof = Proof(RULE, __name__, __doc__)
    cases = _programs()

    def symbolic():
        return "; ".join(_symbolic(D, _rewritten(D)) for D in cases)
    proof.check("exp(S − L) is softmax entry by entry (rows of 3, symbolic)", symbolic)

    def rows():
        rng = np.random.default_rng(5)
        out = []
        for D in cases:
            R = _rewritten(D)
            for s in _rows(rng, (4, 6)):
                other = rng.standard_normal((6, 3) if D is cases[0] else (4, 3))
                out.append(numeric(D, R, [s, other], tol=1e-12, nonfinite=True))
        return (f"{len(out)} cases (random, ±1e4, masked entries, masked rows, rows of −∞, "
                f"a +∞ and a NaN score)")
    proof.check("float64: random rows, ±1e4, masked rows, rows of −∞, +∞ and NaN agree", rows,
                "numeric")

    def wrong():
        D = cases[0]
        try:
            _symbolic(D, _by_max(D))
        except Failed as e:
            return f"the shift by the maximum instead of L is caught: {str(e)[:100]}"
        raise Failed("exp(S − max S) passed as softmax")
    proof.check("a wrong variant (exp(S − max S), not normalised) fails", wrong, "numeric")

    def premises():
        import napkin as nk
        from napkin.frontend import ops
        q, x, d = nk.axes("q x d")
        forward = nk.trace(lambda S, V: ops.contract(ops.softmax(S, x), V, out=(q, d)),
                           {"S": (q, x), "V": (x, d)}, "attention's P·V")
        sink = nk.trace(lambda S, s, V: ops.contract(ops.softmax(S, x, sink=s), V,
                                                     out=(x, d)),
                        {"S": (q, x), "s": (q,), "V": (q, d)}, "a sink")
        rule = RULES[RULE]
        return "; ".join([
            refuses(lambda: rule.check(forward, Site((), (0,)), {}), "read once"),
            refuses(lambda: rule.check(sink, Site((), (0,)), {}), "not a softmax"),
            refuses(lambda: rule.check(cases[0], Site((), (0, 1)), {}), "one box")])
    proof.check("premises enforced: attention's softmax·V, a sink, a site of two boxes",
                premises, "premise")
    return proof.result()
