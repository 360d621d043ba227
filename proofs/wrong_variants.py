"""Negative checks: plausible but wrong accumulators that the proofs must reject.

Each variant is a Stream box built by hand — the rule's init and finalize,
with an update diagram traced with ``napkin.frontend.ops`` — and is run through the
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
   base case holds and the law fails: max x + max y ≠ max(x ⊕ y);
3. take_along_axis streamed with chunk-LOCAL positions (the chunk's offset
   ignored): the first chunk is right, a later one picks the entry at the
   index's position within the chunk, so the law fails for an index in a later
   chunk (the symbolic index takes every integer value);
4. softmax·V with a sink, the sink added in every update (z′ = δz + Σ exp(y − m)
   + exp(s − m)) and the finalize without it: one chunk is right, two count the
   sink twice;
5. softmax·V whose merge forgets to rescale (μ = max(μa, μb), z = za + zb, o = oa + ob):
   the stream itself is right, so every obligation but the merge law holds — and that
   one fails as soon as the two splits' maxima differ (each z, o is relative to its own).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proofs._core import (CHUNK, SIZES, Proof, ProofResult, accumulator_obligations,
                          merge_checks, numeric, sample, with_stream)


def _trace_like(fn, diagram, name):
    from napkin.frontend.trace import trace
    return trace(fn, [(ob.name, ob.type) for ob in diagram.dom.inside], name)


def softmax_without_rescale():
    """(Streamed program, description) of variant 1."""
    from napkin.frontend import ops
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
    from napkin.frontend import ops
    from napkin.frontend.trace import trace
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


def take_ignoring_offsets():
    """Variant 3: the update's take reads chunk-local positions."""
    from napkin.frontend import ops
    from napkin.core.primitives import EvalContext, TakeAlong
    from proofs._core import stream_rule
    from proofs.sum_contraction import take

    @dataclasses.dataclass(frozen=True)
    class LocalTake(TakeAlong):
        def evaluate(self, ctx, ins, outs, x, index):
            local = {k: v for k, v in ctx.offsets.items() if k != self.axis}
            return super().evaluate(EvalContext(ctx.env, local, ctx.xp, ctx.exact), ins, outs,
                                    x, index)

        def label(self):
            return f"take_{self.axis} (chunk-local)"
    st = stream_rule(take(), "x")
    spec = st.spec
    (state,) = spec.init.cod.inside

    def update(acc, X, I):
        part = ops.apply(LocalTake(spec.axis), X, I, name="Σ chunk")[0]
        return [ops.add(acc, part, as_=state.name)]
    wrong = dataclasses.replace(spec, update=_trace_like(update, spec.update,
                                                         "update (chunk-local take)"),
                                rule="take with chunk-local positions")
    return with_stream(st, wrong)


def sink_in_every_update():
    """Variant 4: the sink's exp(s − m) added by every update, not once by the finalize."""
    from napkin.frontend import ops
    from proofs._core import stream_rule
    from proofs.softmax_contraction import generic_sink
    st = stream_rule(generic_sink(), "x")
    spec = st.spec
    names = [ob.name for ob in spec.update.dom.inside]

    def update(*args):
        env = dict(zip(names, args))
        mu, z, o, S, s, V = (env[k] for k in ("mu", "z", "o", "S", "s", "V"))
        mu2 = ops.maximum(mu, ops.max_(S, spec.axis), as_="mu")
        shift = ops.finite_or_zero(mu2, as_="shift")
        delta = ops.exp(ops.sub(mu, shift), as_="delta")
        p = ops.exp(ops.sub(S, shift), as_="p")
        z2 = ops.add(ops.add(ops.mul(z, delta), ops.sum_(p, spec.axis)),
                     ops.exp(ops.sub(s, shift)), as_="z")
        o2 = ops.add(ops.mul(o, delta), ops.contract(p, V, out=("q", "d")), as_="o")
        return [mu2, z2, o2]

    def finalize(mu, z, o, s):
        return [ops.mul(o, ops.guard(ops.recip(z), mu), as_="O")]
    wrong = dataclasses.replace(
        spec, update=_trace_like(update, spec.update, "update (sink every chunk)"),
        finalize=_trace_like(finalize, spec.finalize, "finalize (no sink)"),
        rule="softmax_contraction with the sink in every update")
    return with_stream(st, wrong)


def merge_without_rescale():
    """Variant 5: the softmax-contraction merge adds the two states unrescaled."""
    from napkin.frontend import ops
    from proofs._core import stream_rule
    from proofs.softmax_contraction import generic
    st = stream_rule(generic(), "x")
    spec = st.spec

    def merge(mu, z, o, mu_y, z_y, o_y):
        return [ops.maximum(mu, mu_y, as_="mu"), ops.add(z, z_y, as_="z"),
                ops.add(o, o_y, as_="o")]
    wrong = dataclasses.replace(spec, merge=_trace_like(merge, spec.merge, "merge (no rescale)"),
                                rule="softmax_contraction, merge without rescale")
    return with_stream(st, wrong)


VARIANTS = {
    "wrong: softmax_contraction without the rescale exp(μ − μ′)":
        (softmax_without_rescale, {"q": 1, "d": 1}, "softmax_x(S)·V, no rescale",
         {k: SIZES[k] for k in "qxd"}),
    "wrong: max with a sum accumulator (m′ = m + max y)":
        (max_with_sum, {"n": 1}, "max_x X, sum accumulator", {"n": SIZES["n"], "x": SIZES["x"]}),
    "wrong: take_along_axis streamed with chunk-local positions (the offset ignored)":
        (take_ignoring_offsets, {"n": 1}, "take_x(X, I), chunk-local",
         {"n": SIZES["n"], "x": SIZES["x"]}),
    "wrong: softmax_contraction with the sink added in every update":
        (sink_in_every_update, {"q": 1, "d": 1}, "softmax_x(S, sink=s)·V, sink per chunk",
         {k: SIZES[k] for k in "qxd"}),
    "wrong: softmax_contraction merged without the rescale (splits' z, o added as they are)":
        (merge_without_rescale, {"q": 1, "d": 1}, "softmax_x(S)·V, merge without rescale",
         {k: SIZES[k] for k in "qxd"}),
}


def prove_variant(name: str) -> ProofResult:
    build, sym_sizes, what, num_sizes = VARIANTS[name]
    proof = Proof(name, __name__, __doc__)
    st = build()
    accumulator_obligations(proof, st, sym_sizes, what, pairs=((1, 1), (2, 1), (1, 2)),
                            folds=((1, 1, 1), (2, 1)), uniform=((3, 2),))

    def num():
        rng = np.random.default_rng(18)
        # an integer input is an index along the streamed axis
        kinds = {ob.name: f"index:{st.axis}" for ob in st.reference.dom.inside
                 if ob.type.dtype in ("int32", "int8")}
        return numeric(st.reference, st.rewritten,
                       sample(st.reference, num_sizes, rng, scale=3.0, kinds=kinds),
                       sizes_rhs={f"s_{st.axis}": CHUNK}, tol=1e-9)
    proof.check(f"{what}: float64, ragged last chunk (JAX)", num, "numeric")
    if st.spec.merge is not None:
        merge_checks(proof, st, num_sizes, what)
    return proof.result()


def prove_wrong() -> list[ProofResult]:
    """One result per wrong variant; each must be not ok."""
    return [prove_variant(name) for name in VARIANTS]
