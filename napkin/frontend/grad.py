"""The reverse derivative of an algorithm, as a diagram.

``grad(diagram)`` builds the backward diagram: its inputs are the algorithm's inputs and
one cotangent per floating output (``d<name>``, the output's type); its outputs are the
cotangents of the floating inputs (or of ``wrt``), in input order.  It replays the forward
boxes (their values are what the backward reads: the search decides what to recompute and
what to keep), then walks them in reverse, asking each primitive for its vector-Jacobian
product (``Spec.vjp``, declared beside the primitive's other facts and proved in
proofs/vjp.py) and summing the cotangents of a value read more than once — a copy's reverse
is a sum.  Integer and boolean values carry no cotangent, as in JAX.

``residuals(diagram)`` is the forward that also saves each softmax's row logsumexp (a
sink's logit inside it) and each logsumexp's value, and ``grad(..., residuals=True)`` the
backward that reads them and the saved outputs.
"""
from __future__ import annotations

import re

from napkin.core.arrays import ArrayType
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, view, without_dead_boxes
from napkin.core.primitives import FLOATING
from napkin.frontend import ops
from napkin.frontend.trace import Value, trace


class Reverse:
    """What a primitive's ``vjp`` builds with: napkin.ops, the reshaping of a cotangent
    onto an input's type, and a softmax's row term (:meth:`row_term`)."""
    ops = ops

    @staticmethod
    def row_term(ct: Value, p: Value, axis: str) -> Value:
        """Σ_axis ct ⊙ P, a softmax's row term."""
        return ops.contract(ct, p, out=p.type.without(axis).names)

    @staticmethod
    def rest(p: Value, axis: str, sink: Value) -> Value:
        """1 − Σ_axis P: the probability a softmax's entries leave to its sink."""
        return 1.0 - ops.sum_(p, axis)

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


class _Saved(Reverse):
    """What a softmax's backward reads from the forward's residuals.  Its logsumexp L (the
    sink's logit inside it): the sink's probability is exp(s − L), elementwise, where
    1 − Σ P would be a pass over the keys.  Its row term, where only a contraction with a
    saved output reads the probabilities (attention's O = P·V): Σ_x dP ⊙ P =
    Σ_{Y's other axes} dY ⊙ Y, the adjoint of the contraction (P enters it linearly, once;
    Y keeps P's rows) — FlashAttention-2's D = rowsum(dO ⊙ O), from the saved O instead of
    a pass over the keys."""

    def __init__(self, L: Value, saved: tuple | None, name: str):
        self.L, self.saved, self.name = L, saved, name

    def row_term(self, ct, p, axis):
        if self.saved is None:
            return Reverse.row_term(ct, p, axis)
        dy, y = self.saved
        return ops.contract(dy, y, out=p.type.without(axis).names, as_=self.name)

    def rest(self, p, axis, sink):
        return ops.exp(sink - self.L)


def statistics(diagram) -> set:
    """The names of the row statistics of a :func:`residuals` forward or a
    ``grad(..., residuals=True)`` backward — each saved L (a softmax's, a logsumexp's) and a
    softmax's row term D = Σ dO ⊙ O, among the program's inputs, outputs and the values
    between its kernels: kept in f32 whatever the storage dtype (a bf16 L, off by 2⁻⁸ of
    itself, would scale every recomputed probability exp(S − L) by up to e^0.06), as
    FlashAttention keeps them."""
    wires = [ob.name for ob in (*diagram.dom.inside, *diagram.cod.inside)]
    wires += [ob.name for box in diagram.boxes for ob in box.cod.inside]
    return {n for n in wires if re.fullmatch(r"[LD]\d+", n)}


def residuals(diagram):
    """The forward with what its backward saves (``grad(..., residuals=True)`` reads them):
    its outputs, then each softmax's row logsumexp L = log Σ exp(S) over its axis (a sink's
    logit inside) and each logsumexp's value that is not an output, named ``L<i>`` (the i-th
    such op).  The forward's streams compute L with their own state (the
    search fuses it into the softmax-contraction's stream)."""
    g = view(diagram)
    inputs = g.graph["inputs"]
    pairs = [(g.nodes[v]["ob"].name, g.nodes[v]["ob"].type) for v in inputs]
    order = op_order(g)

    def forward(*args):
        value = dict(zip(inputs, args))
        saved = []
        for n in order:
            node = g.nodes[n]
            ins = [value[v] for v in node["ins"]]
            if not _saves_lse(g, n):
                _replay(g, node, ins, value)
            elif node["box"].spec.kind == "reduce":  # a logsumexp: its value is the L
                (value[node["outs"][0]],) = ops.apply(node["box"].spec, *ins,
                                                      name=node["box"].name,
                                                      out_names=[f"L{len(saved)}"])
                saved.append(value[node["outs"][0]])
            else:
                _replay(g, node, ins, value)
                saved.append(_lse(ins, node["box"].spec.axis, f"L{len(saved)}"))
        return [value[v] for v in g.graph["outputs"]] + saved
    label = getattr(diagram, "name", "") or "algorithm"
    return trace(forward, pairs, f"{label} with residuals")


def _replay(g, node, ins, value: dict) -> None:
    """Record op ``node`` of ``g`` again on ``ins``; its output values go into ``value``."""
    value.update(zip(node["outs"], ops.apply(
        node["box"].spec, *ins, name=node["box"].name,
        out_names=[g.nodes[v]["ob"].name for v in node["outs"]])))


