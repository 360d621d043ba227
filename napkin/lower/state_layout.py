"""The layout a kernel carries a stream's state in: transposed where that frees registers.

A stream's state ``s[x, d]`` updated by ``s + A·B`` takes its rows from A.  Where A is
computed in the step and read transposed (its summed axes lead: dK += dSᵀ·Q, dV += Pᵀ·dO
in attention's backward), Triton transposes it in registers and, at two or more pipeline
stages, waits for the accumulating product only in the next step, so that operand stays
live across the step boundary: the backward's dK, dV kernels spilled (MQA 16 B, softcap
52 B at 255 registers; ptxas, sm_90).  Carried transposed, ``sᵀ[d, x] += Bᵀ·A`` takes its
rows from the loaded operand, which the tensor cores read from shared memory, and the
computed one is the second operand, staged in shared memory as it lies: no register
operand is held over the step (MQA's kernel 233 registers, softcap's 255, attention's
244 → 218; none spill).  The finalize transposes the state back once.

:func:`carried` rewrites a stream's bodies for that; the kernel's meaning is unchanged
(named axes: the same array in another order).
"""
from __future__ import annotations

import networkx as nx

from napkin.core.arrays import ArrayOb, ArrayType, array_types
from napkin.core.diagram import ty
from napkin.core.ir import add_op, reroute, to_diagram, to_graph
from napkin.core.memo import IdentityMemo
from napkin.core.op import make_op
from napkin.core.primitives import Contract, matmul_axes, rows_from_second

_CARRIED = IdentityMemo(2000)


def carried(spec) -> tuple:
    """(init, update, finalize, flipped): the stream's bodies with each state in
    ``flipped`` (positions) carried transposed; the spec's own bodies where none is."""
    return _CARRIED.get((spec,), lambda: _carried(spec))


def _carried(spec):
    update = to_graph(spec.update)
    init = to_graph(spec.init)
    found = {j: ops for j in range(spec.n_state)
             if (ops := _accumulation(update, init, spec, j)) is not None}
    if not found:
        return spec.init, spec.update, spec.finalize, ()
    finalize = to_graph(spec.finalize)
    for j, (add, dot) in found.items():
        _flip_update(update, j, add, dot)
        _flip_init(init, j)
        _flip_finalize(finalize, j)
    return to_diagram(init), to_diagram(update), to_diagram(finalize), tuple(found)


def _reversed(t: ArrayType) -> ArrayType:
    return ArrayType(tuple(reversed(t.axes)), t.dtype)


def _producer(g: nx.DiGraph, v):
    return next(iter(g.predecessors(v)), None)


def _accumulation(update, init, spec, j: int):
    """(add, product) — the update's op nodes of ``s + A·B`` — where state ``j`` is a matrix
    updated only so, started from a fill, and the product's row operand is computed in the
    step and read transposed; None otherwise."""
    t = array_types(spec.init.cod)[j]
    s_in, s_out = update.graph["inputs"][j], update.graph["outputs"][j]
    if len(t.axes) != 2 or update.graph["outputs"].count(s_out) != 1:
        return None
    add = _producer(update, s_out)
    if add is None or update.nodes[add]["box"].spec.kind != "zip" or \
            update.nodes[add]["box"].spec.fn != "add" or s_in not in update.nodes[add]["ins"] \
            or list(update.successors(s_in)) != [add]:
        return None
    other = [v for v in update.nodes[add]["ins"] if v != s_in]
    if len(other) != 1 or list(update.successors(other[0])) != [add]:
        return None
    dot = _producer(update, other[0])
    if dot is None or update.nodes[dot]["box"].spec.kind != "contract":
        return None
    box = update.nodes[dot]["box"]
    ins, outs = box.ins, box.outs
    mm, m_ax, _, summed = matmul_axes(ins, outs)
    if not mm or len(ins) != 2 or outs[0].names != t.names:
        return None
    row = 1 if rows_from_second(ins, outs) else 0
    a, b = update.nodes[dot]["ins"][row], update.nodes[dot]["ins"][1 - row]
    inputs = set(update.graph["inputs"])
    if a in inputs or b not in inputs:  # the rows computed here, the other side loaded
        return None
    names = ins[row].names
    transposed = max(names.index(n) for n in summed) < min(names.index(n) for n in m_ax)
    starts = _producer(init, init.graph["outputs"][j])
    if not transposed or starts is None or init.nodes[starts]["box"].spec.kind != "fill":
        return None
    return add, dot


def _retyped(g: nx.DiGraph, v) -> None:
    ob = g.nodes[v]["ob"]
    g.nodes[v]["ob"] = ArrayOb(ob.name, _reversed(ob.type))


def _rebuilt(g: nx.DiGraph, n, spec) -> None:
    """Op ``n`` made again from ``spec`` on its (retyped) inputs, its outputs retyped."""
    node = g.nodes[n]
    box = make_op(spec, ty(tuple(g.nodes[v]["ob"] for v in node["ins"])),
                  out_names=[g.nodes[v]["ob"].name for v in node["outs"]],
                  name=node["box"].name)
    node["box"] = box
    for v, ob in zip(node["outs"], box.cod.inside):
        g.nodes[v]["ob"] = ob


def _flip_update(g: nx.DiGraph, j: int, add, dot) -> None:
    out = g.nodes[dot]["box"].spec.out
    _retyped(g, g.graph["inputs"][j])
    _rebuilt(g, dot, Contract(tuple(reversed(out))))
    _rebuilt(g, add, g.nodes[add]["box"].spec)


def _flip_init(g: nx.DiGraph, j: int) -> None:
    fill = _producer(g, g.graph["outputs"][j])
    spec = g.nodes[fill]["box"].spec
    _rebuilt(g, fill, type(spec)(spec.value, _reversed(spec.type)))


def _flip_finalize(g: nx.DiGraph, j: int) -> None:
    """The state read transposed, turned back by one transpose before anything reads it."""
    s = g.graph["inputs"][j]
    want = g.nodes[s]["ob"]
    readers = list(g.successors(s))
    _retyped(g, s)
    box = make_op(Contract(want.type.names), ty((g.nodes[s]["ob"],)), out_names=[want.name],
                  name="transpose")
    (back,) = add_op(g, box, [s])
    reroute(g, s, back, readers)
    g.graph["outputs"] = [back if v == s else v for v in g.graph["outputs"]]
