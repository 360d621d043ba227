"""Stating algorithms by writing ordinary Python over symbolic arrays.

``@algorithm(Q=(q, d), K=(x, d), ...)`` calls the function once on symbolic
:class:`Value` s; each primitive call records a box into a graph; the graph is
emitted as a DisCoPy diagram (napkin.core.ir.to_diagram).  Copies, discards and
swaps are inserted for you.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass

from napkin.core.arrays import ArrayOb, ArrayType, Axis
from napkin.core.errors import NapkinError
from napkin.core.ir import GraphBuilder, to_diagram
from napkin.core.op import make_op

_current: contextvars.ContextVar["Builder | None"] = contextvars.ContextVar("napkin_builder", default=None)


class Value:
    """A symbolic array inside a traced algorithm."""

    def __init__(self, builder: Builder, node: int):
        self.builder, self.node = builder, node

    @property
    def ob(self) -> ArrayOb:
        return self.builder.gb.graph.nodes[self.node]["ob"]

    @property
    def type(self) -> ArrayType:
        return self.ob.type

    @property
    def name(self) -> str:
        return self.ob.name

    @property
    def axes(self):
        return self.type.axes

    def __repr__(self):
        return f"Value({self.ob})"

    # Elementwise arithmetic reads like numpy, through the primitive operations napkin.frontend.ops
    # registers here when it is imported (ops builds on this module, not the reverse)
    arithmetic = None

    def _op(self, name):
        if Value.arithmetic is None:
            raise NapkinError("arithmetic on traced arrays needs napkin.frontend.ops (import napkin)")
        return getattr(Value.arithmetic, name)

    def __add__(self, o): return self._op("add")(self, o)
    def __radd__(self, o): return self._op("add")(o, self)
    def __sub__(self, o): return self._op("sub")(self, o)
    def __rsub__(self, o): return self._op("sub")(o, self)
    def __mul__(self, o): return self._op("mul")(self, o)
    def __rmul__(self, o): return self._op("mul")(o, self)
    def __truediv__(self, o): return self._op("div")(self, o)
    def __rtruediv__(self, o): return self._op("div")(o, self)
    def __neg__(self): return self._op("neg")(self)


class Builder:
    """Records boxes into a graph while an algorithm is traced."""

    def __init__(self, name: str):
        self.name = name
        self.gb = GraphBuilder()

    def input(self, name: str, type: ArrayType) -> Value:
        return Value(self, self.gb.input(ArrayOb(name, type)))

    def apply(self, spec, args: list[Value], name: str | None = None, out_names=None) -> list[Value]:
        for a in args:
            if not isinstance(a, Value):
                raise NapkinError(f"{name or spec.label()}: expected a traced array, got {a!r}")
            if a.builder is not self:
                raise NapkinError(f"{name or spec.label()}: array {a.name} belongs to another algorithm")
        from discopy import markov
        dom = markov.Ty(*(a.ob for a in args))
        box = make_op(spec, dom, out_names, name)
        return [Value(self, v) for v in self.gb.op(box, [a.node for a in args])]

    def build(self, outputs):
        outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        for o in outs:
            if not isinstance(o, Value) or o.builder is not self:
                raise NapkinError(f"algorithm {self.name}: outputs must be arrays it computed, got {o!r}")
        return to_diagram(self.gb.finish([o.node for o in outs]))


def current() -> Builder:
    b = _current.get()
    if b is None:
        raise NapkinError("napkin ops build diagrams: call them inside an @algorithm function")
    return b


@dataclass(frozen=True)
class Array:
    """Input declaration: ``Array(q, d, dtype="bf16")``."""
    axes: tuple[Axis, ...]
    dtype: str = "f32"

    def __init__(self, *axes_: Axis, dtype: str = "f32"):
        object.__setattr__(self, "axes", tuple(axes_))
        object.__setattr__(self, "dtype", dtype)


def _as_type(spec, dtype: str) -> ArrayType:
    if isinstance(spec, ArrayType):
        return spec
    if isinstance(spec, Array):
        return ArrayType(spec.axes, spec.dtype)
    if isinstance(spec, Axis):
        spec = (spec,)
    if isinstance(spec, (tuple, list)) and all(isinstance(a, Axis) for a in spec):
        return ArrayType(tuple(spec), dtype)
    raise NapkinError(f"an input is declared by a tuple of Axis or Array(...), got {spec!r}")


def trace(fn, inputs, name: str | None = None, dtype: str = "f32"):
    """Trace ``fn`` on symbolic inputs; return its diagram.

    ``inputs``: ``{name: axes or Array}``, or a list of ``(name, type)`` pairs
    when names repeat."""
    b = Builder(name or getattr(fn, "__name__", "algorithm"))
    pairs = inputs.items() if isinstance(inputs, dict) else inputs
    args = [b.input(k, _as_type(v, dtype)) for k, v in pairs]
    token = _current.set(b)
    try:
        out = fn(*args)
    finally:
        _current.reset(token)
    return b.build(out)


def algorithm(name: str | None = None, dtype: str = "f32", **inputs):
    """Decorator: ``@algorithm(Q=(q, d), K=(x, d))`` replaces the function by its diagram."""
    def wrap(fn):
        return trace(fn, inputs, name, dtype)
    return wrap
