"""Max streams: m ← max(m, max over the chunk), from m = −∞.

Statement.  For X with a reduced axis x, the accumulator of
``rewrites.max_reduce`` — state m, init −∞, update m′ = max(m, max_j y_j)
for a chunk y, finalize the identity — computes max_x X for every length of
x, every chunking and every number of chunks.

Proof.  state(x) := update(init, x) = max(−∞, max x) = max x.  The law
update(state(x), y) = max(max x, max y) = max(x ⊕ y) = state(x ⊕ y) is the
associativity of max with −∞ as its unit: as sympy expressions, nested Max
flatten to one Max over the multiset of entries (the canonical form), so the
check on symbolic entries at (|x|, |y|) ∈ {(1,1),(1,2),(2,1),(2,2),(3,1)}
compares canonical forms exactly and covers the only algebra involved —
Max(Max(A), Max(B)) = Max(A ∪ B) — which is the same for any sizes of A and
B.  Induction on the number of chunks gives the fold; finalize is the
identity.  The state is float32 (float64 for float64 inputs): max of
bfloat16 values is exact in float32, so the streamed result equals the
un-streamed one up to the final rounding.

The accumulator is taken from the rule (``stream_partition`` applied to
max_x X); numeric checks run both sides through ``napkin.core.semantics.evaluate``
with entries around ±1e4, fully masked rows (−1e30 everywhere) and bfloat16.
"""
from __future__ import annotations

import numpy as np

from proofs._core import (CHUNK, SIZES, Failed, Proof, accumulator_obligations, as_f64, bf16,
                          merge_checks, numeric, ragged, sample,
                          stream_rule)

RULE = "max"


def generic(dtype="f64", padding=False, offset=None):
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    n, x = axes("n x")

    def f(X, *valid):
        if offset is not None:
            X = ops.add_const(X, offset, as_="X")
        if padding:
            X = ops.padding_mask(X, valid[0], as_="X")
        return ops.max_(X, x, as_="m")
    ins = {"X": Array(n, x, dtype=dtype)}
    if padding:
        ins["valid"] = Array(n, x, dtype=dtype)
    return trace(f, ins, "max_x")


def derive(proof, box):
    def f():
        box["st"] = st = stream_rule(generic(), "x")
        if st.spec.rule != RULE:
            raise Failed(f"stream_partition used the accumulator {st.spec.rule!r}")
        return f"stream_partition claims max_x with {st.spec.rule}"
    proof.check("the accumulator is the one stream_partition builds for max_x X", f, "structure")
    return box.get("st")


def prove():
    proof = Proof(RULE, __name__, __doc__)
    st = derive(proof, {})
    if st is not None:
        accumulator_obligations(proof, st, {"n": 1}, "max_x X")
        merge_checks(proof, st, {"n": 4, "x": 9}, "max_x X")
    rng = np.random.default_rng(11)
    sizes, tiles = {"n": SIZES["n"], "x": SIZES["x"]}, {"s_x": CHUNK}

    def random_sizes():
        nx, c = ragged(rng, 4, 11)
        D = generic()
        sz = {"n": int(rng.integers(1, 5)), "x": nx}
        return f"{sz}, s_x={c}: " + numeric(D, stream_rule(D, "x").rewritten, sample(D, sz, rng),
                                            sizes_rhs={"s_x": c}, tol=0)
    proof.check("float64 at random sizes, ragged last chunk (JAX; exact)", random_sizes, "numeric")

    def large():
        out = []
        for off in (1e4, -1e4):
            D = generic(offset=off)
            out.append(f"{off:+g}: " + numeric(D, stream_rule(D, "x").rewritten,
                                               sample(D, sizes, rng), sizes_rhs=tiles, tol=0))
        return "; ".join(out)
    proof.check("entries around ±1e4 (float64; exact)", large, "numeric")

    def masked():
        D = generic(padding=True)
        valid = np.ones((sizes["n"], sizes["x"]))
        valid[0], valid[1, :CHUNK] = 0, 0
        return numeric(D, stream_rule(D, "x").rewritten,
                       sample(D, sizes, rng, overrides={"valid": valid}), sizes_rhs=tiles, tol=0)
    proof.check("a fully masked row and masked first chunks (padding, float64; exact)", masked,
                "numeric")

    def low():
        D16, D64 = generic("bf16"), generic("f64")
        x16 = bf16(sample(D64, sizes, rng))
        a = numeric(D64, stream_rule(D16, "x").rewritten, as_f64(x16), x16, sizes_rhs=tiles,
                    tol=2e-2)
        return f"streamed bf16 vs the float64 meaning: {a}"
    proof.check("bfloat16 inputs, float32 state (tolerance 2e-2 relative)", low, "numeric")
    return proof.result()
