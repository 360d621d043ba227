"""Self-attention from one input: where an axis meets itself (``x @ x.T``: an array with
two dimensions of axis t), the operand that brings the second dimension is read over a
second axis t_2 — the same argument passed again under another name.

napkin arrays name each axis once, and napkin has no box renaming an axis; an argument
read twice needs none.  The operand's cone (the equations between it and the arguments
carrying t, and the aranges of t's length) is copied, its arguments replaced by copies
that carry t_2, and unification runs again; where the copy later meets the original
(P[t, t_2] @ V[t, e]: V is a projection of x too), that operand is copied the same way.
The diagram then takes the argument twice (``diagram.arguments`` says which function
argument each input is), and ``diagram.sizes`` gives t_2 the size of t.  Nothing is
computed twice that JAX would not: K = x·W_k is only ever read over t_2.
"""
from __future__ import annotations

import sympy

from napkin.frontend.jaxpr.naming import Clash
from napkin.frontend.jaxpr.tracing import Eqn, Traced, Var
from napkin.frontend.jaxpr.vocabulary import fail

# how many operands may be read again before the import gives up (self-attention needs 2:
# the keys and the values; a causal mask's arange is a third)
MOST = 8


class Renaming:
    """The arguments read twice so far: per diagram input its function argument
    (``sources``), the axis names of each (``names``), and {t_2: t} (``aliases``)."""

    def __init__(self, traced: Traced, names, argnames):
        self.t = traced
        self.names = None if names is None else [list(n) for n in names]
        self.argnames = list(argnames)
        self.sources = list(range(len(traced.invars)))
        self.aliases: dict = {}          # second axis -> the axis it copies
        self.renamed: dict = {}          # id(copied eqn) -> {axis: second axis}
        self._second: dict = {}          # axis -> its second axis
        self._copies: dict = {}          # (axis, id(var)) -> the var's copy
        self.count = 0

    @property
    def read_twice(self) -> bool:
        return len(self.sources) > len(set(self.sources))

    def second(self, axis: str) -> str:
        if axis not in self._second:
            taken = set(self.t.sizes) | set(self.aliases)
            k = 2
            while f"{axis}_{k}" in taken:
                k += 1
            name = f"{axis}_{k}"
            self._second[axis], self.aliases[name] = name, axis
            self.t.sizes[name] = self.t.sizes[axis]
            self.t.symbols[name] = sympy.Symbol(name, integer=True, positive=True)
        return self._second[axis]

    def resolve(self, eqns: list, clash: Clash) -> list:
        """``eqns`` with ``clash.var`` read over the second axis at ``clash.eqn``."""
        self.count += 1
        axis = self.aliases.get(clash.axis, clash.axis)
        if self.names is None:
            fail(f"fn reads axis {axis} twice ({clash.why} at {clash.eqn.where()}: "
                 f"self-attention from one input); name the arguments' axes with axes= and "
                 f"napkin reads the second as a copy of the argument")
        if self.count > MOST or clash.axis != axis:
            fail(f"fn makes {clash.why} ({clash.eqn.where()}) and napkin cannot tell which "
                 f"operand reads the second; pass that operand's source as an argument of "
                 f"its own, under another axis name")
        second = self.second(axis)
        order = {id(e): i for i, e in enumerate(eqns)}
        added: list = []
        copy = self._copier(axis, second, order, added)
        new = copy(clash.var)
        if new is clash.var:
            fail(f"fn makes {clash.why} ({clash.eqn.where()}) from an operand that no "
                 f"argument over {axis} feeds; pass it as an argument of its own, under "
                 f"another axis name")
        clash.eqn.ins = [new if a is clash.var else a for a in clash.eqn.ins]
        out = []
        after: dict = {}
        for e, orig in added:
            after.setdefault(id(orig), []).append(e)
        for e in eqns:
            out.append(e)
            out.extend(after.get(id(e), []))
        return out

    def _copier(self, axis, second, order, added):
        sym = self.t.symbols[axis]

        def carries(v) -> bool:
            i = next(k for k, w in enumerate(self.t.invars) if w is v)
            return axis in self.names[i]

        def copy(v):
            if not isinstance(v, Var):
                return v
            key = (axis, id(v))
            if key in self._copies:
                return self._copies[key]
            e = v.eqn
            if e is None:  # an argument: its copy over the second axis, if it carries t
                if not carries(v):
                    return v
                i = next(k for k, w in enumerate(self.t.invars) if w is v)
                c = Var(v.shape, v.dtype)
                self.t.invars.append(c)
                self.sources.append(self.sources[i])
                self.names.append([second if n == axis else n for n in self.names[i]])
                self.argnames.append(_fresh(self.argnames[i], self.argnames))
            elif id(e) not in order:  # an equation outside the live program
                return v
            else:
                ins = [copy(a) for a in e.ins]
                made_here = not any(isinstance(a, Var) for a in e.ins) and any(
                    isinstance(d, sympy.Basic) and sym in d.free_symbols
                    for o in e.outs for d in o.shape)
                if all(a is b for a, b in zip(ins, e.ins)) and not made_here:
                    return v
                outs = [Var(o.shape, o.dtype) for o in e.outs]
                dup = Eqn(e.prim, ins, outs, e.params, e.src, e.scope)
                for o in outs:
                    o.eqn = dup
                self.renamed[id(dup)] = {axis: second}
                added.append((dup, e))
                for o, c in zip(e.outs, outs):
                    self._copies[(axis, id(o))] = c
                c = outs[e.outs.index(v)]
            self._copies[key] = c
            return c
        return copy


def _fresh(name: str, taken) -> str:
    k = 2
    while f"{name}_{k}" in taken:
        k += 1
    return f"{name}_{k}"
