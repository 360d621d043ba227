"""Streamed programs are diagrams too: group and stream partitions as boxes.

A :class:`Group` box holds a sub-diagram (its *body*) typed with one woven axis
relabelled to the group size (``q`` → ``g_q``); it means: cut the inputs that
carry the axis into groups, run the body on each group (at a lower memory
level), concatenate the outputs.  Inputs without the axis are broadcast to
every group.

A :class:`Stream` box holds an accumulator — three small diagrams over a state
type — ``init: () → state``, ``update: state ⊗ inputs[chunk] → state``,
``finalize: state ⊗ fixed inputs → outputs`` (fixed = without the axis); it means: fold ``update`` over chunks of the
streamed axis, then ``finalize``.  Inputs without the axis are passed whole to
every update.

Both are ordinary :class:`~napkin.primitives.Spec` s, so the semantics,
cost and drawing functors — and the lowering — see them like any other box.
Ragged last groups/chunks are handled by binding the size symbol to the
actual length of each piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import sympy

from napkin.arrays import ArrayType, array_types
from napkin.errors import NapkinError
from napkin.primitives import EvalContext, Spec


def _runtime_size(axis: str, ins, xs) -> int:
    for t, x in zip(ins, xs):
        if t.has(axis):
            return int(x.shape[t.names.index(axis)])
    raise NapkinError(f"no input carries axis {axis}")


def _piece_size(ctx: EvalContext, size) -> int:
    try:
        return int(ctx.number(size))
    except NapkinError:
        raise NapkinError(f"tile size {size} has no value: choose tiles "
                          f"(e.g. sizes={{'{size}': 64}}) before evaluating") from None


def _relabel(types, axis: str, size) -> tuple[ArrayType, ...]:
    return tuple(t.resize(axis, size) if t.has(axis) else t for t in types)


def _check_same(what: str, got, want):
    if tuple(got) != tuple(want):
        g = ", ".join(f"{t}{'{'}{','.join(str(a.size) for a in t.axes)}{'}'}" for t in got)
        w = ", ".join(f"{t}{'{'}{','.join(str(a.size) for a in t.axes)}{'}'}" for t in want)
        raise NapkinError(f"{what}: inputs are {g} but the body expects {w}")


def _pieces(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


@dataclass(frozen=True)
class Group(Spec):
    """Group partition of ``axis`` with group size ``size`` at memory ``level``."""
    axis: str
    size: Any
    body: Any           # a napkin Diagram, typed at the group size
    level: str = "smem"
    kind: ClassVar[str] = "group"
    n_in: ClassVar[None] = None

    @property
    def bodies(self) -> tuple:
        """The diagrams this box holds."""
        return (self.body,)

    def infer(self, ins):
        _check_same(f"group {self.axis}", _relabel(ins, self.axis, self.size),
                    array_types(self.body.dom))
        full = next(t.axis(self.axis) for t in ins if t.has(self.axis))
        outs = array_types(self.body.cod)
        for t in outs:
            if not t.has(self.axis):
                raise NapkinError(f"group {self.axis}: output {t} lacks the grouped axis "
                                  f"(a group partition needs every output woven over it)")
        return tuple(t.resize(self.axis, full.size) for t in outs)

    def evaluate(self, ctx, ins, outs, *xs):
        from napkin.semantics import run
        xp, n = ctx.xp, _runtime_size(self.axis, ins, xs)
        results = []
        for start, stop in _pieces(n, _piece_size(ctx, self.size)):
            sub = ctx.shifted(self.axis, start).bound(self.size, stop - start)
            args = [xp.take(x, t.names.index(self.axis), start, stop) if t.has(self.axis) else x
                    for t, x in zip(ins, xs)]
            results.append(run(self.body, sub, *args))
        return tuple(xp.concatenate([r[i] for r in results], axis=t.names.index(self.axis))
                     for i, t in enumerate(outs))

    def flops(self, ins, outs):
        from napkin.flops import flops
        full = next(t.axis(self.axis) for t in ins if t.has(self.axis)).size
        return flops(self.body) * full / self.size

    def woven(self, axis):
        raise NapkinError(f"weave a diagram before partitioning it (cannot weave {axis} "
                          f"into an existing group over {self.axis})")

    def relabelled(self, axis, size):
        from napkin.region import relabel
        if axis == self.axis:
            return self  # the body already sees the group size
        return Group(self.axis, self.size, relabel(self.body, axis, size), self.level)

    def label(self):
        return f"group {self.axis} ({self.size}) @ {self.level}"


@dataclass(frozen=True)
class Stream(Spec):
    """Stream partition of ``axis`` in chunks of ``chunk`` with an accumulator."""
    axis: str
    chunk: Any
    init: Any           # Diagram: () -> state
    update: Any         # Diagram: state @ inputs (axis at chunk size) -> state
    finalize: Any       # Diagram: state @ inputs lacking the axis -> outputs
    rule: str = "stream"
    kind: ClassVar[str] = "stream"
    n_in: ClassVar[None] = None

    @property
    def bodies(self) -> tuple:
        """The diagrams this box holds."""
        return (self.init, self.update, self.finalize)

    @property
    def n_state(self) -> int:
        return len(self.init.cod)

    def infer(self, ins):
        state = array_types(self.init.cod)
        want = array_types(self.update.dom)
        fixed = [t for t in ins if not t.has(self.axis)]
        if tuple(want[:len(state)]) != tuple(state) or array_types(self.update.cod) != state \
                or array_types(self.finalize.dom) != state + fixed:
            raise NapkinError(f"stream {self.axis}: init, update and finalize disagree on the state")
        _check_same(f"stream {self.axis}", _relabel(ins, self.axis, self.chunk),
                    want[len(state):])
        if not any(t.has(self.axis) for t in ins):
            raise NapkinError(f"stream {self.axis}: no input carries the streamed axis")
        return tuple(array_types(self.finalize.cod))

    def evaluate(self, ctx, ins, outs, *xs):
        from napkin.semantics import run
        xp, n = ctx.xp, _runtime_size(self.axis, ins, xs)
        state = run(self.init, ctx)
        for start, stop in _pieces(n, _piece_size(ctx, self.chunk)):
            sub = ctx.shifted(self.axis, start).bound(self.chunk, stop - start)
            args = [xp.take(x, t.names.index(self.axis), start, stop) if t.has(self.axis) else x
                    for t, x in zip(ins, xs)]
            state = run(self.update, sub, *state, *args)
        fixed = [x for t, x in zip(ins, xs) if not t.has(self.axis)]
        return run(self.finalize, ctx, *state, *fixed)

    def flops(self, ins, outs):
        from napkin.flops import flops
        full = next(t.axis(self.axis) for t in ins if t.has(self.axis)).size
        return flops(self.update) * full / self.chunk + flops(self.finalize)

    def woven(self, axis):
        raise NapkinError(f"weave a diagram before partitioning it (cannot weave {axis} "
                          f"into an existing stream over {self.axis})")

    def relabelled(self, axis, size):
        from napkin.region import relabel
        if axis == self.axis:
            return self
        return Stream(self.axis, self.chunk, relabel(self.init, axis, size),
                      relabel(self.update, axis, size), relabel(self.finalize, axis, size),
                      self.rule)

    def label(self):
        return f"stream {self.axis} ({self.chunk}) [{self.rule}]"


def tile_symbol(kind: str, axis: str) -> sympy.Symbol:
    """The conventional tile-size symbol: g_q for groups, s_x for streams."""
    return sympy.Symbol(f"{kind}_{axis}", integer=True, positive=True)
