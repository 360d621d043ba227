"""Untying tiles preserves meaning: a tile is a bound name.

Statement.  ``rewrites.untie_tiles`` renames, inside a top-level box, every occurrence of
a tile name that an earlier top-level box also uses (its partition's size or chunk, the
wire types and fields of the boxes inside) to a name used nowhere in the program.  The
programs denote the same function, whatever values the two names are then given.

Proof (alpha-conversion).  Evaluation binds a tile name to each piece's length where its
partition evaluates (napkin.core.streamed: ``ctx.bound``), and the partitions inside a
top-level box are the only binders its body sees: a top-level box's own wires carry full
axes, never a tile.  So a box's meaning depends on the tile names it uses only through
the bindings its own partitions make; renaming a bound name consistently, to a name no
binder around it already uses, changes nothing (capture is impossible: the new name is
fresh in the whole program).  A partition's meaning is the same for every tile length
(group_partition, stream_partition), so the untied program, with the two kernels' tiles
at different lengths, computes the original function.  The checks confirm it on the real
rule, for an MLP tiled over its rows in two kernels (the second also streaming its
contraction): exactly the later kernel's tiles are renamed, each renamed box renamed back
is the original box; identical sympy expressions on symbolic entries with the names
bound alike; float64 results equal to the tied program's with the kernels' tiles at
different lengths (ragged); and the premises are enforced (no shared tile, a site that
is not the whole program).  Wrong variants fail: renaming a partition's size without its
body is refused by type inference, and renaming the later
kernel's tile onto an axis size the body carries (a capture) no longer computes the
algorithm.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import sympy

from proofs._core import (Failed, Proof, apply_rule, library, numeric, refuses, sample, size,
                          sym_ctx, sym_inputs)

RULE = "untie_tiles"


def _tied():
    """The MLP Y = gelu(X·W1)·W2 in two kernels over rows n, both tiled g_n; the second
    also streams its contraction over e."""
    from napkin.core.ir import ops as op_order, view
    D = library("mlp")
    G = apply_rule("group_partition", D, {"axis": "n"}, ops=(0,))
    G = apply_rule("group_partition", G, {"axis": "n"}, ops=(1, 2))
    g = view(G)
    second = next(i for i, n in enumerate(op_order(g))
                  if "gelu" in {b.name for b in g.nodes[n]["box"].spec.body.boxes})
    body = g.nodes[op_order(g)[second]]["box"].spec.body
    inner = len(op_order(view(body)))
    return D, apply_rule("stream_partition", G, {"axis": "e"}, path=(second,),
                         ops=tuple(range(inner)))


def prove():
    from napkin.core.ir import ops as op_order, view
    from napkin.core.retile import renamed, symbols
    from napkin.core.semantics import run
    from napkin.core.streamed import names
    proof = Proof(RULE, __name__, __doc__)
    D, T = _tied()
    got = {}

    def structure():
        U = apply_rule(RULE, T, {}, ops=())
        if sorted(names(T).tiles) != ["g_n", "s_e"]:
            raise Failed(f"the tied program's tiles are {sorted(names(T).tiles)}")
        if sorted(names(U).tiles) != ["g_n", "g_n_2", "s_e"]:
            raise Failed(f"the untied program's tiles are {sorted(names(U).tiles)}")
        gt, gu = view(T), view(U)
        boxes = [(gt.nodes[a]["box"], gu.nodes[b]["box"])
                 for a, b in zip(op_order(gt), op_order(gu))]
        changed = [(a, b) for a, b in boxes if a is not b]
        if len(changed) != 1:
            raise Failed(f"{len(changed)} boxes changed; the later kernel alone should")
        (a, b), = changed
        back = renamed(_one(b), symbols({"g_n_2": "g_n"}))
        if back.boxes[0].spec != a.spec or b.dom != a.dom or b.cod != a.cod:
            raise Failed("the renamed kernel renamed back is not the original")
        if T.dom != U.dom or T.cod != U.cod:
            raise Failed("the program's wires changed")
        got["U"] = U
        return "the later kernel's g_n -> g_n_2 (its s_e kept: no other kernel uses it); " \
               "renamed back it is the original box; same wires"
    proof.check("exactly the shared tile of the later kernel is renamed", structure,
                "structure")

    def symbolic():
        sizes = {"n": 3, "d": 2, "e": 3, "f": 2}
        ctx, xs = sym_ctx(sizes), sym_inputs(D, sizes)
        for g, s in ((2, 2), (3, 1)):
            a = run(T, ctx.bound(size("g_n"), g).bound(size("s_e"), s), *xs)
            b = run(got["U"], ctx.bound(size("g_n"), g).bound(size("g_n_2"), g)
                    .bound(size("s_e"), s), *xs)
            for u, v in zip(a, b):
                if not all(sympy.sympify(p) == sympy.sympify(q) for p, q in zip(u.flat, v.flat)):
                    raise Failed(f"g_n={g}, s_e={s}: expressions differ")
        return "identical expressions for (g_n, s_e) in [(2, 2), (3, 1)] at |n|=3"
    proof.check("identical sympy expressions with the names bound alike (structural)",
                symbolic)

    def apart():
        sizes = {"n": 13, "d": 6, "e": 11, "f": 5}
        xs = sample(D, sizes, np.random.default_rng(23))
        out = []
        for g1, g2, s in ((4, 5, 3), (13, 2, 4), (1, 7, 11)):
            out.append(numeric(D, got["U"], xs, sizes_rhs={"g_n": g1, "g_n_2": g2, "s_e": s},
                               tol=1e-12))
        return f"{sizes}, (g_n, g_n_2, s_e) in [(4, 5, 3), (13, 2, 4), (1, 7, 11)]: " + out[-1]
    proof.check("float64 equal to the algorithm with the kernels' tiles at different, "
                "ragged lengths", apart, "numeric")

    def premises():
        out = [refuses(lambda: apply_rule(RULE, D, {}, ops=()), "no two top-level boxes"),
               refuses(lambda: apply_rule(RULE, got["U"], {}, ops=()), "no two top-level"),
               refuses(lambda: apply_rule(RULE, T, {}, ops=(0,)), "whole program")]
        return "; ".join(out)
    proof.check("premises enforced: nothing shared (the algorithm, an untied program), a "
                "site that is not the whole program", premises, "premise")

    def wrong():
        from napkin.core.errors import NapkinError
        from napkin.core.op import make_op
        from napkin.core.retile import retiled
        box = view(T).nodes[op_order(view(T))[1]]["box"]
        new = sympy.Symbol("g_n_2", integer=True, positive=True)
        try:  # the partition's size renamed, its body left at g_n
            make_op(dataclasses.replace(box.spec, size=new), box.dom,
                    [o.name for o in box.cod.inside], box.name)
            raise Failed("a group renamed without its body was accepted")
        except NapkinError as e:
            first = f"size without body refused: {str(e)[:80]}"
        # captured: the tile renamed to f, an axis its body's arrays carry
        sizes = {"n": 13, "d": 6, "e": 11, "f": 5}
        xs = sample(D, sizes, np.random.default_rng(29))
        try:
            numeric(D, retiled(T, {1: {"g_n": "f"}}), xs, sizes_rhs={"g_n": 4, "s_e": 3},
                    tol=1e-12)
        except Failed as e:
            return f"{first}; renamed onto the axis size f: {e}"
        except Exception as e:  # noqa: BLE001 - any failure to compute the function
            return f"{first}; renamed onto the axis size f: {type(e).__name__}"
        raise Failed("a tile renamed onto an axis size computed the algorithm")
    proof.check("wrong variants fail: a size renamed without its body, a tile captured by "
                "an axis size", wrong, "wrong variant")
    return proof.result()


def _one(box):
    """The diagram of one box on its own wires."""
    from napkin.core.ir import GraphBuilder, to_diagram
    b = GraphBuilder()
    ins = [b.input(ob) for ob in box.dom.inside]
    return to_diagram(b.finish(b.op(box, ins)))

