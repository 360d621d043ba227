"""Group partition (tiling) preserves meaning; so does head grouping.

Statement.  Let R be a convex region every box of which is woven over an
axis a and independent along it (no box reduces a, softmaxes or streams over
it, every output carries a), with some input carrying a.  For any group size
g (the last group ragged when g ∤ |a|), the Group box of
``rewrites.group_partition`` — cut the inputs carrying a into consecutive
pieces, run R's body on each piece with a's global offset shifted to the
piece's start, concatenate the outputs along a, pass inputs without a whole
to every piece — equals R.  Head grouping (``rewrites.head_grouping``) is
the group partition over the KV-head axis with g = 1, so it is covered.

Proof.  Lemma (per primitive): a box woven over a and independent along it
commutes with slicing along a — for every interval I of a,
box(x)|_I = box(x|_I) when evaluated with a's offset shifted to min I
(inputs without a unsliced).  This holds for elementwise maps and zips
(entrywise, broadcast inputs unsliced), for contractions that keep a (each
output entry at index i reads inputs only at index i), for reductions,
softmax and streams over other axes (they act within each a-slice), for
masks and positions (they read the GLOBAL index of a, which the shifted
offset restores), for comparisons, selects and take_along_axis over another
axis (entrywise in a), for casts, for fills (re-typed to the piece), for boxes
with no inputs whose output lacks a (positions along another axis), and boxes
computing from those alone without touching a (constants: the same in every
piece, so replaying them in each piece changes nothing) and for
stream and group boxes over other axes (their bodies re-typed; by
induction, their boxes commute).  The lemma is checked for every primitive
kind, on symbolic entries, by applying the rule itself to a one-box program
and comparing the Group box with the box for group sizes 1 and 2 on |a| = 3
(ragged); the identity is entrywise, so it holds for every size.  Composition: if boxes f, h commute with slicing (with offsets), so
does h ∘ f, and so do their tensor and copies; hence by induction on the
number of boxes the whole region does, and concatenating the slices over a
partition of a into intervals rebuilds R's output (concatenation inverts
slicing).  Nested groups are the same argument applied to the body.

Checks: the lemma per primitive; composite regions (causal attention over q,
whose mask needs the offsets; a matmul grouped over a then c) on symbolic
entries for group sizes 1, 2, 3 at |q| = 3; the premises are enforced (the
rule refuses to group an axis a box reduces, softmaxes over or drops); and
numerically, through ``napkin.core.semantics.evaluate``, causal attention grouped
over q with a ragged group, GQA head-grouped, and a bfloat16 matmul grouped
over a and c (grouped then streamed attention is checked in
proofs/stream_partition.py).
"""
from __future__ import annotations

import numpy as np

from proofs._core import (GROUP, SIZES, Failed, Proof, apply_rule, bf16, compare, library, numeric,
                          refuses, sample, size, sym_ctx, sym_inputs)

RULE = "group_partition"


