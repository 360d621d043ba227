"""Softmax-contraction streams (the attention core, FlashAttention).

Statement.  Let f(s, v) = Σ_j softmax_j(s)·v_j, the softmax over the axis x of
scores s followed by a contraction over x with v (other axes woven).  The
accumulator of ``rewrites.softmax_contraction`` — state (μ, z, o), init
(−∞, 0, 0), per chunk y of scores with values w

    μ′ = max(μ, max_j y_j);  m = μ′ if finite else 0;  δ = exp(μ − m);
    z′ = δ·z + Σ_j exp(y_j − m);   o′ = δ·o + Σ_j exp(y_j − m)·w_j,

finalize o / z — computes f for every length of x, every chunking (ragged
last chunk included) and every number of chunks.  On real (finite) scores
m = μ′, which is what the symbolic part proves; the shift only differs once a
row has seen nothing but −∞ (δ and the exponentials are then exp(−∞) = 0,
where exp(μ − μ′) would be NaN), and the numeric part checks such rows: −∞
rows give zeros, as softmax does, and NaN rows give NaN.

Proof.  Write state(x) for the state after one chunk x from init:
state(x) = (M, Σ_j e^{x_j − M}, Σ_j e^{x_j − M} v_j) with M = max x (the −∞
of init makes δ = e^{−∞} = 0, which kills the zero state).  The state is a
function of the multiset of (score, value) pairs of x, so the fold over
chunks x₁, …, x_k equals state(x₁ ⊕ … ⊕ x_k) once the accumulator law

    update(state(x), y) = state(x ⊕ y)

holds for chunks x, y of any lengths n₁, n₂: induction on k, the base k = 1
being the definition of state.  The law itself: max(x ⊕ y) = max(M, max y)
= μ′, and every term of z·δ is e^{x_j − M}·e^{M − μ′} = e^{x_j − μ′}: the
max terms cancel algebraically, term by term, so the law is the same
identity for every n₁, n₂ (each entry is its own symbol; the check at
(n₁, n₂) ∈ {(1,1),(1,2),(2,1),(2,2),(3,1)} sees each term's cancellation).
Finally o/z = Σ_j e^{x_j − M} v_j / Σ_j e^{x_j − M} = Σ_j softmax_j(x) v_j: the
e^{−M} cancels between numerator and denominator.

The checks take the accumulator FROM THE RULE: ``stream_partition`` is
applied to softmax_x(S)·V and the resulting Stream box's init/update/finalize
are evaluated with the SYMPY backend on symbolic S and V; the expressions are
canonicalised (expand, powsimp with the Max terms as atoms, common
denominator) to 0.  The numeric checks run both sides through
``napkin.core.semantics.evaluate``: float64 at random sizes with ragged last
chunks, logits offset by ±1e4 (overflow in a naive exp), fully masked rows
(a padding mask; every entry −1e30, where the result is the mean of v) and
rows whose first chunks are masked (causal with q > x, sliding window), and
bfloat16 inputs (float32 accumulators) against the float64 meaning.

The attention sink.  With one extra logit s per row (``softmax(x, sink=s)``),
f_s(x, v) = Σ_j e^{x_j − m} v_j / (Σ_j e^{x_j − m} + e^{s − m}), m = max(max x, s).
The state and the update are the same, so the fold gives state(x) = (M,
Σ e^{x_j − M}, Σ e^{x_j − M} v_j) as above; the finalize reads s (a fixed input
of the stream: it lacks x) and folds it in once: μ* = max(M, s) = m, δ* =
e^{M − m}, z* = δ*·z + e^{s − m} = Σ e^{x_j − m} + e^{s − m}, o* = δ*·o =
Σ e^{x_j − m} v_j, result o*/z* = f_s.  The same symbolic obligations check it
(the Max atoms again cancel term by term).  Rows: all scores masked and s
finite give z* = 1, o* = 0 — zeros, as f_s gives (the sink takes the mass); s
= −∞ is the plain softmax, and a row of −∞ with s = −∞ gives zeros, not NaN.
Adding the sink in every update instead fails the law
(proofs/wrong_variants.py).
"""
from __future__ import annotations

import numpy as np

