"""Stream partition with fusion: a streamable region folds over chunks.

Statement.  Let R be a convex region and x an axis that some input of R
carries and no output keeps.  Suppose ``rewrites.stream_partition`` splits
R's boxes into claims C₁ … C_m (reductions over x, each with an accumulator
(init_i, update_i, finalize_i) of a streamability rule), pre boxes P (woven
over x, independent along it, reading no claim output) and post boxes Q
(touching no value that carries x).  Then the Stream box it builds —
init = (init_1, …, init_m); update = P on the chunk, then each update_i on
its claim's inputs; finalize = each finalize_i, then Q — equals R for every
length of x, chunk size and ragged last chunk (the fusion theorem).

Proof.  (1) R factors as Q ∘ (r₁ ⊗ … ⊗ r_m) ∘ P up to wiring, with r_i the
reduction claimed by C_i: pre boxes read no reduction, post boxes read no
value carrying x, and every box is a claim, pre or post.  (2) P commutes
with slicing along x, with the chunk's global offset (the group-partition
lemma, proofs/group_partition.py: P is woven over x and independent along
it), so P applied chunk by chunk yields exactly the chunks of P's output on
the whole axis.  (3) Each claimed accumulator satisfies
finalize_i(fold update_i over chunks) = r_i(concatenation) — proved in its
own module (proofs/sum_contraction.py, max_reduce.py, logsumexp.py,
softmax_contraction.py), for every length and number of chunks.  The
product of accumulators folds componentwise (update_i reads only its own
state and the chunk), so it computes (r₁, …, r_m) on P's output.  (4) Q then
sees the same values as in R.  Hence Stream = R.  The driver (proofs.prove_all)
requires a proof for every streamability rule, so (3) holds for every claim
the rule can make.

Checks: the rule is applied to programs exercising each part — linear
cross-entropy over v (pre: X·W woven over v; claims: logsumexp and a
contraction; post: a subtraction), causal attention over x (pre: QKᵀ, the
scale and an index-dependent mask that needs the chunk offsets; claim:
softmax·V), max + mean of exp X (two accumulators, a pre and a post
box), and ALiBi attention over x (positions along x: a pre box with no inputs,
replayed on every chunk at the chunk's offset; positions along q: invariant)
— and cross-entropy with integer labels over v (logsumexp and a take along v in one
pass; the label, an integer symbol, read whole by every chunk) — and the fused accumulator is verified on symbolic entries like any
accumulator (base case, law, folds, the Stream box with ragged chunks).
The premises are checked to be enforced.  Numerically, through
``napkin.core.semantics.evaluate``: linear cross-entropy (float64 at random sizes,
logits ~1e4; bfloat16), RMSNorm→matmul factored, grouped and streamed, and
causal attention grouped over queries then streamed over keys inside the
group (FlashAttention).
"""
from __future__ import annotations

import numpy as np

from proofs._core import (CHUNK, GROUP, SIZES, Failed, Proof, accumulator_obligations, apply_rule,
                          as_f64, bf16, library, numeric, ragged, refuses, sample, stream_rule)

RULE = "stream_partition"


def max_plus_mean(dtype="f64"):
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    n, x = axes("n x")

    def f(X):
        E = ops.exp(X, as_="E")
        return ops.add(ops.max_(X, x, as_="m"), ops.mean(E, x, as_="a"), as_="y")
    return trace(f, {"X": Array(n, x, dtype=dtype)}, "max + mean exp")