def one_box_programs():
    """(label, diagram) for every primitive kind, woven over axis a."""
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.core.primitives import BINARY, PARAM_UNARY, UNARY, Map
    from napkin.frontend.trace import Array, trace
    a, b, c = axes("a b c")
    A = lambda *ax: Array(*ax, dtype="f64")  # noqa: E731
    out = []

    def add(label, fn, ins):
        out.append((label, trace(fn, ins, label)))
    for fn in UNARY:
        add(f"map {fn}", lambda X, fn=fn: ops._unary(fn)(X), {"X": A(a, b)})
    params = {"scale": 2, "softcap": 30, "add_const": 3, "pow": 2, "max_const": 0.5,
              "min_const": -0.5}
    for fn in PARAM_UNARY:
        add(f"map {fn}", lambda X, fn=fn: ops.apply(Map(fn, params[fn]), X)[0], {"X": A(a, b)})
    for fn in BINARY:
        f = getattr(ops, {"add": "add", "sub": "sub", "mul": "mul", "div": "div",
                          "max": "maximum", "min": "minimum", "guard": "guard"}[fn])
        add(f"zip {fn}", lambda X, Y, f=f: f(X, Y), {"X": A(a, b), "Y": A(a, b)})
        add(f"zip {fn}, broadcast input", lambda X, Y, f=f: f(X, Y), {"X": A(a, b), "Y": A(b)})
    add("contract keeping a", lambda X, Y: ops.contract(X, Y, out=(a, c)),
        {"X": A(a, b), "Y": A(b, c)})
    add("contract keeping a, a in every input", lambda X, Y: ops.contract(X, Y, out=(a,)),
        {"X": A(a, b), "Y": A(a, b)})
    for fn in ("sum", "max", "mean", "logsumexp"):
        add(f"reduce {fn} over another axis",
            lambda X, fn=fn: getattr(ops, {"sum": "sum_", "max": "max_"}.get(fn, fn))(X, b),
            {"X": A(a, b)})
    add("softmax over another axis", lambda X: ops.softmax(X, b), {"X": A(a, b)})
    add("causal mask, a = query axis", lambda X: ops.causal_mask(X, a, b), {"X": A(a, b)})
    add("causal mask, a = key axis", lambda X: ops.causal_mask(X, b, a), {"X": A(a, b)})
    add("window mask, a = query axis", lambda X: ops.window_mask(X, a, b, 2), {"X": A(a, b)})
    add("window mask, a = key axis", lambda X: ops.window_mask(X, b, a, 2), {"X": A(a, b)})
    add("padding mask", lambda X, M: ops.padding_mask(X, M), {"X": A(a, b), "M": A(a, b)})
    add("padding mask, broadcast validity", lambda X, M: ops.padding_mask(X, M),
        {"X": A(a, b), "M": A(b)})
    add("cast", lambda X: ops.cast(X, "f32"), {"X": A(a, b)})
    for fn in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal"):
        f = getattr(ops, fn)
        add(f"compare {fn}, broadcast input, then where",
            lambda X, Y, f=f: ops.where(f(X, Y), X, 0.5), {"X": A(a, b), "Y": A(b)})
        add(f"compare {fn} with a constant, then where",
            lambda X, Y, f=f: ops.where(f(X, 0.25), Y, X), {"X": A(a, b), "Y": A(b)})
    add("softmax with a sink over another axis", lambda X, S: ops.softmax(X, b, sink=S),
        {"X": A(a, b), "S": A(a)})
    add("positions along a (global: the group's offset)",
        lambda X: ops.add(X, ops.positions(a)), {"X": A(a, b)})
    add("positions along another axis (no inputs: replayed in every group)",
        lambda X: ops.mul(X, ops.positions(b)), {"X": A(a, b)})
    add("a constant computed from positions along other axes (replayed in every group)",
        lambda X: ops.add(X, ops.scale(ops.sub(ops.positions(b), ops.positions(c)), -0.5)),
        {"X": A(a, b, c)})
    add("take_along_axis over another axis",
        lambda X, I: ops.take_along_axis(X, I, b), {"X": A(a, b), "I": Array(a, dtype="int32")})
    add("take_along_axis over another axis, broadcast index",
        lambda X, I: ops.take_along_axis(X, I, b), {"X": A(a, b, c), "I": Array(c, dtype="int32")})
    from napkin.core.arrays import ArrayType
    add("fill carrying a", lambda X: ops.add(X, ops.fill(ArrayType((a, b), "f64"), 1.5)),
        {"X": A(a, b)})
    lse = trace(lambda X: ops.logsumexp(X, b), {"X": A(a, b)}, "lse_b")
    out.append(("stream over another axis", apply_rule("stream_partition", lse,
                                                       {"axis": "b", "chunk": 2})))
    mm = trace(lambda X, Y: ops.contract(X, Y, out=(a, c)), {"X": A(a, b), "Y": A(b, c)}, "mm")
    out.append(("group over another axis", apply_rule(RULE, mm, {"axis": "c", "size": 2})))
    return out


def grouped_equals(D, axis, sizes, groups):
    """The Group box the rule builds equals D on symbolic entries, with the group
    size a tile symbol bound to each g and with each g an integer in the program
    (whose last, shorter piece is the body relabelled to its length)."""
    from napkin.core.semantics import run
    from napkin.core.streamed import tile_symbol
    R = apply_rule(RULE, D, {"axis": axis, "size": f"g_{axis}"})
    kinds = [b.spec.kind for b in R.boxes if getattr(b, "spec", None) is not None]
    if kinds != ["group"]:
        raise Failed(f"the rule built {kinds}, not one group box")
    ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
    ref = run(D, ctx, *xs)
    for g in groups:
        try:
            compare(run(R, ctx.bound(tile_symbol("g", axis), g), *xs), ref, sizes)
            compare(run(apply_rule(RULE, D, {"axis": axis, "size": g}), ctx, *xs), ref, sizes)
        except Failed as e:
            raise Failed(f"g_{axis}={g}: {e}") from None
    return f"|{axis}|={sizes[axis]}, g_{axis} in {list(groups)}, symbolic and integer: equal"


