"""The reverse derivative of an algorithm, as a diagram.

``grad(diagram)`` builds the backward diagram: its inputs are the algorithm's inputs and
one cotangent per floating output (``d<name>``, the output's type); its outputs are the
cotangents of the floating inputs (or of ``wrt``), in input order.  It replays the forward
boxes (their values are what the backward reads: the search decides what to recompute and
what to keep), then walks them in reverse, asking each primitive for its vector-Jacobian
product (``Spec.vjp``, declared beside the primitive's other facts and proved in
proofs/vjp.py) and summing the cotangents of a value read more than once — a copy's reverse
is a sum.  Integer and boolean values carry no cotangent, as in JAX.
"""
from __future__ import annotations

from napkin.core.arrays import ArrayType
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, view, without_dead_boxes
from napkin.core.primitives import FLOATING
from napkin.frontend import ops
from napkin.frontend.trace import Value, trace


class Reverse:
    """What a primitive's ``vjp`` builds with: napkin.ops, and the reshaping of a cotangent
    onto an input's type."""
    ops = ops

    @staticmethod
    def floating(t: ArrayType) -> bool:
        return t.dtype in FLOATING

    @staticmethod
    def ones(t: ArrayType) -> Value:
        return ops.fill(t, 1.0)

    @staticmethod
    def to(v: Value, t: ArrayType) -> Value:
        """``v`` summed over the axes ``t`` lacks (where the input was broadcast), broadcast
        over those it has and ``v`` lacks, in ``t``'s axis order and dtype."""
        have = v.type.names
        lone = tuple(a for a in t.axes if a.name not in have)
        if have != t.names or lone:
            args = [v, ops.fill(ArrayType(lone, v.type.dtype), 1.0)] if lone else [v]
            v = ops.contract(*args, out=t.names)
        return ops.cast(v, t.dtype) if v.type.dtype != t.dtype else v


def grad(diagram, wrt=None, name: str | None = None):
    """The backward diagram of ``diagram`` (see the module doc).  ``wrt``: input names (or
    positions) whose cotangents it outputs, default every floating input."""
    stopped = getattr(diagram, "stop_gradients", None)
    if stopped:
        raise NapkinError(f"grad: the function stops gradients {stopped[0]} "
                          f"(jax.lax.stop_gradient), which napkin.from_jax reads as the "
                          f"identity: napkin.grad would differ from jax.grad there (one inside "
                          f"a softmax or logsumexp is read with it and is harmless); remove it")
    g = view(diagram)
    inputs, outputs = g.graph["inputs"], g.graph["outputs"]
    names = [g.nodes[v]["ob"].name for v in inputs]
    want = _wrt(wrt, names, [g.nodes[v]["ob"].type for v in inputs])
    seeded = [v for v in outputs if Reverse.floating(g.nodes[v]["ob"].type)]
    if not seeded:
        raise NapkinError("grad: the algorithm has no floating output to differentiate")
    pairs = [(g.nodes[v]["ob"].name, g.nodes[v]["ob"].type) for v in inputs] + \
        [(f"d{g.nodes[v]['ob'].name}", g.nodes[v]["ob"].type) for v in seeded]
    order = op_order(g)

    def backward(*args):
        value = dict(zip(inputs, args))
        for n in order:  # the forward, replayed
            node = g.nodes[n]
            outs = ops.apply(node["box"].spec, *[value[v] for v in node["ins"]],
                             name=node["box"].name,
                             out_names=[g.nodes[v]["ob"].name for v in node["outs"]])
            value.update(zip(node["outs"], outs))
        cts: dict = {}
        for v, seed in zip(seeded, args[len(inputs):]):
            _accumulate(cts, v, seed)
        for i, n in reversed(list(enumerate(order))):
            _reverse(g, n, i, value, cts)
        return [cts[inputs[i]] if inputs[i] in cts else
                ops.fill(g.nodes[inputs[i]]["ob"].type, 0.0) for i in want]
    label = getattr(diagram, "name", "") or "algorithm"
    # the forward's outputs are replayed for the backward's sake only where it reads them
    return without_dead_boxes(trace(backward, pairs, name or f"grad {label}"))


def _wrt(wrt, names, types) -> list[int]:
    if wrt is None:
        return [i for i, t in enumerate(types) if Reverse.floating(t)]
    picked = []
    for w in ([wrt] if isinstance(wrt, (str, int)) else list(wrt)):
        if isinstance(w, int) and not isinstance(w, bool) and 0 <= w < len(names):
            i = w
        elif isinstance(w, str) and w in names:
            i = names.index(w)
        else:
            raise NapkinError(f"grad: wrt={w!r} is not an input (inputs: {', '.join(names)})")
        if not Reverse.floating(types[i]):
            raise NapkinError(f"grad: input {names[i]} has dtype {types[i].dtype}: an integer "
                              f"or boolean input has no cotangent")
        picked.append(i)
    return picked


def _accumulate(cts: dict, v, ct: Value) -> None:
    cts[v] = ct if v not in cts else ops.add(cts[v], ct)  # a copy's reverse: a sum


def _reverse(g, n, i: int, value: dict, cts: dict) -> None:
    node = g.nodes[n]
    box, ins, outs = node["box"], node["ins"], node["outs"]
    if not any(v in cts for v in outs):
        return  # nothing downstream depends on it
    where = f"box {i} ({box.name})"
    if len(outs) != 1:
        raise NapkinError(f"grad: {where} has {len(outs)} outputs; a derivative is declared "
                          f"for one")
    spec = box.spec
    in_types = tuple(g.nodes[v]["ob"].type for v in ins)
    out_types = (g.nodes[outs[0]]["ob"].type,)
    try:
        grads = spec.vjp(Reverse, in_types, out_types, [value[v] for v in ins],
                         value[outs[0]], cts[outs[0]])
    except NapkinError as e:
        raise NapkinError(f"grad: {where}: {e}") from None
    if len(grads) != len(ins):
        raise NapkinError(f"grad: {where}: its derivative gives {len(grads)} cotangents for "
                          f"{len(ins)} inputs")
    for v, t, ct in zip(ins, in_types, grads):
        if ct is None:
            continue
        if ct.type != t:  # a derivative must land on its input's type exactly
            raise NapkinError(f"grad: {where}: the cotangent of {g.nodes[v]['ob'].name} has "
                              f"type {ct.type}, the input {t}")
        _accumulate(cts, v, ct)

