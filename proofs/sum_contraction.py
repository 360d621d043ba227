"""Sums and contractions stream: acc ← acc + Σ over the chunk.

Statement.  For a contraction whose output lacks the streamed axis x (it
sums over x), and for ``sum`` and ``mean`` over x, the accumulator of
``rewrites.sum_contraction`` — state acc of the output's type (float32 for
low-precision inputs), init 0, update acc′ = acc + (the same contraction or
sum restricted to the chunk), finalize the identity (a cast back to the
output dtype; for a mean, ·1/|x| with the FULL length |x|) — computes the
reduction for every length of x, every chunking and every number of chunks.

Proof.  A contraction over x is Σ_j t_j with t_j the product of the inputs'
entries at x = j (the other summed axes summed inside t_j), so for a
concatenation Σ_{x ⊕ y} = Σ_x + Σ_y: addition is associative and
commutative, with 0 as unit.  Hence state(x) := update(0, x) = Σ_x, and
update(state(x), y) = Σ_x + Σ_y = state(x ⊕ y) for chunks of any lengths;
induction on the number of chunks gives the fold.  A mean is
(1/|x|)·Σ_x with |x| the length of the whole axis (not of a chunk), which the
finalize uses.  The checks apply the rule (``stream_partition``) to three
generic programs — A[x,d]·B[x,e] → C[d,e], sum_x X and mean_x X — and verify
base case, accumulator law, folds and the Stream box on symbolic entries
(the identity is linear: expand decides it, term by term, for any lengths).
Numeric checks through ``napkin.core.semantics.evaluate``: a matmul streamed over
its contracted axis at random sizes with a ragged last chunk (float64), the
mean with a ragged chunk (the 1/|x| must be the full length), and bfloat16
inputs accumulated in float32.

take_along_axis over x is a sum too: take(X, i)[n] = Σ_j [o + j = i_n]·X[n, j]
with o the global offset of the piece (0 for the whole axis), so for chunks
x, y of lengths n₁, n₂ the terms of y carry o = n₁ and Σ_{x ⊕ y} = Σ_x + Σ_y
as before — provided the update reads the chunk's offset (the stream shifts
it, as it does for masks).  The symbolic check takes the index i_n as an
integer symbol: each term is Piecewise((X[n,j], Eq(i_n, o + j)), (0, True)),
identical on both sides term by term, so the law holds for every index value,
out-of-range ones (which pick 0) included.  A take that reads chunk-local
positions fails the law (proofs/wrong_variants.py).  Numerically: random
integer labels, a ragged last chunk, float64; the integer index passes the
float premise because it is read whole, not accumulated.
"""
from __future__ import annotations

import numpy as np

from proofs._core import (CHUNK, SIZES, Failed, Proof, accumulator_obligations, as_f64, bf16,
                          library, merge_checks, numeric, ragged, sample,
                          stream_rule)

RULE = "sum_contraction"


def contraction(dtype="f64"):
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    x, d, e = axes("x d e")
    return trace(lambda A, B: ops.contract(A, B, out=(d, e), as_="C"),
                 {"A": Array(x, d, dtype=dtype), "B": Array(x, e, dtype=dtype)}, "A·B")


def reduction(fn, dtype="f64"):
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    n, x = axes("n x")
    f = {"sum": ops.sum_, "mean": ops.mean}[fn]
    return trace(lambda X: f(X, x, as_="s"), {"X": Array(n, x, dtype=dtype)}, f"{fn}_x")


def take(dtype="f64"):
    """take_along_axis over x of X[n,x] at an integer index I[n]."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    n, x = axes("n x")
    return trace(lambda X, I: ops.take_along_axis(X, I, x, as_="t"),
                 {"X": Array(n, x, dtype=dtype), "I": Array(n, dtype="int32")}, "take_x")


def prove():
    proof = Proof(RULE, __name__, __doc__)
    cases = [("contraction A[x,d]·B[x,e] → C[d,e]", contraction(), {"d": 1, "e": 2}),
             ("sum_x X", reduction("sum"), {"n": 1}),
             ("mean_x X", reduction("mean"), {"n": 1}),
             ("take_along_axis_x(X, I) (I an integer symbol)", take(), {"n": 1})]
    streams = {}

    def derive():
        for what, D, _ in cases:
            st = stream_rule(D, "x")
            if st.spec.rule != RULE:
                raise Failed(f"{what}: stream_partition used the accumulator {st.spec.rule!r}")
            streams[what] = st
        return f"stream_partition claims {', '.join(streams)} with {RULE}"
    proof.check("the accumulators are the ones stream_partition builds", derive, "structure")
    for what, _, sizes in cases:
        if what in streams:
            accumulator_obligations(proof, streams[what], sizes, what,
                                    folds=((1, 1, 1), (2, 1, 2)), uniform=((5, 2),))
    for what in ("contraction A[x,d]·B[x,e] → C[d,e]", "sum_x X", "mean_x X"):
        if what in streams:
            merge_checks(proof, streams[what], {"x": 9, "d": 2, "e": 3, "n": 4}, what)

    rng = np.random.default_rng(13)

    def matmul():
        nb, c = ragged(rng, 4, 11)
        sz = {"a": int(rng.integers(1, 6)), "b": nb, "c": int(rng.integers(1, 5))}
        D = library("matmul", "f64")
        return f"{sz}, s_b={c}: " + numeric(D, stream_rule(D, "b").rewritten, sample(D, sz, rng),
                                            sizes_rhs={"s_b": c}, tol=1e-12)
    proof.check("float64 matmul streamed over b at random sizes, ragged last chunk (JAX)", matmul,
                "numeric")

    def mean():
        sz = {"n": SIZES["n"], "x": SIZES["x"]}
        D = reduction("mean")
        return f"{sz}, s_x={CHUNK}: " + numeric(D, stream_rule(D, "x").rewritten,
                                                sample(D, sz, rng, scale=1e4),
                                                sizes_rhs={"s_x": CHUNK}, tol=1e-12)
    proof.check("mean with a ragged last chunk divides by the full length (float64, entries "
                "~1e4)", mean, "numeric")

    def low():
        sz = {k: SIZES[k] for k in "abc"}
        D16, D64 = library("matmul", "bf16"), library("matmul", "f64")
        x16 = bf16(sample(D64, sz, rng))
        R = stream_rule(D16, "b").rewritten
        a = numeric(D64, R, as_f64(x16), x16, sizes_rhs={"s_b": CHUNK}, tol=2e-2)
        return f"streamed bf16 vs the float64 meaning: {a}"
    proof.check("bfloat16 matmul, float32 accumulator (tolerance 2e-2 relative)", low, "numeric")

    def taken():
        nx, c = ragged(rng, 4, 11)
        sz = {"n": 6, "x": nx}
        D = take()
        X, _ = sample(D, sz, rng)
        index = np.arange(6) % nx   # every chunk, the ragged last one included
        index[-1] = nx - 1
        return f"{sz}, s_x={c}: " + numeric(D, stream_rule(D, "x").rewritten,
                                            [X, index.astype(np.int32)],
                                            sizes_rhs={"s_x": c}, tol=1e-12)
    proof.check("take_along_axis streamed over x: labels in every chunk, a ragged last chunk "
                "(float64 values, int32 index)", taken, "numeric")
    return proof.result()
