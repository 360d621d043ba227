"""Normalised contraction: Σ_x (n_x / D)·v_x = (Σ_x n_x·v_x) / D when D lacks x.

Statement.  Let a contraction C sum over axes X (the input axes missing from
its output) and let one of its inputs be div(n, D), mul(n, D) or mul(D, n),
used only there, where D has no axis of X and every axis of D is an output
axis of C.  Then C(…, n∘D, …) = C(…, n, …) ∘ D, with ∘ the same division or
multiplication applied to the output (D broadcast over the other output
axes).  This is the rewrite of ``rewrites.normalized_contraction``.

Proof.  Fix an output index o; D's axes are among the output axes, so D
contributes the single number D[o|_D] to every term of the sum defining
C[o]: C[o] = Σ_{i ∈ X} n[o, i]·(1/D[o])·Π v[o, i] = (1/D[o])·Σ_{i ∈ X}
n[o, i]·Π v[o, i] by distributivity (D ≠ 0 wherever the left side is
defined).  The identity is term-wise, so it holds for every size of every
axis; the symbolic checks confirm that the rule builds exactly this
right-hand side — the rule is applied to generic programs (division, and
multiplication with the factor on either side; a factor with an extra
output axis) and to ``rmsnorm_matmul`` (where D = rsqrt(mean(x²) + ε)), both
sides are evaluated with the SYMPY backend on symbolic entries and their
difference is put over a common denominator and expanded to 0.  The
premises are checked to be enforced (the rule refuses a factor that carries
a summed axis).  Numeric checks through ``napkin.core.semantics.evaluate``:
RMSNorm→matmul in float64 and bfloat16, and sigmoid-normalised attention,
which after this rewrite streams over x with the two plain sums (o, z)
(B((o, z), (x, y)) = (o + Σ a₁(x)·y, z + Σ a₂(x)), result o / z), against the
un-rewritten program.
"""
from __future__ import annotations

import numpy as np

from proofs._core import (CHUNK, SIZES, Failed, Proof, apply_rule, as_f64, bf16, compare, library,
                          numeric, refuses, sample, stream_rule, sym_ctx, sym_inputs)

RULE = "normalized_contraction"


def factored(kind: str, dtype="f64"):
    """contract(n ∘ D, V) over x, with ∘ = div or mul, D[q] (or D[q,d])."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    q, x, d = axes("q x d")
    f = {"div": lambda N, D: ops.div(N, D), "mul": lambda N, D: ops.mul(N, D),
         "mul_left": lambda N, D: ops.mul(D, N), "div_qd": lambda N, D: ops.div(N, D),
         "div_qx": lambda N, D: ops.div(N, D)}[kind]
    dax = {"div_qd": (q, d), "div_qx": (q, x)}.get(kind, (q,))
    n_ax = (q, x, d) if kind == "div_qd" else (q, x)
    return trace(lambda N, D, V: ops.contract(f(N, D), V, out=(q, d), as_="O"),
                 {"N": Array(*n_ax, dtype=dtype), "D": Array(*dax, dtype=dtype),
                  "V": Array(x, d, dtype=dtype)}, f"factor {kind}")


def contraction_site(D):
    """The op index of the (last) contraction."""
    from napkin.core.ir import ops as op_order, to_graph
    g = to_graph(D)
    idx = [i for i, n in enumerate(op_order(g)) if g.nodes[n]["box"].spec.kind == "contract"]
    return idx[-1]


def rewrite(D):
    return apply_rule(RULE, D, {}, ops=(contraction_site(D),))


def sigmoid_attention(dtype="f64"):
    """P = sigmoid(S) / Σ_x sigmoid(S); O = P·V (a normaliser instead of softmax)."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    import sympy
    q, x, d = axes("q x d")

    def f(Q, K, V):
        S = ops.scale(ops.contract(Q, K, out=(q, x), as_="S"), 1 / sympy.sqrt(d.size), as_="S")
        A = ops.sigmoid(S, as_="A")
        P = ops.div(A, ops.sum_(A, x, as_="Z"), as_="P")
        return ops.contract(P, V, out=(q, d), as_="O")
    return trace(f, {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
                     "V": Array(x, d, dtype=dtype)}, "sigmoid attention")


def prove():
    from napkin.core.semantics import run
    proof = Proof(RULE, __name__, __doc__)

    def symbolic(D, sizes):
        R = rewrite(D)
        last = [b for b in R.boxes if getattr(b, "spec", None) is not None][-1]
        if last.spec.kind != "zip" or last.spec.fn not in ("div", "mul"):
            raise Failed(f"the rewritten program does not end with the factor: {last.name}")
        ctx = sym_ctx(sizes)
        xs = sym_inputs(D, sizes)
        return compare(run(R, ctx, *xs), run(D, ctx, *xs), sizes)

    for kind, label in (("div", "contract(div(N[q,x], D[q]), V[x,d])"),
                        ("mul", "contract(mul(N[q,x], D[q]), V[x,d])"),
                        ("mul_left", "contract(mul(D[q], N[q,x]), V[x,d])"),
                        ("div_qd", "contract(div(N[q,x,d], D[q,d]), V[x,d]) (D on two output axes)")):
        proof.check(f"lhs = rhs on symbolic entries: {label}",
                    lambda kind=kind: symbolic(factored(kind), {"q": 2, "x": 3, "d": 2}))
    rms = library("rmsnorm_matmul", "f64")
    proof.check("lhs = rhs on symbolic entries: rmsnorm_matmul (D = rsqrt(mean_d x² + ε))",
                lambda: symbolic(rms, {"n": 1, "d": 3, "e": 2}))

    def premise():
        return refuses(lambda: rewrite(factored("div_qx")), "cannot factor")
    proof.check("premise enforced: a factor D[q,x] carrying the summed axis is refused", premise,
                "premise")

    rng = np.random.default_rng(14)

    def rms_numeric():
        sz = {"n": SIZES["n"], "d": SIZES["d"] + 4, "e": SIZES["e"]}
        xs = sample(rms, sz, rng)
        a = numeric(rms, rewrite(rms), xs, tol=1e-12)
        R16 = rewrite(library("rmsnorm_matmul", "bf16"))
        x16 = bf16(xs)
        b = numeric(rms, R16, as_f64(x16), x16, tol=2e-2)
        return f"{sz}: float64 {a}; bfloat16 vs the float64 meaning {b}"
    proof.check("rmsnorm_matmul rewritten, float64 and bfloat16 (tolerance 2e-2) (JAX)",
                rms_numeric, "numeric")

    def sigmoid_streamed():
        D = sigmoid_attention()
        R = rewrite(D)
        st = stream_rule(R, "x")
        if st.spec.rule != "sum_contraction":
            raise Failed(f"after factoring, stream_partition used {st.spec.rule!r}")
        sz = {k: SIZES[k] for k in "qxd"}
        return f"{sz}, s_x={CHUNK}, accumulator {st.spec.rule}: " + numeric(
            D, st.rewritten, sample(D, sz, rng), sizes_rhs={"s_x": CHUNK}, tol=1e-12)
    proof.check("sigmoid-normalised attention: factored, then streamed over x with (o, z), "
                "= the un-rewritten program (float64, ragged chunk)", sigmoid_streamed, "numeric")
    return proof.result()