from proofs._core import (CHUNK, SIZES, Failed, Proof, accumulator_obligations, as_f64, bf16,
                          library, merge_checks, numeric, ragged, sample, stream_rule)

RULE = "softmax_contraction"


def generic(dtype="f64"):
    """softmax over x of S[q,x], contracted with V[x,d] over x."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    q, x, d = axes("q x d")
    return trace(lambda S, V: ops.contract(ops.softmax(S, x, as_="P"), V, out=(q, d), as_="O"),
                 {"S": Array(q, x, dtype=dtype), "V": Array(x, d, dtype=dtype)}, "softmax·V")


def generic_sink(dtype="f64"):
    """softmax over x of S[q,x] with a sink s[q], contracted with V[x,d] over x."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    q, x, d = axes("q x d")
    return trace(lambda S, s, V: ops.contract(ops.softmax(S, x, sink=s, as_="P"), V,
                                              out=(q, d), as_="O"),
                 {"S": Array(q, x, dtype=dtype), "s": Array(q, dtype=dtype),
                  "V": Array(x, d, dtype=dtype)}, "softmax+sink·V")


def attention_with(dtype="f64", offset=None, padding=False):
    """Attention whose scores get a constant offset and/or a padding mask."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    import sympy
    q, x, d = axes("q x d")

    def f(Q, K, V, *valid):
        S = ops.scale(ops.contract(Q, K, out=(q, x), as_="S"), 1 / sympy.sqrt(d.size), as_="S")
        if offset is not None:
            S = ops.add_const(S, offset, as_="S")
        if padding:
            S = ops.padding_mask(S, valid[0], as_="S")
        return ops.contract(ops.softmax(S, x, as_="P"), V, out=(q, d), as_="O")
    ins = {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
           "V": Array(x, d, dtype=dtype)}
    if padding:
        ins["valid"] = Array(q, x, dtype=dtype)
    return trace(f, ins, "attention")


def symbolic_part(proof: Proof, st):
    accumulator_obligations(proof, st, {"q": 1, "d": 2}, "softmax_x(S)·V")


def numeric_part(proof: Proof, rng: np.random.Generator):
    sizes, tiles = {k: SIZES[k] for k in "qxd"}, {"s_x": CHUNK}

    def streamed(D, axis="x"):
        return stream_rule(D, axis).rewritten

    def f64_random():
        nx, c = ragged(rng, 4, 11)
        sz = {"q": int(rng.integers(1, 5)), "x": nx, "d": int(rng.integers(1, 4))}
        D = library("attention", "f64")
        return f"{sz}, s_x={c}: " + numeric(D, streamed(D), sample(D, sz, rng),
                                            sizes_rhs={"s_x": c}, tol=1e-12)
    proof.check("float64 attention at random sizes, ragged last chunk (JAX)", f64_random,
                "numeric")

    def large_logits():
        out = []
        for off in (1e4, -1e4):
            D = attention_with(offset=off)
            xs = sample(D, sizes, rng, scale=6.0)  # logit spread ~20 on top of the offset
            out.append(f"offset {off:+g}: " + numeric(D, streamed(D), xs, sizes_rhs=tiles,
                                                      tol=1e-9))
        return "; ".join(out)
    proof.check("logits offset by ±1e4 (float64, JAX)", large_logits, "numeric")

    def masked():
        D = attention_with(padding=True)
        valid = np.ones((sizes["q"], sizes["x"]))
        valid[0, :] = 0          # a fully masked row
        valid[1, :CHUNK] = 0     # its first chunk masked
        valid[2, ::2] = 0
        out = ["padding: " + numeric(D, streamed(D), sample(D, sizes, rng, overrides={
            "valid": valid}), sizes_rhs=tiles, tol=1e-12)]
        for name in ("causal_attention", "sliding_window_attention"):
            D = library(name, "f64")
            out.append(f"{name}: " + numeric(D, streamed(D), sample(D, sizes, rng),
                                             sizes_rhs=tiles, tol=1e-12))
        return f"{sizes}, s_x={CHUNK}: " + "; ".join(out)
    proof.check("masked rows: a fully masked row (padding), fully masked chunks before and after "
                "live ones (causal with q > x, sliding window), float64", masked, "numeric")

    def infinities():
        D = generic()
        S, V = sample(D, {**sizes, "q": 5}, rng)
        S[0] = -np.inf               # a row of −∞: no distribution, zeros (as softmax gives)
        S[1, :CHUNK] = -np.inf       # a first chunk of −∞, then finite scores
        S[2, -1] = -np.inf           # −∞ in the last, ragged chunk
        S[3, 1] = np.nan             # a NaN score: a NaN row, as jax.nn.softmax gives
        S[4, 0] = 1e4                # a large score among ordinary ones
        return numeric(D, streamed(D), [S, V], sizes_rhs=tiles, tol=1e-12, nonfinite=True)
    proof.check("−∞ scores (a whole row, a first chunk, the ragged last chunk), a NaN score, a "
                "1e4 score: the same values, zeros and NaN as softmax·V (float64)", infinities,
                "numeric")

    def low_precision():
        D16, D64 = library("attention", "bf16"), library("attention", "f64")
        x16 = bf16(sample(D64, sizes, rng))
        a = numeric(D64, streamed(D16), as_f64(x16), x16, sizes_rhs=tiles, tol=2e-2)
        return f"{sizes}, s_x={CHUNK}: streamed bf16 vs the float64 meaning: {a}"
    proof.check("bfloat16 inputs, float32 accumulators (tolerance 2e-2 relative)", low_precision,
                "numeric")

    def sink_rows():
        D = generic_sink()
        S, s, V = sample(D, {**sizes, "q": 6}, rng, scale=3.0)
        S[0] = -1e30              # every score masked, a finite sink: zeros
        S[1] = -np.inf            # a row of −∞, a finite sink: zeros
        S[2] = -np.inf
        s[2] = -np.inf            # nothing at all: zeros, not NaN
        s[3] = -np.inf            # no sink: the plain softmax
        s[4] = 1e4                # a sink far above the scores: (almost) all the mass
        S[5] += 1e4               # large logits, the sink far below
        return numeric(D, streamed(D), [S, s, V], sizes_rhs=tiles, tol=1e-12, nonfinite=True)
    proof.check("sink: masked and −∞ rows with a finite sink, no sink, a sink of −∞ on a row of "
                "−∞, a dominant sink, large logits (float64, ragged chunks)", sink_rows, "numeric")


def prove():
    proof = Proof(RULE, __name__, __doc__)
    st = None

    def derive():
        nonlocal st
        st = stream_rule(generic(), "x")
        if st.spec.rule != RULE:
            raise Failed(f"stream_partition used the accumulator {st.spec.rule!r}")
        return f"stream_partition claims softmax_x·V with {st.spec.rule} (state " \
               f"{', '.join(str(o) for o in st.spec.init.cod.inside)})"
    proof.check("the accumulator is the one stream_partition builds for softmax_x(S)·V", derive,
                "structure")
    if st is not None:
        symbolic_part(proof, st)
        merge_checks(proof, st, {"q": 4, "x": 9, "d": 3}, "softmax_x(S)·V")
    sink = {}

    def derive_sink():
        st = stream_rule(generic_sink(), "x")
        if st.spec.rule != RULE:
            raise Failed(f"stream_partition used the accumulator {st.spec.rule!r}")
        fin = [ob.name for ob in st.spec.finalize.dom.inside]
        if "s" not in fin:
            raise Failed(f"the finalize does not read the sink (its inputs {fin})")
        sink["st"] = st
        return f"stream_partition claims softmax_x(S, sink=s)·V with {st.spec.rule}; the " \
               f"finalize reads {', '.join(fin)}"
    proof.check("with a sink: the same accumulator, the sink read by the finalize", derive_sink,
                "structure")
    if "st" in sink:
        accumulator_obligations(proof, sink["st"], {"q": 1, "d": 1},
                                "softmax_x(S, sink=s)·V", pairs=((1, 1), (1, 2), (2, 1), (2, 2)),
                                folds=((1, 1, 1), (2, 1)), uniform=((3, 2),))
    numeric_part(proof, np.random.default_rng(20240607))
    return proof.result()
