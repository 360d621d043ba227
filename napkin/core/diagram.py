"""The diagram category: DisCoPy's free Markov category, with array wires.

We subclass ``discopy.markov`` only to (1) keep composites inside our own
factory (so ``>>`` and ``@`` build napkin diagrams) and (2) replace DisCoPy's
generic "does not compose" assertion by a message that names both sides, and
(3) build layers and types without DisCoPy's per-step re-checking (the search
builds thousands of diagrams; these are the same objects, made once).
"""
from __future__ import annotations

from discopy import cat, markov
from discopy.cat import factory
from discopy.monoidal import DRAWING_ATTRIBUTES, Layer

from napkin.core.arrays import ArrayOb, describe
from napkin.core.errors import CompositionError
from napkin.core.memo import IdentityMemo


def _name(d) -> str:
    if isinstance(d, markov.Box) and not isinstance(d, (markov.Copy, markov.Swap)):
        return d.name
    boxes = [b for b in d.boxes if not isinstance(b, (markov.Copy, markov.Swap))]
    return boxes[-1].name if boxes else "the wiring"


def check_composable(left: markov.Diagram, right: markov.Diagram) -> None:
    if left.cod == right.dom:
        return
    lc, rd = left.cod.inside, right.dom.inside
    if len(lc) != len(rd):
        raise CompositionError(
            f"cannot compose: {_name(left)} outputs {len(lc)} array(s) ({describe(left.cod)}) "
            f"but {_first_name(right)} expects {len(rd)} ({describe(right.dom)})")
    for out, inp in zip(lc, rd):
        if out != inp:
            a, b = str(out), str(inp)
            if a.partition("[")[2] == b.partition("[")[2]:  # same axis names: show sizes
                a, b = _long(out), _long(inp)
            raise CompositionError(
                f"cannot compose: {_name(left)} outputs {a} but {_first_name(right)} expects {b}")


def _first_name(d) -> str:
    if isinstance(d, markov.Box) and not isinstance(d, (markov.Copy, markov.Swap)):
        return d.name
    boxes = [b for b in d.boxes if not isinstance(b, (markov.Copy, markov.Swap))]
    return boxes[0].name if boxes else "the wiring"


def _long(ob) -> str:
    """S[q,x] — plus sizes and dtype when the names alone look the same."""
    if not isinstance(ob, ArrayOb):
        return str(ob)
    t = ob.type
    sizes = ",".join(f"{a.name}={a.size}" for a in t.axes)
    return f"{ob}" + f" ({sizes}; {t.dtype})"


# ----------------------------------------------------------- fast construction
_TYPES, BOXES = IdentityMemo(), IdentityMemo()  # BOXES: structural boxes (swaps, copies)


def ty(obs: tuple) -> markov.Ty:
    """``markov.Ty(*obs)`` for array objects, without re-checking each one."""
    return _TYPES.get(obs, lambda: _make_ty(obs))


def _make_ty(obs: tuple) -> markov.Ty:
    if not all(isinstance(ob, ArrayOb) for ob in obs):
        return markov.Ty(*obs)
    out = markov.Ty.__new__(markov.Ty)
    out.inside = obs
    out.name = " @ ".join(map(str, obs)) or "Ty()"  # what Ty.__init__ names it
    return out


def layer(left: tuple, box, right: tuple) -> Layer:
    """``Layer(Ty(*left), box, Ty(*right))`` without its chain of ``@`` (each of
    which re-checks and re-names a fresh type): the same attributes, built once."""
    out = Layer.__new__(Layer)
    lt, rt = ty(left), ty(right)
    out.boxes_or_types = (lt, box, rt)
    out.name = " @ ".join([*([str(lt)] if left else []), str(box), *([str(rt)] if right else [])])
    out.data, out.is_dagger = None, False
    out.dom = ty((*left, *box.dom.inside, *right))
    out.cod = ty((*left, *box.cod.inside, *right))
    out.inside = (out,)
    return out


@factory
class Diagram(markov.Diagram):
    """A napkin diagram: a DisCoPy Markov diagram whose wires are arrays."""

    def then(self, *others):
        left = self
        for other in others:
            if isinstance(other, markov.Diagram):
                check_composable(left, other)
                left = other
        return super().then(*others)


class Box(markov.Box, Diagram):
    __ambiguous_inheritance__ = (markov.Box,)

    def __init__(self, name: str, dom: markov.Ty, cod: markov.Ty, **params):
        # monoidal.Box.__init__ minus its last step, which re-scans the box's one
        # layer for composability (building two identities per box)
        for attr in DRAWING_ATTRIBUTES:
            if attr in params:
                setattr(self, attr, params.pop(attr))
        cat.Box.__init__(self, name, dom, cod, **params)
        self.inside = (self.layer_factory.cast(self),)


class Swap(markov.Swap, Box):
    __ambiguous_inheritance__ = (markov.Swap,)


class Copy(markov.Copy, Box):
    __ambiguous_inheritance__ = (markov.Copy,)


class Discard(markov.Discard, Copy):
    __ambiguous_inheritance__ = (markov.Discard,)


class _FastLayers:
    """Box construction casts the box to a layer; DisCoPy's own cast re-checks
    and re-names four fresh types per box, which dominated rewriting."""

    @staticmethod
    def cast(box) -> Layer:
        return layer((), box, ())


Box.layer_factory = _FastLayers
Diagram.braid_factory = Swap
Diagram.copy_factory = Copy
Diagram.discard_factory = Discard
Id = Diagram.id


def is_diagram(value) -> bool:
    """Whether ``value`` is a diagram (a napkin or DisCoPy one: boxes, dom and cod)."""
    return hasattr(value, "boxes") and hasattr(value, "dom") and hasattr(value, "cod")
