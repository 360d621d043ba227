"""The layouts a kernel gives a stream's state and inputs, and what they stage.  The Triton
writer follows them (napkin.lower.backends.triton) and the schedule counts their shared
memory (napkin.schedule.build): one decision, read by both.

**State carried transposed, where that frees registers.**

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

**An input the loop reads transposed, transposed before it.**  A tile loaded before the loop
that a product reads with its summed axis where the product needs the other (K in
S = Q·Kᵀ of the dK, dV kernel, whose rows are the query chunk) was transposed by Triton
where the product is: in the loop, from registers, into a shared-memory buffer every step
(32 KiB of stores a step for K and V, 16 KiB of registers a thread held for them).
Transposed once before the loop, Triton stages it in shared memory once, as it stages any
operand loaded before the loop (218 → 204 registers).

**What a product stages.**  A tensor-core product reads its second operand (the columns)
from shared memory, and its first where a reduction gave it its layout (RMSNorm's
x̂ = x·rsqrt(mean x²) is converted to the operand's through shared memory; gelu(x) is loaded
in the operand's layout, P made by a product is converted in registers).  One computed in
the kernel is stored there at the product and dead after it (:func:`staged_operands`; P and
dS of the dK, dV kernel, carried transposed, take one buffer in turn): the schedule holds it
at the product's step.

:func:`carried` rewrites a stream's bodies for the first two; the kernel's meaning is
unchanged (named axes: the same array in another order).
"""
from __future__ import annotations

import networkx as nx

from napkin.core.arrays import ArrayOb, ArrayType, array_types
from napkin.core.diagram import ty
from napkin.core.ir import add_op, ops, reroute, to_diagram, to_graph, view
from napkin.core.memo import IdentityMemo
from napkin.core.op import make_op
from napkin.core.primitives import Contract, matmul_axes, rows_from_second

_CARRIED = IdentityMemo(2000)


def carried(spec) -> tuple:
    """(init, update, finalize, flipped, laid): the stream's bodies with each state in
    ``flipped`` (positions) carried transposed, and the update reading each input in
    ``laid`` (positions among the stream's inputs) transposed — the kernel transposes it
    once before the loop; the spec's own bodies where neither is."""
    return _CARRIED.get((spec,), lambda: _carried(spec))


def _carried(spec):
    update = to_graph(spec.update)
    init = to_graph(spec.init)
    found = {j: pair for j in range(spec.n_state)
             if (pair := _accumulation(update, init, spec, j)) is not None}
    laid = tuple(i for i, t in enumerate(array_types(spec.update.dom)[spec.n_state:])
                 if not t.has(spec.axis) and _read_transposed(update, spec.n_state + i))
    if not found and not laid:
        return spec.init, spec.update, spec.finalize, (), ()
    finalize = to_graph(spec.finalize)
    for j, (add, dot) in found.items():
        _flip_update(update, j, add, dot)
        _flip_init(init, j)
        _flip_finalize(finalize, j)
    for i in laid:
        _lay_input(update, spec.n_state + i)
    return to_diagram(init), to_diagram(update), to_diagram(finalize), tuple(found), laid


def _matrix(names, squeezed) -> tuple:
    return tuple(n for n in names if n not in squeezed)


def _read_transposed(g: nx.DiGraph, k: int) -> bool:
    """Whether the update's input ``k``, a matrix, is read only by matrix products that
    take it transposed: its summed axis first where it gives the rows, last where it gives
    the columns (napkin.lower.emit writes ``lax.dot_general``, and Triton transposes such an
    operand where the product is: in the loop, every step, from registers)."""
    v = g.graph["inputs"][k]
    names = g.nodes[v]["ob"].type.names
    readers = list(g.successors(v))
    if len(names) != 2 or not readers:
        return False
    for r in readers:
        box = g.nodes[r]["box"]
        if not _tensor_core(box) or g.nodes[r]["ins"].count(v) != 1:
            return False
        summed = matmul_axes(box.ins, box.outs)[3]
        rows = (g.nodes[r]["ins"].index(v) == 1) == rows_from_second(box.ins, box.outs)
        if len(summed) != 1 or names.index(summed[0]) != (0 if rows else 1):
            return False
    return True


def _tensor_core(box, squeezed=frozenset()) -> bool:
    """Whether ``box`` is a matrix product a kernel gives the tensor cores: no batch axis
    (one in both operands and the output) but the ``squeezed`` and those of size 1."""
    if box.spec.kind != "contract" or len(box.ins) != 2 or \
            not matmul_axes(box.ins, box.outs)[0]:
        return False
    a, b = box.ins
    out = {n for t in box.outs for n in t.names}
    return all(x.size == 1 or x.name in squeezed for x in a.axes
               if x.name in out and b.has(x.name))