def prove():
    from napkin.frontend import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    proof = Proof(RULE, __name__, __doc__)

    def lemma():
        programs = one_box_programs()
        for label, D in programs:
            try:
                grouped_equals(D, "a", {"a": 3, "b": 3, "c": 2}, (1, 2))
            except Failed as e:
                raise Failed(f"{label}: {e}") from None
        return f"{len(programs)} one-box programs ({'; '.join(lbl for lbl, _ in programs)}), " \
               f"|a|=3, g_a in [1, 2]: equal"
    proof.check("lemma: every primitive woven over a commutes with slicing along a (with the "
                "global offset), symbolic entries", lemma)
    proof.check("causal attention grouped over q = the region (symbolic entries, ragged group)",
                lambda: grouped_equals(library("causal_attention", "f64"), "q",
                                       {"q": 3, "x": 3, "d": 1}, (1, 2, 3)))

    def nested():
        from napkin.core.semantics import run
        D = library("matmul", "f64")
        R = apply_rule(RULE, D, {"axis": "a", "size": "g_a"})
        R = apply_rule(RULE, R, {"axis": "c", "size": "g_c"}, path=(0,))
        sizes = {"a": 3, "b": 2, "c": 3}
        ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
        ref = run(D, ctx, *xs)
        for ga, gc in ((2, 2), (1, 3), (3, 1)):
            compare(run(R, ctx.bound(size("g_a"), ga).bound(size("g_c"), gc), *xs), ref, sizes)
        return "|a|=|c|=3, (g_a, g_c) in [(2,2),(1,3),(3,1)]: equal"
    proof.check("nested groups: matmul grouped over a, then c inside (symbolic entries)", nested)

    q, x = axes("q x")

    def premises():
        out = []
        D = trace(lambda S: ops.softmax(S, q), {"S": Array(q, x)}, "softmax_q")
        out.append(refuses(lambda: apply_rule(RULE, D, {"axis": "q"}), "cannot group q"))
        D = trace(lambda S: ops.sum_(S, q), {"S": Array(q, x)}, "sum_q")
        out.append(refuses(lambda: apply_rule(RULE, D, {"axis": "q"}), "cannot group q"))
        D = trace(lambda S: ops.max_(S, x), {"S": Array(q, x)}, "max_x")
        out.append(refuses(lambda: apply_rule(RULE, D, {"axis": "x"}), "cannot group x"))
        return "; ".join(out)
    proof.check("premises enforced: softmax over the axis, a reduction of it, an output without "
                "it are refused", premises, "premise")

    rng = np.random.default_rng(15)
    sizes = {k: SIZES[k] for k in "qxd"}

    def causal():
        D = library("causal_attention", "f64")
        R = apply_rule(RULE, D, {"axis": "q"})
        xs = sample(D, sizes, rng)
        return f"{sizes}, g_q={GROUP}: " + numeric(D, R, xs, sizes_rhs={"g_q": GROUP},
                                                   tol=1e-12)
    proof.check("causal attention grouped over q, ragged last group (float64, JAX)", causal,
                "numeric")

    def gqa():
        D = library("gqa", "f64")
        R = apply_rule("head_grouping", D, {"axis": "k"})
        sz = {"k": 2, "r": 2, "q": 3, "x": SIZES["x"], "d": SIZES["d"]}
        return f"{sz}: " + numeric(D, R, sample(D, sz, rng), tol=1e-12)
    proof.check("head grouping: GQA grouped over the KV heads k (float64, JAX)", gqa, "numeric")

    def low():
        sz = {k: SIZES[k] for k in "abc"}
        D16 = library("matmul", "bf16")
        R = apply_rule(RULE, D16, {"axis": "a"})
        R = apply_rule(RULE, R, {"axis": "c"}, path=(0,))
        return f"{sz}, g_a={GROUP}, g_c=1: " + numeric(D16, R, bf16(sample(D16, sz, rng)),
                                                    sizes_rhs={"g_a": GROUP, "g_c": 1}, tol=2e-2)
    proof.check("bfloat16 matmul grouped over a and c, ragged groups (tolerance 2e-2)", low,
                "numeric")
    return proof.result()
