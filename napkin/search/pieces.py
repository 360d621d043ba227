"""A large algorithm searched as its natural pieces (a transformer block: norm, projections,
attention, output projection, norm, MLP).

Kernels of a program cost independently once the values between them are in HBM, so a
program of many boxes is cut into convex pieces of at most :data:`MOST` boxes that reduce
or contract where the least data crosses (:func:`cuts`: elementwise boxes ride with the
products that read them or that they finish — a norm's scaling is its GEMM's prologue, a
residual add the output projection's epilogue —, then boxes are joined along their
values, the largest first: the attention scores' |h|·|t|² stay inside a piece, a
residual's |t|·|e| is cut), and each piece is searched as a diagram of its own, in a share
of the time — from the piece and from its boxes apart (a kernel per box, and a kernel per
product with its riders: :func:`cuts` with one product a piece), so no piece's answer is
slower than those.  Each run's best chain is then replayed on the whole program —
its sites translated box by box (a rule leaves the boxes outside its site as they were, so
a run's boxes are followed through its moves by identity) — so the result is one chain of
rule applications on the whole algorithm, a certificate like any other.  Boxes a piece left
without a kernel (its chain is dropped where the whole program refuses a move of it: a
value of the piece another piece also reads) get one of their own
(the engine's ``each_box_partitioned``).  The
whole search then starts from that program as well as from the algorithm, and keeps the
better.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, view
from napkin.core.region import Site, region, region_diagram

# programs with more top-level boxes than this are searched in pieces first (a four-layer
# stack has 32, the transformer block 41; attention's backward diagrams stay below)
ABOVE = 30
# the most boxes of one piece that reduce or contract (attention's two products and its
# softmax): elementwise boxes ride along as the prologues and epilogues of those, uncounted
# up to ALONG boxes in all — a piece with a fourth product (attention with its projections)
# is not searched through in a few seconds
MOST = 3
ALONG = 16
# the most states a piece's search costs (attention's answer is reached in well under 100)
STATES = 300


def cuts(program, ev, most: int = MOST) -> list[list[int]]:
    """The top-level op indices of ``program`` in convex pieces of at most ``most``
    (:data:`MOST`) boxes that reduce (and :data:`ALONG` in all).  An elementwise box first joins its only
    reader (a norm's scaling, a residual add recomputed per reader: the prologue of the
    product that reads it); an elementwise run read by several pieces, or by none, joins the
    piece that makes its inputs (an epilogue).  Then pieces are joined along the values
    between them, the largest value first (a piece's inside stays on chip; what crosses
    between pieces goes through HBM), while the piece stays small enough and convex."""
    g = view(program)
    order = op_order(g)
    pos = {n: i for i, n in enumerate(order)}
    readers = [{pos[c] for v in g.nodes[n]["outs"] for c in g.successors(v)} for n in order]
    makers = [{pos[m] for v in g.nodes[n]["ins"] for m in g.predecessors(v)} for n in order]
    light = [bool(getattr(g.nodes[n]["box"].spec, "elementwise", False)) for n in order]
    outputs = set(g.graph["outputs"])
    piece = {i: frozenset([i]) for i in range(len(order))}

    def join(i, j) -> bool:
        merged = piece[i] | piece[j]
        if piece[i] is piece[j] or sum(not light[k] for k in merged) > most \
                or len(merged) > ALONG or not _convex(g, merged):
            return False
        for k in merged:
            piece[k] = merged
        return True

    for i in reversed(range(len(order))):  # prologues: a chain joins its one reader
        if light[i] and len(readers[i]) == 1 and not outputs & set(g.nodes[order[i]]["outs"]):
            join(i, next(iter(readers[i])))
    for p in {id(p): p for p in piece.values()}.values():  # epilogues: a light run read by
        # several pieces (or none) joins a piece that makes its inputs, the largest first
        if all(light[k] for k in p):
            made = {m for k in p for m in makers[k]} - p
            for m in sorted(made, key=lambda m: -_bytes(g, order[m], ev)):
                if join(min(p), m):
                    break
    edges = []
    for i, node in enumerate(order):
        for v in g.nodes[node]["outs"]:
            nbytes = ev.nbytes(g.nodes[v]["ob"])
            edges += [(-nbytes, i, pos[c]) for c in g.successors(v)]
    for _, i, j in sorted(edges):
        join(i, j)
    return sorted((sorted(p) for p in set(piece.values())), key=lambda p: p[0])


def _convex(g, nodes) -> bool:
    """Whether nothing outside the top-level ops ``nodes`` runs between two of them."""
    from napkin.core.errors import RuleError
    try:
        region(g, sorted(nodes))
        return True
    except RuleError:
        return False


def _bytes(g, node, ev) -> int:
    """The bytes op ``node`` writes."""
    return sum(ev.nbytes(g.nodes[v]["ob"]) for v in g.nodes[node]["outs"])


def searched_in_pieces(start, ev, max_states: int, seconds: float, *, search, complete,
                       apply):
    """(program, chain) from ``start`` (a (program, chain) pair) with every piece's best chain
    replayed on it, or None when the program is small or no piece improved.  The engine's
    own steps are passed in: ``search(diagram, states, seconds, since)`` (its best state),
    ``complete(program, ev)`` (every box left a kernel of its own) and ``apply(program, move)``."""
    program, chain = start
    if len(op_order(view(program))) <= ABOVE:
        return None
    if sourceless(program):
        return None  # a value made from no input (T5's bucket index): no kernel of its own
    runs = [r for r in cuts(program, ev) if len(r) > 1 or _reduces(program, r[0])]
    end = time.perf_counter() + seconds
    g = view(program)
    order = op_order(g)
    pieces = []
    for k, run in enumerate(runs):  # the pieces are cut from the start: their boxes are
        # the start's own
        boxes = [g.nodes[order[i]]["box"] for i in run]
        sub = region_diagram(region(g, run))
        t0 = time.perf_counter()
        share = max(end - t0, 0.0) / (len(runs) - k)  # what the pieces before left, shared
        try:  # a piece is small: its states, not the clock, bound it (the same answer on
            # a slow machine), the time share only as a backstop
            found = search(sub, min(max_states, STATES), share, t0)
        except NapkinError:
            continue
        # (a piece's best that no backend writes — its search stopped before one — is left
        # out: its boxes get kernels of their own rather than spoil the whole program)
        if found is not None and found.feasible and found.chain and not found.unlowerable:
            pieces.append((sub, boxes, found.chain))
    if not pieces:
        return None
    chain = list(chain)
    for sub, boxes, moves in pieces:
        program, done = _replay(program, sub, boxes, moves, apply)
        chain += done
    program, rest = complete(program, ev)  # boxes a piece left without a kernel
    return program, tuple(chain + list(rest))


def _reduces(program, index) -> bool:
    """Whether the top-level box at ``index`` is worth a search of its own (alone, an
    elementwise box gets its kernel from kernel_per_box)."""
    g = view(program)
    return not getattr(g.nodes[op_order(g)[index]]["box"].spec, "elementwise", False)


def top_boxes(program) -> list:
    """The top-level boxes of ``program``, in order."""
    g = view(program)
    return [g.nodes[n]["box"] for n in op_order(g)]


def sourceless(program) -> bool:
    """Whether a top-level box of ``program`` reads no input (positions, T5's bucket index):
    a kernel of no inputs, writing to HBM what its readers could make on chip (the backends
    write one — a search cut short can hand one back — but no root starts from one)."""
    return any(not b.dom.inside for b in top_boxes(program))


def _replay(program, sub, boxes, moves, apply):
    """``moves`` (a chain on ``sub``, whose top-level boxes stand for ``boxes`` of
    ``program``) applied to ``program``: (the program, the moves) — or ``program`` and no
    moves where one does not apply (a prefix of a piece's chain need not fit on chip)."""
    corr = {id(s): f for s, f in zip(top_boxes(sub), boxes)}  # sub's box -> program's box
    done, original = [], program
    for mv in moves:
        s_top, f_top = top_boxes(sub), top_boxes(program)
        # rules memoise boxes by content, so one object may stand at several positions (the
        # K and V projections of one x; a residual x + o read four times): the piece's k-th
        # box standing for a program object is that object's k-th place in the program (the
        # pieces replay in the start's order, an earlier copy's boxes first) — counted over
        # the counterparts: the piece's diagram may hold two objects where the program holds
        # one (counted over the piece's own objects, K's chain landed on V's norm and the
        # whole K/V piece was refused)
        at_f = _places(f_top)
        touched = mv.site.path[:1] or mv.site.ops
        try:
            mine = [corr[id(b)] for b in s_top]
            at = [at_f[id(mine[i])][sum(m is mine[i] for m in mine[:i])] for i in touched]
        except (KeyError, IndexError):
            return original, []  # a box of the piece no longer at the top
        site = Site((at[0], *mv.site.path[1:]), mv.site.ops) if mv.site.path \
            else Site((), tuple(sorted(at)))
        moved = dataclasses.replace(mv, site=site)
        try:
            new_prog, new_sub = apply(program, moved), apply(sub, mv)
        except NapkinError:
            return original, []  # the whole program refuses it (a value read elsewhere)
        made_s = _made(s_top, top_boxes(new_sub), [s_top[i] for i in touched])
        made_f = _made(f_top, top_boxes(new_prog), [f_top[i] for i in at])
        if len(made_s) != len(made_f):
            return original, []
        corr.update((id(s), f) for s, f in zip(made_s, made_f))
        program, sub = new_prog, new_sub
        done.append(moved)
    return program, done


def _made(old: list, new: list, touched: list) -> list:
    """The top-level boxes of ``new`` a move made, from ``old`` with ``touched`` rewritten
    (counted per object: a made box may be an object already there, one equal by content)."""
    left = Counter(map(id, old))
    left.subtract(map(id, touched))
    made = []
    for b in new:
        if left[id(b)] > 0:
            left[id(b)] -= 1
        else:
            made.append(b)
    return made


def _places(top: list) -> dict:
    """{id of a box object: its positions among ``top``, in order}."""
    out: dict = {}
    for i, b in enumerate(top):
        out.setdefault(id(b), []).append(i)
    return out