def prove():
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.library import get
    from napkin.frontend.trace import Array, trace
    proof = Proof(RULE, __name__, __doc__)
    cases = [("linear cross-entropy over v", library("linear_cross_entropy", "f64"), "v",
              {"n": 1, "d": 2}, {"logsumexp", "sum_contraction"}),
             ("causal attention over x", library("causal_attention", "f64"), "x",
              {"q": 2, "d": 1}, {"softmax_contraction"}),
             ("max_x X + mean_x exp X", max_plus_mean(), "x", {"n": 1}, {"max", "sum_contraction"}),
             ("ALiBi attention over x", library("alibi_attention", "f64"), "x",
              {"h": 1, "q": 2, "d": 1}, {"softmax_contraction"}),
             ("cross-entropy with integer labels over v", library("cross_entropy", "f64"), "v",
              {"n": 1}, {"logsumexp", "sum_contraction"})]
    for what, D, axis, sizes, rules in cases:
        box = {}

        def derive(D=D, axis=axis, rules=rules, box=box):
            st = stream_rule(D, axis)
            used = set(st.spec.rule.split("+"))
            if used != rules:
                raise Failed(f"accumulators {sorted(used)}, expected {sorted(rules)}")
            box["st"] = st
            return f"one Stream box with accumulators {st.spec.rule}"
        proof.check(f"{what}: the region becomes one Stream box of the expected accumulators",
                    derive, "structure")
        if "st" in box:
            accumulator_obligations(proof, box["st"], sizes, what,
                                    lengths=(1, 2), pairs=((1, 1), (1, 2), (2, 1)),
                                    folds=((1, 1, 1), (2, 1)), uniform=((3, 2),))

    n, v, x = axes("n v x")

    def premises():
        out = []
        D = trace(lambda X: ops.softmax(X, v), {"X": Array(n, v)}, "softmax")
        out.append(refuses(lambda: stream_rule(D, "v"), "keeps axis v"))
        D = trace(lambda X: ops.sum_(ops.exp(ops.sub(X, ops.max_(X, v))), v), {"X": Array(n, v)},
                  "manual softmax denominator")
        out.append(refuses(lambda: stream_rule(D, "v"), "depends on a reduction"))
        D = trace(lambda X: ops.max_(ops.softmax(X, v), v), {"X": Array(n, v)}, "max softmax")
        out.append(refuses(lambda: stream_rule(D, "v"), "no streamability rule covers"))
        return "; ".join(out)
    proof.check("premises enforced: an output keeping the axis, a pre box reading a reduction, "
                "a mixing box no rule covers are refused", premises, "premise")

    rng = np.random.default_rng(17)
    lce = get("linear_cross_entropy")

    def lce_numeric():
        nv, c = ragged(rng, 4, 11)
        sz = {"n": int(rng.integers(1, 5)), "d": int(rng.integers(1, 4)), "v": nv}
        D = library("linear_cross_entropy", "f64")
        xs = lce.sample(rng, sz)
        xs[0] = xs[0] * 100.0   # logits X·W of size ~1e2..1e4
        return f"{sz}, s_v={c}: " + numeric(D, stream_rule(D, "v").rewritten, xs,
                                            sizes_rhs={"s_v": c}, tol=1e-12)
    proof.check("linear cross-entropy streamed over v, float64 at random sizes, large logits, "
                "ragged last chunk (JAX)", lce_numeric, "numeric")

    def lce_low():
        sz = {"n": SIZES["n"], "d": SIZES["d"], "v": SIZES["v"]}
        D16, D64 = library("linear_cross_entropy", "bf16"), library("linear_cross_entropy", "f64")
        x16 = bf16(lce.sample(rng, sz))
        R = stream_rule(D16, "v").rewritten
        a = numeric(D64, R, as_f64(x16), x16, sizes_rhs={"s_v": CHUNK}, tol=2e-2)
        return f"{sz}, s_v={CHUNK}: vs the float64 meaning {a}"
    proof.check("linear cross-entropy streamed over v, bfloat16 (tolerance 2e-2)", lce_low,
                "numeric")

    def rms():
        D = library("rmsnorm_matmul", "f64")
        R = apply_rule("normalized_contraction", D, {}, ops=(6,))
        R = apply_rule("group_partition", R, {"axis": "n"})
        R = apply_rule(RULE, R, {"axis": "d"}, path=(0,))
        sz = {"n": SIZES["n"], "d": SIZES["x"], "e": SIZES["e"]}
        return f"{sz}, g_n={GROUP}, s_d={CHUNK}: " + numeric(
            D, R, sample(D, sz, rng), sizes_rhs={"g_n": GROUP, "s_d": CHUNK}, tol=1e-12)
    proof.check("RMSNorm→matmul: factored, grouped over n, streamed over d with pre and post "
                "boxes (float64, JAX)", rms, "numeric")

    def flash():
        D = library("causal_attention", "f64")
        R = apply_rule("group_partition", D, {"axis": "q"})
        R = apply_rule(RULE, R, {"axis": "x"}, path=(0,))
        sz, g = {k: SIZES[k] for k in "qxd"}, SIZES["q"] // 2
        return f"{sz}, g_q={g}, s_x={CHUNK}: " + numeric(
            D, R, sample(D, sz, rng), sizes_rhs={"g_q": g, "s_x": CHUNK}, tol=1e-12)
    proof.check("causal attention grouped over q, then streamed over x inside the group "
                "(FlashAttention; the mask reads both offsets) (float64, JAX)", flash, "numeric")

    def alibi():
        alg = get("alibi_attention")
        D = library("alibi_attention", "f64")
        R = apply_rule("group_partition", D, {"axis": "q"})
        R = apply_rule(RULE, R, {"axis": "x"}, path=(0,))
        sz, g = {"h": 2, **{k: SIZES[k] for k in "qxd"}}, SIZES["q"] // 2 + 1
        return f"{sz}, g_q={g}, s_x={CHUNK}: " + numeric(
            D, R, alg.sample(rng, sz), sizes_rhs={"g_q": g, "s_x": CHUNK}, tol=1e-12)
    proof.check("ALiBi attention grouped over q, streamed over x: positions along x replayed "
                "per chunk at its offset, along q per group (float64, ragged)", alibi, "numeric")
    return proof.result()
