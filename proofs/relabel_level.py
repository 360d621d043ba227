"""Level relabelling preserves meaning: the semantics never reads a level.

Statement.  Replacing a Group box's memory level (gmem → l2 → smem →
registers, strictly downwards) by ``rewrites.relabel_level`` leaves the
program's meaning unchanged; only its cost changes.

Proof (by construction).  The rule rebuilds the box as
Group(axis, size, body, level′) with the same axis, size and the same body
object, on the same input wires.  ``Group.evaluate`` (napkin.core.streamed) reads
``axis``, ``size`` and ``body`` and never ``level``; the semantics functor
maps a box to its spec's ``evaluate``; so the two programs denote the same
function.  The checks confirm each step on the real rule: the rewritten box
differs from the original only in ``level`` (the body is the same object,
the wiring the same); both programs give identical sympy expressions on
symbolic entries (an exact, structural equality, for a ragged and a full
group size); they give bit-identical JAX results; and the premise is
enforced (a level that is not lower, or a box that is not a group, is
refused).
"""
from __future__ import annotations

import numpy as np
import sympy

from proofs._core import (GROUP, SIZES, Failed, Proof, apply_rule, library, numeric, refuses,
                          sample, size, sym_ctx, sym_inputs)

RULE = "relabel_level"


def prove():
    from napkin.core.semantics import run
    proof = Proof(RULE, __name__, __doc__)
    D = library("causal_attention", "f64")
    box = {}

    def structure():
        G = apply_rule("group_partition", D, {"axis": "q", "level": "l2"})
        R = apply_rule(RULE, G, {"level": "registers"}, ops=(0,))
        (g,), (r,) = ([b for b in P.boxes if getattr(b, "spec", None) is not None] for P in (G, R))
        old, new = g.spec, r.spec
        if (old.axis, old.size, old.body) != (new.axis, new.size, new.body) or \
                old.body is not new.body:
            raise Failed("the relabelled group differs in more than its level")
        if (old.level, new.level) != ("l2", "registers"):
            raise Failed(f"levels {old.level} -> {new.level}")
        if g.dom != r.dom or g.cod != r.cod or G.dom != R.dom or G.cod != R.cod:
            raise Failed("the wiring changed")
        box["G"], box["R"] = G, R
        return "same axis, size, body object and wires; level l2 -> registers"
    proof.check("the rewritten group differs only in its level", structure, "structure")

    def symbolic():
        G, R = box["G"], box["R"]
        sizes = {"q": 3, "x": 2, "d": 1}
        ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
        for g in (2, 3):
            c = ctx.bound(size("g_q"), g)
            a, b = run(G, c, *xs), run(R, c, *xs)
            for u, v in zip(a, b):
                if not all(sympy.sympify(s) == sympy.sympify(t) for s, t in zip(u.flat, v.flat)):
                    raise Failed(f"g_q={g}: expressions differ")
        return "identical expressions for g_q in [2, 3] at |q|=3"
    proof.check("identical sympy expressions on symbolic entries (structural equality)", symbolic)

    def bits():
        sz = {k: SIZES[k] for k in "qxd"}
        xs = sample(D, sz, np.random.default_rng(16))
        return f"{sz}, g_q={GROUP}: " + numeric(box["G"], box["R"], xs, sizes_lhs={"g_q": GROUP},
                                                sizes_rhs={"g_q": GROUP}, tol=0)
    proof.check("bit-identical float64 results (JAX)", bits, "numeric")

    def premises():
        out = [refuses(lambda: apply_rule(RULE, box["G"], {"level": "gmem"}, ops=(0,)),
                       "not below"),
               refuses(lambda: apply_rule(RULE, D, {"level": "registers"}, ops=(0,)),
                       "not a group")]
        return "; ".join(out)
    proof.check("premises enforced: a level not below the current one, a box that is not a "
                "group", premises, "premise")
    return proof.result()
