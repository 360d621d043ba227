"""Negative checks: plausible but wrong accumulators that the proofs must reject.

Each variant is a Stream box built by hand — the rule's init and finalize,
with an update diagram traced with ``napkin.ops`` — and is run through the
SAME obligation checker as the real rules (proofs._core.accumulator_obligations
and the same numeric comparison).  ``prove_wrong()`` returns one ProofResult
per variant; every one must be *not ok*, its failed obligations naming what
breaks:

1. softmax·V streamed WITHOUT the rescale: μ′ = max(μ, max y),
   z′ = z + Σ exp(y − μ′), o′ = o + Σ exp(y − μ′)·w.  One chunk is right (the
   base case holds), but terms of earlier chunks stay relative to the old
   maximum, so the accumulator law fails as soon as a later chunk raises the
   max;
2. max streamed with a sum accumulator: m′ = m + max y from m = 0.  Again the
   base case holds and the law fails: max x + max y ≠ max(x ⊕ y).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proofs._core import (CHUNK, SIZES, Proof, ProofResult, accumulator_obligations, numeric,
                          sample, with_stream)


def _trace_like(fn, diagram, name):
    from napkin.trace import trace
    return trace(fn, [(ob.name, ob.type) for ob in diagram.dom.inside], name)


def softmax_without_rescale():
    """(Streamed program, description) of variant 1."""
    from napkin import ops
    from proofs._core import stream_rule
    from proofs.softmax_contraction import generic
    st = stream_rule(generic(), "x")
    spec = st.spec

    def update(mu, z, o, S, V):
        mu2 = ops.maximum(mu, ops.max_(S, spec.axis), as_="mu")
        p = ops.exp(ops.sub(S, mu2), as_="p")
        z2 = ops.add(z, ops.sum_(p, spec.axis), as_="z")
        o2 = ops.add(o, ops.contract(p, V, out=("q", "d")), as_="o")
        return [mu2, z2, o2]
    wrong = dataclasses.replace(spec, update=_trace_like(update, spec.update, "update (no rescale)"),
                                rule="softmax_contraction without rescale")
    return with_stream(st, wrong)


def max_with_sum():
    """(Streamed program) of variant 2: m′ = m + max y from m = 0."""
    from napkin import ops
    from napkin.trace import trace
    from proofs._core import stream_rule
    from proofs.max_reduce import generic
    st = stream_rule(generic(), "x")
    spec = st.spec
    (state,) = spec.init.cod.inside

    def update(m, X):
        return [ops.add(m, ops.max_(X, spec.axis), as_=state.name)]
    init = trace(lambda: [ops.fill(state.type, 0.0, as_=state.name)], [], "init (0)")
    wrong = dataclasses.replace(spec, init=init,
                                update=_trace_like(update, spec.update, "update (sum of maxima)"),
                                rule="max with a sum accumulator")
    return with_stream(st, wrong)


VARIANTS = {
    "wrong: softmax_contraction without the rescale exp(μ − μ′)":
        (softmax_without_rescale, {"q": 1, "d": 1}, "softmax_x(S)·V, no rescale",
         {k: SIZES[k] for k in "qxd"}),
    "wrong: max with a sum accumulator (m′ = m + max y)":
        (max_with_sum, {"n": 1}, "max_x X, sum accumulator", {"n": SIZES["n"], "x": SIZES["x"]}),
}


def prove_variant(name: str) -> ProofResult:
    build, sym_sizes, what, num_sizes = VARIANTS[name]
    proof = Proof(name, __name__, __doc__)
    st = build()
    accumulator_obligations(proof, st, sym_sizes, what, pairs=((1, 1), (2, 1), (1, 2)),
                            folds=((1, 1, 1), (2, 1)), uniform=((3, 2),))

    def num():
        rng = np.random.default_rng(18)
        return numeric(st.reference, st.rewritten, sample(st.reference, num_sizes, rng, scale=3.0),
                       sizes_rhs={f"s_{st.axis}": CHUNK}, tol=1e-9)
    proof.check(f"{what}: float64, ragged last chunk (JAX)", num, "numeric")
    return proof.result()


def prove_wrong() -> list[ProofResult]:
    """One result per wrong variant; each must be not ok."""
    return [prove_variant(name) for name in VARIANTS]