def _saves_lse(g, n) -> bool:
    """Whether op ``n``'s forward saves a row logsumexp L: a softmax's (with a sink or
    without), or a logsumexp's own value — where it is not an output of the algorithm
    already (the backward reads that one among the saved outputs)."""
    from napkin.core.primitives import Reduce, Softmax, SinkSoftmax
    spec = g.nodes[n]["box"].spec
    if type(spec) is Reduce:
        return spec.fn == "logsumexp" and g.nodes[n]["outs"][0] not in g.graph["outputs"]
    return type(spec) in (Softmax, SinkSoftmax)


def _is_lse(spec) -> bool:
    return spec.kind == "reduce" and spec.fn == "logsumexp"


def _lse(ins, axis: str, name: str) -> Value:
    """log(Σ_axis exp(S) [+ exp(s)]): a softmax's L, with its sink s where it has one (as
    log-add-exp, shifted by the larger where finite: a row of −∞ and a −∞ sink is −∞)."""
    if len(ins) == 1:
        return ops.logsumexp(ins[0], axis, as_=name)
    lse, sink = ops.logsumexp(ins[0], axis), ins[1]
    shift = ops.finite_or_zero(ops.maximum(lse, sink))
    return ops.add(shift, ops.log(ops.exp(lse - shift) + ops.exp(sink - shift)), as_=name)


def grad(diagram, wrt=None, name: str | None = None, residuals: bool = False):
    """The backward diagram of ``diagram`` (see the module doc).  ``wrt``: input names (or
    positions) whose cotangents it outputs, default every floating input.  ``residuals``:
    the backward of :func:`residuals`'s forward — its inputs the algorithm's, then its
    floating outputs and the saved L (what the forward saved), then the cotangents;
    a softmax is replayed as exp(S − L) from the saved L, a logsumexp read as its L, and a
    softmax's row term read from a saved output where only a contraction reads it
    (:class:`_Saved`)."""
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
    order = op_order(g)
    stats = [n for n in order if _saves_lse(g, n)] if residuals else []  # each saves an L
    saved = [(g.nodes[v]["ob"].name, g.nodes[v]["ob"].type) for v in seeded] + \
        [(f"L{i}", g.nodes[g.nodes[n]["outs"][0]]["ob"].type.without(
            g.nodes[n]["box"].spec.axis)) for i, n in enumerate(stats)] \
        if residuals else []
    pairs = [(g.nodes[v]["ob"].name, g.nodes[v]["ob"].type) for v in inputs] + saved + \
        [(f"d{g.nodes[v]['ob'].name}", g.nodes[v]["ob"].type) for v in seeded]

    def backward(*args):
        value = dict(zip(inputs, args))
        at = len(inputs)
        outs_in = dict(zip(seeded, args[at:at + len(seeded)])) if residuals else {}
        ls = dict(zip(stats, args[at + len(outs_in):at + len(outs_in) + len(stats)]))
        for n in order:  # the forward, replayed
            node = g.nodes[n]
            ins = [value[v] for v in node["ins"]]
            if _is_lse(node["box"].spec) and (n in ls or node["outs"][0] in outs_in):
                # a logsumexp: the saved L (or the saved output it is), not a pass again
                value[node["outs"][0]] = ls[n] if n in ls else outs_in[node["outs"][0]]
                continue
            if n in ls:  # softmax from the saved L: exp(S − L + (L − L)), zero where the row
                # kept none (rewrites.softmax_lse's form: NaN throughout a row of L = +∞)
                L = ls[n]
                p = ops.guard(ops.exp(ins[0] - L + (L - L)), L,
                              as_=g.nodes[node["outs"][0]]["ob"].name)
                value[node["outs"][0]] = p
                continue
            _replay(g, node, ins, value)
        cts: dict = {}
        for v, seed in zip(seeded, args[len(args) - len(seeded):]):
            _accumulate(cts, v, seed)
        for i, n in reversed(list(enumerate(order))):
            _reverse(g, n, i, value, cts, _saved(g, n, ls, outs_in, cts, stats))
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


def _saved(g, n, ls: dict, outs_in: dict, cts: dict, stats: list):
    """:class:`_Saved` for softmax op ``n`` whose L the forward saved (its row term from a
    saved output where its probabilities are read by one contraction only, once, whose
    output is a saved output keeping the softmax's rows); :class:`Reverse` otherwise."""
    spec = g.nodes[n]["box"].spec
    if n not in ls or spec.kind != "softmax":
        return Reverse
    name = f"D{stats.index(n)}"
    (p,) = g.nodes[n]["outs"]
    readers = list(g.successors(p))
    if len(readers) != 1 or p in g.graph["outputs"]:
        return _Saved(ls[n], None, name)
    m = g.nodes[readers[0]]
    (y,) = m["outs"] if len(m["outs"]) == 1 else (None,)
    if m["box"].spec.kind != "contract" or m["ins"].count(p) != 1 or y not in outs_in \
            or y not in cts:
        return _Saved(ls[n], None, name)
    rows = set(g.nodes[p]["ob"].type.without(spec.axis).names)
    if not rows <= set(g.nodes[y]["ob"].type.names):
        return _Saved(ls[n], None, name)
    return _Saved(ls[n], (cts[y], outs_in[y]), name)


def _reverse(g, n, i: int, value: dict, cts: dict, ad=Reverse) -> None:
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
        grads = spec.vjp(ad, in_types, out_types, [value[v] for v in ins],
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