def _lay_input(g: nx.DiGraph, k: int) -> None:
    v = g.graph["inputs"][k]
    _retyped(g, v)
    for r in g.successors(v):
        _rebuilt(g, r, g.nodes[r]["box"].spec)


def _reversed(t: ArrayType) -> ArrayType:
    return ArrayType(tuple(reversed(t.axes)), t.dtype)


def _producer(g: nx.DiGraph, v):
    return next(iter(g.predecessors(v)), None)


def _accumulation(update, init, spec, j: int, squeezed=frozenset()):
    """(add, product) — the update's op nodes of ``s + A·B`` — where state ``j`` is a matrix
    updated only so, started from a fill, and the product's row operand is computed in the
    step and read transposed; None otherwise.  ``squeezed``: axes the kernel drops (a grid
    axis at a tile of 1, napkin.lower.plan), not counted as the matrix's (the schedule,
    built before tiles have values, asks with its group tiles' batch axes: what the kernel
    written at a tile of 1 sees)."""
    t = array_types(spec.init.cod)[j]
    s_in, s_out = update.graph["inputs"][j], update.graph["outputs"][j]
    if len(_matrix(t.names, squeezed)) != 2 or update.graph["outputs"].count(s_out) != 1:
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
    if dot is None or not _tensor_core(update.nodes[dot]["box"], squeezed):
        return None
    box = update.nodes[dot]["box"]
    ins, outs = box.ins, box.outs
    _, m_ax, _, summed = matmul_axes(ins, outs)
    if outs[0].names != t.names:
        return None
    row = 1 if rows_from_second(ins, outs) else 0
    a, b = update.nodes[dot]["ins"][row], update.nodes[dot]["ins"][1 - row]
    inputs = set(update.graph["inputs"])
    if a in inputs or b not in inputs:  # the rows computed here, the other side loaded
        return None
    names = _matrix(ins[row].names, squeezed)
    m_ax = _matrix(m_ax, squeezed)
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


def batch_axes(g: nx.DiGraph) -> set:
    """The axes some product of body graph ``g`` batches over: in both its operands and
    its output."""
    out = set()
    for n in g.nodes:
        box = g.nodes[n].get("box")
        if box is not None and box.spec.kind == "contract" and len(box.ins) == 2:
            a, b = box.ins
            out |= {x for x in a.names if b.has(x) and any(x in t.names for t in box.outs)}
    return out


def staged_operands(g: nx.DiGraph, squeezed: frozenset = frozenset(), spec=None) -> list:
    """[(value, product)]: the values of body graph ``g`` (a view) computed in it that a
    tensor-core product reads from shared memory, where the kernel stores each at its
    product — its second operand (the columns: wgmma reads them from shared memory), and its
    first where a reduction, not a product, gave it its layout (RMSNorm's x̂ = x·rsqrt(mean
    x²), made in the layout a row sum needs, is converted to the operand's through shared
    memory; gelu(x) is loaded in the operand's layout, P before P·V converts in registers).
    Measured: Triton 3.9's allocations, sm_90 (tests/test_launch.py).  ``spec``: the stream
    whose update ``g`` is — a state it carries transposed (:func:`carried`) swaps its
    product's operands."""
    flipped = set()
    if spec is not None:
        init = view(spec.init)
        flipped = {found[1] for j in range(spec.n_state)
                   if (found := _accumulation(g, init, spec, j, squeezed)) is not None}
    inputs = set(g.graph["inputs"])
    from_product: set = set()
    from_reduction: set = set()
    out = []
    for n in ops(g):
        node = g.nodes[n]
        box = node["box"]
        core = _tensor_core(box, squeezed)
        if core or any(v in from_product for v in node["ins"]):
            from_product.update(node["outs"])
        elif not pointwise(box) or any(v in from_reduction for v in node["ins"]):
            from_reduction.update(node["outs"])
        if not core:
            continue
        first, second = node["ins"][::-1] if rows_from_second(box.ins, box.outs) \
            else node["ins"]
        if n in flipped:
            first, second = second, first
        if second not in inputs:
            out.append((second, n))
        if first in from_reduction:
            out.append((first, n))
    return out


def pointwise(box) -> bool:
    """Whether ``box`` acts entry by entry: an elementwise box, or a product that sums no
    axis (a row scaled)."""
    if box.spec.kind == "contract":
        return not matmul_axes(box.ins, box.outs)[3]
    return getattr(box.spec, "elementwise", False)
