"""The one kind of computational box: a primitive spec on typed wires."""
from __future__ import annotations

from discopy import markov

from napkin.core.arrays import ArrayOb, array_types
from napkin.core.diagram import Box
from napkin.core.errors import NapkinError
from napkin.core.primitives import Spec, roles


class Op(Box):
    """A box whose ``data`` is a :class:`~napkin.core.primitives.Spec`."""

    def __init__(self, name: str, dom: markov.Ty, cod: markov.Ty, data: Spec = None, **params):
        if not isinstance(data, Spec):
            raise NapkinError(f"box {name!r} needs a primitive spec, got {data!r}")
        Box.__init__(self, name, dom, cod, data=data, **params)

    @property
    def spec(self) -> Spec:
        return self.data

    @property
    def ins(self):
        return tuple(array_types(self.dom))

    @property
    def outs(self):
        return tuple(array_types(self.cod))

    def roles(self) -> dict:
        return roles(self.ins, self.outs)

    def __repr__(self):
        return f"Op({self.name!r}, {self.dom}, {self.cod})"


def make_op(spec: Spec, dom: markov.Ty, out_names=None, name: str | None = None) -> Op:
    """Type-check ``spec`` on the input wires ``dom`` and build its box."""
    ins = tuple(array_types(dom))
    try:
        outs = spec.infer(ins)
    except NapkinError as e:
        raise NapkinError(f"{name or spec.label()}: {e}") from None
    if out_names is None:
        out_names = [f"{spec.kind}{i}" if len(outs) > 1 else (name or spec.label())
                     for i in range(len(outs))]
    cod = markov.Ty(*(ArrayOb(n, t) for n, t in zip(out_names, outs)))
    return Op(name or spec.label(), dom, cod, data=spec)
