"""Logsumexp streams: state (μ, z) = (running max, Σ exp(x − μ)).

Statement.  For L with a reduced axis x, the accumulator of
``rewrites.logsumexp`` — init (−∞, 0); per chunk y:
μ′ = max(μ, max_j y_j), m = μ′ if finite else 0, z′ = z·exp(μ − m) +
Σ_j exp(y_j − m); finalize μ + log z — computes log Σ_x exp L for every length
of x, every chunking and every number of chunks.  On real entries m = μ′ (the
symbolic part); rows that have seen only −∞ shift by 0 and end at −∞, as
logsumexp does, which the numeric part checks with −∞ rows and NaN entries.

Proof.  state(x) := update(init, x) = (M, Σ_j e^{x_j − M}) with M = max x
(δ = e^{−∞ − M} = 0 annihilates the initial z = 0).  The law
update(state(x), y) = state(x ⊕ y): μ′ = max(M, max y) = max(x ⊕ y) by
associativity of max, and z·δ = Σ_j e^{x_j − M}·e^{M − μ′} = Σ_j e^{x_j − μ′}
term by term (the Max atoms cancel in the exponent, whatever the lengths), so
z′ = Σ_{x ⊕ y} e^{· − μ′}.  Induction on the number of chunks gives the
fold.  Finalize: μ + log Σ_j e^{x_j − μ} = log Σ_j e^{x_j}; sympy does not
merge logs of sums, so that last equality is checked after exp (injective on
the reals): e^μ·Σ_j e^{x_j − μ} = Σ_j e^{x_j}.

The accumulator is taken from the rule (``stream_partition`` applied to
logsumexp_x L) and checked on symbolic entries at (|x|, |y|) ∈
{(1,1),(1,2),(2,1),(2,2),(3,1)}, folds (1,1,1), (2,1,2), (1,3) and the Stream
box with ragged chunks.  Numeric checks through ``napkin.core.semantics.evaluate``:
float64 at random sizes, entries offset by ±1e4 (where exp overflows), fully
masked rows (−1e30 everywhere: the result −1e30 + log |x|) and bfloat16.
"""
from __future__ import annotations

import numpy as np

from proofs._core import (CHUNK, SIZES, Failed, Proof, accumulator_obligations, as_f64, bf16,
                          merge_checks, numeric, ragged, sample,
                          stream_rule)

RULE = "logsumexp"


def generic(dtype="f64", padding=False, offset=None):
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    n, x = axes("n x")

    def f(L, *valid):
        if offset is not None:
            L = ops.add_const(L, offset, as_="L")
        if padding:
            L = ops.padding_mask(L, valid[0], as_="L")
        return ops.logsumexp(L, x, as_="l")
    ins = {"L": Array(n, x, dtype=dtype)}
    if padding:
        ins["valid"] = Array(n, x, dtype=dtype)
    return trace(f, ins, "logsumexp_x")


def prove():
    proof = Proof(RULE, __name__, __doc__)
    box = {}

    def derive():
        box["st"] = st = stream_rule(generic(), "x")
        if st.spec.rule != RULE:
            raise Failed(f"stream_partition used the accumulator {st.spec.rule!r}")
        return f"stream_partition claims logsumexp_x with {st.spec.rule}"
    proof.check("the accumulator is the one stream_partition builds for logsumexp_x L", derive,
                "structure")
    if "st" in box:
        accumulator_obligations(proof, box["st"], {"n": 1}, "logsumexp_x L")
        merge_checks(proof, box["st"], {"n": 4, "x": 9}, "logsumexp_x L")

    rng = np.random.default_rng(12)
    sizes, tiles = {"n": SIZES["n"], "x": SIZES["x"]}, {"s_x": CHUNK}

    def streamed(D):
        return stream_rule(D, "x").rewritten

    def random_sizes():
        nx, c = ragged(rng, 4, 11)
        D = generic()
        sz = {"n": int(rng.integers(1, 5)), "x": nx}
        return f"{sz}, s_x={c}: " + numeric(D, streamed(D), sample(D, sz, rng),
                                            sizes_rhs={"s_x": c}, tol=1e-12)
    proof.check("float64 at random sizes, ragged last chunk (JAX)", random_sizes, "numeric")

    def large():
        out = []
        for off in (1e4, -1e4):
            D = generic(offset=off)
            out.append(f"{off:+g}: " + numeric(D, streamed(D), sample(D, sizes, rng, scale=5.0),
                                               sizes_rhs=tiles, tol=1e-12))
        return "; ".join(out)
    proof.check("entries around ±1e4 (float64)", large, "numeric")

    def masked():
        D = generic(padding=True)
        valid = np.ones((sizes["n"], sizes["x"]))
        valid[0], valid[1, :CHUNK] = 0, 0
        return numeric(D, streamed(D), sample(D, sizes, rng, overrides={"valid": valid}),
                       sizes_rhs=tiles, tol=1e-12)
    proof.check("a fully masked row and masked first chunks (padding, float64)", masked,
                "numeric")

    def infinities():
        D = generic()
        L = sample(D, {**sizes, "n": 4}, rng)[0]
        L[0] = -np.inf                       # a row of −∞: logsumexp −∞
        L[1, :CHUNK] = -np.inf               # a first chunk of −∞, then finite entries
        L[2, -1] = -np.inf                   # −∞ in the last, ragged chunk
        L[3, 1] = np.nan                     # a NaN: NaN, as jax's logsumexp gives
        return numeric(D, streamed(D), [L], sizes_rhs=tiles, tol=1e-12, nonfinite=True)
    proof.check("−∞ entries, a first chunk and a whole row of −∞, a NaN entry: the same "
                "values, −∞ and NaN as logsumexp (float64)", infinities, "numeric")

    def low():
        D16, D64 = generic("bf16"), generic("f64")
        x16 = bf16(sample(D64, sizes, rng))
        a = numeric(D64, streamed(D16), as_f64(x16), x16, sizes_rhs=tiles, tol=2e-2)
        return f"streamed bf16 vs the float64 meaning: {a}"
    proof.check("bfloat16 inputs, float32 state (tolerance 2e-2 relative)", low, "numeric")
    return proof.result()
