"""Split-K preserves meaning: the parts' states, merged in order, are the whole stream's.

Statement.  For a stream over ``x`` with init ι, update u, finalize φ and merge ⊕, and a
part tile p, ``rewrites.split_stream`` gives

    φ(ι ⊕ s_1 ⊕ … ⊕ s_P),   s_j = fold(u, ι, the chunks of part j)   (P = ⌈|x| / p⌉)

where the original is φ(fold(u, ι, all chunks of x)).

Proof.  The stream partition's proof shows, per accumulator, the merge law
⊕(state(a), state(b)) = state(a ∥ b) for any split of the axis (b's positions after a's),
and that the empty state ι is ⊕'s unit on either side (proofs._core.accumulator_obligations,
symbolic; merge_checks, float64 with empty and all −∞ parts).  The parts of the split are
contiguous and in order, so by induction over j, ι ⊕ s_1 ⊕ … ⊕ s_j = state(x[0 : j·p]), and
at j = P the state of the whole axis: φ of it is the original's output.  The rewrite builds
both programs from the stream's own ι, u, ⊕ and φ (checked below, structurally), reads each
partial state back whole (a sum over a stacked axis of one entry), and folds the parts in
order; the checks replay the rule on the real accumulators (attention, causal attention with
parts that hold no visible key, logsumexp) in float64 at ragged sizes, and a merge that
forgets to rescale (the wrong variant) makes the split program differ.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proofs._core import Failed, Proof, apply_rule, library, numeric, refuses, sample

RULE = "split_stream"

# (library algorithm, grouped axis, streamed axis, sizes): ragged parts and chunks
CASES = [("attention", "q", "x", {"q": 5, "x": 23, "d": 3}),
         ("causal_attention", "q", "x", {"q": 5, "x": 23, "d": 3}),
         ("logsumexp", "n", "v", {"n": 3, "v": 23})]
TILES = {"g": 2, "s": 3, "p": 7}  # 23 = 7 + 7 + 7 + 2; each part 2 full chunks + 1 of 1


def streamed(name, rows, axis):
    """The library algorithm grouped over ``rows`` and streamed over ``axis``: (D, program)."""
    D = library(name, "f64")
    G = apply_rule("group_partition", D, {"axis": rows})
    return D, apply_rule("stream_partition", G, {"axis": axis}, path=(0,))


def tiles(rows, axis, part=TILES["p"]):
    return {f"g_{rows}": TILES["g"], f"s_{axis}": TILES["s"], f"p_{axis}": part}


def _stream(program):
    (box,) = [b for b in program.boxes if getattr(b, "spec", None) is not None]
    (inner,) = [b for b in box.spec.body.boxes if getattr(b, "spec", None) is not None]
    return inner.spec


def prove():
    proof = Proof(RULE, __name__, __doc__)
    built = {}

    def structure():
        out = []
        for name, rows, axis, _ in CASES:
            D, P = streamed(name, rows, axis)
            S = apply_rule(RULE, P, {"axis": axis}, ops=(0,))
            spec = _stream(P)
            first, second = [b.spec for b in S.boxes if getattr(b, "spec", None) is not None]
            parts = [b.spec for b in first.body.boxes if getattr(b, "spec", None)][0]
            part = [b.spec for b in parts.body.boxes if getattr(b, "spec", None)][0]
            merge = [b.spec for b in second.body.boxes if getattr(b, "spec", None)][0]
            if parts.stack != f"{axis}_parts" or parts.axis != axis:
                raise Failed(f"{name}: the parts are not a group over {axis} stacked apart")
            if (part.init, part.update, part.merge) != (spec.init, spec.update, spec.merge):
                raise Failed(f"{name}: a part does not fold the stream's own accumulator")
            if (merge.init, merge.finalize, merge.merge) != (spec.init, spec.finalize,
                                                             spec.merge) or merge.chunk != 1:
                raise Failed(f"{name}: the merge stream is not the stream's ι, φ and ⊕ one "
                             f"part at a time")
            built[name] = (D, P, S)
            out.append(name)
        return f"{', '.join(out)}: parts fold ι, u; the merge folds ⊕ from ι, then φ"
    proof.check("both programs are built from the stream's own init, update, merge and "
                "finalize", structure, "structure")

    def equal():
        out = []
        for name, rows, axis, sizes in CASES:
            D, P, S = built[name]
            xs = sample(D, sizes, np.random.default_rng(31), scale=3.0)
            # ragged parts for each; one part (attention); one key per part (causal: most
            # parts see no key)
            for part in (TILES["p"],) + {"attention": (sizes[axis],),
                                         "causal_attention": (1,)}.get(name, ()):
                out.append(f"{name} p={part}: " + numeric(
                    P, S, xs, sizes_lhs=tiles(rows, axis), sizes_rhs=tiles(rows, axis, part),
                    jit=True))
        return "; ".join(out)
    proof.check("the split program equals the stream (float64, ragged parts and chunks; "
                "causal parts with no visible key)", equal, "numeric")

    def wrong_merge():
        # the wrong variant: a merge that adds the states without rescaling by their maxima
        name, rows, axis, sizes = CASES[0]
        D, P, _ = built[name]
        spec = _stream(P)
        bad = dataclasses.replace(spec, merge=_unscaled_merge(spec))
        B = _with_stream(P, bad)
        S = apply_rule(RULE, B, {"axis": axis}, ops=(0,))
        xs = sample(D, sizes, np.random.default_rng(32), scale=3.0)
        try:
            numeric(P, S, xs, sizes_lhs=tiles(rows, axis), sizes_rhs=tiles(rows, axis), jit=True)
        except Failed as e:
            return f"a merge that does not rescale is caught: {str(e)[:80]}"
        raise Failed("a split with a merge that does not rescale passed")
    proof.check("a wrong merge (no rescale) makes the split differ", wrong_merge, "numeric")

    def premises():
        name, rows, axis, _ = CASES[0]
        D, P, _ = built[name]
        spec = _stream(P)
        none = _with_stream(P, dataclasses.replace(spec, merge=None))
        return "; ".join([
            refuses(lambda: apply_rule(RULE, none, {"axis": axis}, ops=(0,)), "has no merge"),
            refuses(lambda: apply_rule(RULE, P, {"axis": "d"}, ops=(0,)), "not d"),
            refuses(lambda: apply_rule(RULE, D, {"axis": axis}, ops=(0,)), "not a stream")])
    proof.check("premises enforced: a stream with no merge, another axis, a box that is not "
                "a stream", premises, "premise")
    return proof.result()


def _with_stream(program, spec):
    """``program`` (a group around one stream) with the stream's spec replaced."""
    from discopy import markov
    from napkin.core.op import make_op
    from rewrites.split_stream import one_box
    (box,) = [b for b in program.boxes if getattr(b, "spec", None) is not None]
    (inner,) = [b for b in box.spec.body.boxes if getattr(b, "spec", None) is not None]
    body = one_box(spec, inner.dom, [o.name for o in inner.cod.inside], inner.name)
    group = make_op(dataclasses.replace(box.spec, body=body), box.dom,
                    [o.name for o in box.cod.inside], box.name)
    return one_box(group.spec, markov.Ty(*box.dom.inside), [o.name for o in box.cod.inside],
                   box.name)


def _unscaled_merge(spec):
    """softmax-contraction's merge without the rescale: μ = max, z and o simply added."""
    from napkin.frontend import ops
    from napkin.frontend.trace import trace
    state = [(o.name, o.type) for o in spec.init.cod.inside]

    def merge(*args):
        a, b = args[:len(state)], args[len(state):]
        mu = ops.maximum(a[0], b[0])
        return [mu] + [x + y for x, y in zip(a[1:], b[1:])]
    return trace(merge, state + [(n + "_y", t) for n, t in state], "merge")
