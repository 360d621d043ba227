"""FLOPs and sizes: a sympy functor out of diagrams.

The codomain is a tiny monoidal category whose arrows are sympy counts:
composing or tensoring two arrows adds their counts.  The box mapping is each
primitive's ``flops``; group and stream boxes count their bodies times the
number of pieces.  Everything stays symbolic in the axis and tile sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
from discopy import markov
from discopy.cat import Category

from napkin.core.arrays import array_types


@dataclass(frozen=True)
class Count:
    """An arrow of the counting category: dom/cod are wire counts."""
    value: sympy.Expr
    dom: int
    cod: int

    @classmethod
    def id(cls, dom=0):
        return cls(sympy.Integer(0), _n(dom), _n(dom))

    def then(self, *others):
        out = self
        for o in others:
            out = Count(out.value + o.value, out.dom, o.cod)
        return out

    def tensor(self, *others):
        out = self
        for o in others:
            o = o if isinstance(o, Count) else Count.id(o)  # whiskering by an object
            out = Count(out.value + o.value, out.dom + o.dom, out.cod + o.cod)
        return out

    @classmethod
    def swap(cls, left, right):  # wiring costs nothing
        return cls(sympy.Integer(0), _n(left) + _n(right), _n(left) + _n(right))

    @classmethod
    def copy(cls, x, n=2):
        return cls(sympy.Integer(0), _n(x), _n(x) * n)

    __rshift__ = then
    __matmul__ = tensor


def _n(dom) -> int:
    return dom if isinstance(dom, int) else len(dom)


class CountTy(int):
    """Objects of the counting category: the number of wires."""

    def __new__(cls, n=0):
        return int.__new__(cls, _n(n) if not isinstance(n, int) else n)

    def tensor(self, *others):
        if any(isinstance(o, Count) for o in others):  # whiskering an arrow
            return Count.id(self).tensor(*others)
        return CountTy(int(self) + sum(int(o) for o in others))

    __matmul__ = __add__ = tensor  # DisCoPy sums the images of a type's objects

    @property
    def inside(self):
        return (self,) * int(self)


def _box_flops(box) -> Count:
    spec = box.spec
    return Count(sympy.sympify(spec.flops(tuple(array_types(box.dom)), tuple(array_types(box.cod)))),
                 len(box.dom), len(box.cod))


def flops_functor() -> markov.Functor:
    """The FLOP-count functor (copy, discard and swap cost nothing)."""
    return markov.Functor(ob=lambda ob: CountTy(1), ar=_box_flops, cod=Category(CountTy, Count))


def flops(diagram) -> sympy.Expr:
    """Total FLOPs of a diagram, symbolic in its axis sizes (iterative, no recursion)."""
    total = sympy.Integer(0)
    for box in diagram.boxes:
        if isinstance(box, (markov.Copy, markov.Swap)):
            continue
        total += _box_flops(box).value
    return sympy.simplify(total)


def sizes(diagram) -> dict[str, sympy.Expr]:
    """Number of values on every named wire of a diagram (inputs, outputs, boxes)."""
    out = {}
    for ob in diagram.dom.inside:
        out[str(ob)] = ob.type.numel
    for box in diagram.boxes:
        for ob in box.cod.inside:
            out[str(ob)] = ob.type.numel
    return out
