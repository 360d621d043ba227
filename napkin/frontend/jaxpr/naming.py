"""Axes: the ``axes=`` argument read, and every jaxpr dimension given an axis by
unification along the data flow (elementwise operands, dot_general's contracting and batch
dimensions, broadcast_in_dim's mapped dimensions, ...).  A dimension of size 1 is no axis:
napkin broadcasts by name."""
from __future__ import annotations

import inspect

import numpy as np
import sympy

from napkin.core.arrays import Axis
from napkin.frontend.jaxpr.tracing import ArrayConstant, Lit, Traced, Var
from napkin.frontend.jaxpr.vocabulary import (ELEMENTWISE, KNOWN, REDUCE, fail, take_along, take_at,
                                     unit, unit_pick, unsupported)


# -------------------------------------------------------------- the arguments and axes=
def struct(a, i):
    """Argument ``i`` as a ``jax.ShapeDtypeStruct`` (an array gives its shape and dtype)."""
    import jax
    shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
    if shape is None or dtype is None:
        fail(f"argument {i}: expected a jax.ShapeDtypeStruct or an array, got {a!r}")
    shape = tuple(shape)
    for n in shape:
        if not isinstance(n, (int, np.integer)) or n < 1:
            fail(f"argument {i}: shape {shape} has a dimension that is not a positive int")
    return jax.ShapeDtypeStruct(tuple(int(n) for n in shape), dtype)


def arg_names(fn, n: int) -> list[str]:
    """The names of ``fn``'s first ``n`` positional parameters (``x<i>`` where it has none:
    ``*args``, a builtin)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            break
    names = names[:n] + [f"x{i}" for i in range(len(names), n)]
    return [m if m.isidentifier() else f"x{i}" for i, m in enumerate(names)]


_UNIT_MARKS = ("1", "_")


def axis_names(axes, structs, argnames):
    """Per argument, a list with one axis name (or None: a broadcast unit dimension) per
    dimension; None when ``axes`` is None (named by sizes)."""
    if axes is None:
        return None
    if isinstance(axes, dict):
        unknown = [k for k in axes if k not in argnames]
        if unknown:
            fail(f"axes names argument {unknown[0]!r}, which fn does not take (its "
                 f"arguments: {', '.join(argnames)})")
        entries = []
        for a, s in zip(argnames, structs):
            if a not in axes and s.shape:
                fail(f"axes names no axes for argument {a} (shape {s.shape}); give every "
                     f"argument an entry")
            entries.append(axes.get(a, ""))
    elif isinstance(axes, (list, tuple)):
        if len(axes) != len(structs):
            fail(f"axes has {len(axes)} entries for {len(structs)} arguments "
                 f"({', '.join(argnames)}); give one per argument")
        entries = list(axes)
    else:
        fail(f"axes must be a list (one entry per argument) or a dict {{argument: names}}, "
             f"got {type(axes).__name__}")
    out, sizes = [], {}
    for a, s, e in zip(argnames, structs, entries):
        if isinstance(e, str):
            items = e.replace(",", " ").split()
        elif isinstance(e, Axis):
            items = [e]
        elif isinstance(e, (list, tuple)):
            items = list(e)
        else:
            fail(f"axes for {a}: expected a string of names or a sequence of names/Axis, "
                 f"got {e!r}")
        if len(items) != len(s.shape):
            shown = " ".join(str(getattr(i, "name", i)) for i in items) or "none"
            fail(f"axes for {a}: {len(items)} name(s) ({shown}) for {len(s.shape)} "
                 f"dimension(s) of shape {s.shape}")
        dims = []
        for j, (item, n) in enumerate(zip(items, s.shape)):
            if isinstance(item, Axis):
                if isinstance(item.size, int) and item.size != n:
                    fail(f"axes for {a}: axis {item.name} has size {item.size} but dimension "
                         f"{j} has size {n}")
                item = item.name
            if item is None or (isinstance(item, str) and item in _UNIT_MARKS):
                if n != 1:
                    fail(f"axes for {a}: dimension {j} is marked {item!r} (broadcast, size "
                         f"1) but has size {n}")
                dims.append(None)
                continue
            if not isinstance(item, str) or not item.isidentifier():
                fail(f"axes for {a}: {item!r} is not an axis name (an identifier)")
            if item in dims:
                fail(f"axes for {a}: axis {item} names two dimensions; napkin arrays name "
                     f"each axis once")
            if item in sizes and sizes[item][0] != n:
                fail(f"axis {item} has size {sizes[item][0]} in {sizes[item][1]} but {n} in "
                     f"{a}")
            sizes.setdefault(item, (n, a))
            dims.append(item)
        out.append(dims)
    return out


# -------------------------------------------------------------- unification
class Clash(Exception):
    """Axis ``axis`` meets itself at ``eqn`` (``x @ x.T``, ``i >= j`` of two aranges of one
    length): its operand ``var`` is to be read under a second axis (renaming.py)."""

    def __init__(self, eqn, var, axis, why):
        super().__init__(why)
        self.eqn, self.var, self.axis, self.why = eqn, var, axis, why


class Naming:
    """Axis identities of every variable's dimensions, by unification along the data flow.
    ``aliases``: {second axis: the axis it is a copy of} (an argument read twice)."""

    def __init__(self, traced: Traced, names, argnames, aliases=None, renamed=None):
        self.t, self.names, self.argnames = traced, names, argnames
        self.aliases = dict(aliases or {})
        self.renamed = dict(renamed or {})  # id(eqn) -> {axis: its second axis} (copies)
        self.vars: dict = {}                # var id -> Var
        self.parent: dict = {}
        self.label: dict = {}        # root -> (axis name, where it was named)
        self.inputs: dict = {}       # root -> [(argument, dimension)] (sizes mode)
        self._dims: dict = {}

    # -- union-find over slots (var id, dimension)
    def find(self, k):
        p = self.parent.setdefault(k, k)
        if p == k:
            return k
        r = self.find(p)
        self.parent[k] = r
        return r

    def slot(self, v, i):
        return None if unit(v.shape[i]) else (v.id, i)

    def union(self, a, b, eqn):
        if a is None or b is None:
            return
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        la, lb = self.label.get(ra), self.label.get(rb)
        if la and lb and la[0] != lb[0]:
            self._copy_meets_original(a, b, la[0], lb[0], eqn)
            fail(f"fn uses axes {la[0]} and {lb[0]} as one axis ({eqn.where()}); give "
                 f"them one name in axes=, or keep them apart in fn")
        self.parent[rb] = ra
        if lb and not la:
            self.label[ra] = lb
        self.inputs.setdefault(ra, []).extend(self.inputs.pop(rb, []))

    def _copy_meets_original(self, a, b, la, lb, eqn):
        """An axis's second copy unified with the axis itself: the operand of ``eqn`` on the
        original's side is to be read under the copy too (P[t, t₂] @ V[t, e])."""
        for slot, mine, other in ((a, la, lb), (b, lb, la)):
            if self.aliases.get(other) == mine:
                var = self.vars.get(slot[0])
                if var is not None and any(v is var for v in eqn.ins):
                    raise Clash(eqn, var, mine, f"axes {other} and {mine}")

    def seed(self, k, name, where):
        r = self.find(k)
        old = self.label.get(r)
        if old and (old[0] == name or self.aliases.get(old[0]) == name):
            return  # a symbolic size names both an axis and its copy
        if old:
            fail(f"fn uses axes {old[0]} and {name} as one axis ({where})")
        self.label[r] = (name, where)

    # -- the pass
    def run(self, eqns):
        """Name every dimension of ``eqns``; refuse what napkin cannot read."""
        t = self.t
        self.vars = {v.id: v for v in t.invars}
        self.vars.update((o.id, o) for e in eqns for o in e.outs)
        for i, v in enumerate(t.invars):
            for j in range(len(v.shape)):
                k = self.slot(v, j)
                if k is None:
                    continue
                self.find(k)
                if self.names is not None:
                    self.seed(k, self.names[i][j], f"argument {self.argnames[i]}")
                else:
                    self.inputs.setdefault(self.find(k), []).append((i, j))
        for a in t.outvars:
            if isinstance(a, Lit) and isinstance(a.value, ArrayConstant):
                a.value.refuse("as an output")
        sized = []
        for e in eqns:
            for a in e.ins:
                if isinstance(a, Lit) and isinstance(a.value, ArrayConstant):
                    a.value.refuse(e.where())
            if e.prim not in KNOWN or (e.prim == "gather" and not unit_pick(e)
                                        and take_along(e) is None and take_at(e) is None):
                unsupported(e)
            self._unify(e)
            if t.mode == "symbolic" and self.names is not None:
                second = self.renamed.get(id(e), {})
                for o in e.outs:
                    for j, d in enumerate(o.shape):
                        if isinstance(d, sympy.Symbol):
                            sized.append(((o.id, j), second.get(d.name, d.name), e.where()))
        # a dimension of a symbolic size (jnp.arange(x.shape[0])) is that size's axis only
        # where the data flow gave it no other: with an argument read twice, an arange of
        # t's length may be t or its second axis t_2 (arange(t)[:, None] >= arange(t))
        for k, name, where in sized:
            self.seed(k, name, where)
        if self.names is None:
            self._check_sizes()
        for e in eqns:
            for o in e.outs:
                self._check_distinct(o, e)

    def _check_sizes(self):
        by_size: dict = {}
        for r, slots in self.inputs.items():
            if slots:
                i, j = slots[0]
                by_size.setdefault(self.t.arg_shapes[i][j], []).append((self.find(r), slots))
        for size, roots in by_size.items():
            distinct = {r for r, _ in roots}
            if len(distinct) > 1:
                (i, j), (k, m) = roots[0][1][0], roots[1][1][0]
                fail(f"{self.argnames[i]}'s dimension {j} and {self.argnames[k]}'s dimension "
                     f"{m} both have size {size} but fn uses them as different axes; name "
                     f"the axes with axes= (one string of names per argument, e.g. \"q d\")")

    def _check_distinct(self, v, e):
        dims = [n for n in self.dims(v) if n]
        for n in dims:
            if dims.count(n) > 1:
                second = self._second_source(v, e, n)
                if second is not None:
                    raise Clash(e, second, n, f"two dimensions of axis {n}")
                fail(f"fn makes an array of shape {tuple(v.shape)} with two dimensions of "
                     f"axis {n} ({e.where()}); napkin arrays name each axis once and napkin "
                     f"has no primitive renaming an axis: pass the array the second "
                     f"dimension comes from as an argument of its own, under another axis "
                     f"name (self-attention: the keys' source, x[{n}] and again as x[m])")

    def _second_source(self, v, e, n):
        """The operand of ``e`` that brings ``v``'s later dimension of axis ``n`` — the rhs of
        a dot_general (x @ x.T), the operand of an elementwise equation that has that
        dimension and not the earlier one (arange(t)[:, None] >= arange(t)[None, :]) — or
        None."""
        full = self.dims(v)
        first, last = full.index(n), len(full) - 1 - full[::-1].index(n)
        if e.prim == "dot_general" and v is e.outs[0] and len(e.ins) == 2:
            (lc, rc), (lb, _) = e.params["dimension_numbers"]
            lhs, rhs = e.ins
            lfree = len(lhs.shape) - len(lc) - len(lb)
            return rhs if last >= len(lb) + lfree and isinstance(rhs, Var) else None
        if e.prim in ELEMENTWISE:
            for a in e.ins:
                if isinstance(a, Var) and len(a.shape) == len(v.shape) and \
                        not unit(a.shape[last]) and unit(a.shape[first]):
                    return a
        return None

    def _unify(self, e):
        """Join the slots equation ``e`` says are one axis."""
        p, ins, outs = e.prim, e.ins, e.outs
        u, s = self.union, self.slot
        vs = [a for a in ins if isinstance(a, Var)]
        if p in ELEMENTWISE:
            for o in outs:
                for a in vs:
                    if len(a.shape) == len(o.shape):
                        for j in range(len(o.shape)):
                            u(s(a, j), s(o, j), e)
        elif p == "broadcast_in_dim" and vs:
            a, o = ins[0], outs[0]
            for j, k in enumerate(e.params["broadcast_dimensions"]):
                u(s(a, j), s(o, k), e)
        elif p in ("reshape", "squeeze", "expand_dims") and vs:
            a, o = ins[0], outs[0]
            ka = [j for j in range(len(a.shape)) if not unit(a.shape[j])]
            ko = [j for j in range(len(o.shape)) if not unit(o.shape[j])]
            if [a.shape[j] for j in ka] != [o.shape[j] for j in ko]:
                fail(f"{p} from {tuple(a.shape)} to {tuple(o.shape)} ({e.src}) merges or "
                     f"splits dimensions; napkin arrays have named axes: keep each axis "
                     f"its own dimension — {_reshape_advice(a, o)}")
            for j, k in zip(ka, ko):
                u(s(a, j), s(o, k), e)
        elif p == "transpose" and vs:
            a, o = ins[0], outs[0]
            for i, j in enumerate(e.params["permutation"]):
                u(s(a, j), s(o, i), e)
        elif p == "dot_general" and len(vs) == 2:
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            lhs, rhs, o = ins[0], ins[1], outs[0]
            for i, j in zip(lc, rc):
                u(s(lhs, i), s(rhs, j), e)
            for i, j in zip(lb, rb):
                u(s(lhs, i), s(rhs, j), e)
            lf = [i for i in range(len(lhs.shape)) if i not in lc and i not in lb]
            rf = [i for i in range(len(rhs.shape)) if i not in rc and i not in rb]
            order = [(lhs, i) for i in lb] + [(lhs, i) for i in lf] + [(rhs, i) for i in rf]
            for k, (v, i) in enumerate(order):
                u(s(v, i), s(o, k), e)
        elif p in REDUCE and vs:
            a, o = ins[0], outs[0]
            kept = [j for j in range(len(a.shape)) if j not in e.params["axes"]]
            for k, j in enumerate(kept):
                u(s(a, j), s(o, k), e)
        elif p == "gather" and unit_pick(e):
            x, o = ins[0], outs[0]
            kept = [j for j in range(len(x.shape)) if j not in
                    e.params["dimension_numbers"].collapsed_slice_dims]
            for k, j in enumerate(kept):
                u(s(x, j), s(o, k), e)
        elif p == "gather" and len(vs) == 2 and take_along(e) is None and take_at(e) is not None:
            x, idx, o = ins[0], ins[1], outs[0]
            dn = e.params["dimension_numbers"]
            kept = [j for j in range(len(x.shape)) if j != take_at(e)]
            for j, k in zip(kept, dn.offset_dims):
                u(s(x, j), s(o, k), e)
            rest = [k for k in range(len(o.shape)) if k not in dn.offset_dims]
            for j, k in zip(range(len(idx.shape) - 1), rest):
                u(s(idx, j), s(o, k), e)
        elif p == "gather" and len(vs) == 2 and take_along(e) is not None:
            x, idx, o = ins[0], ins[1], outs[0]
            dn = e.params["dimension_numbers"]
            for i, j in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
                u(s(x, i), s(idx, j), e)
            for j in range(len(o.shape)):
                u(s(idx, j), s(o, j), e)

    # -- names
    def name(self, v, j):
        """The axis of dimension ``j`` of ``v`` (None: a unit dimension)."""
        d = v.shape[j]
        if unit(d):
            return None
        r = self.find((v.id, j))
        lab = self.label.get(r)
        if lab:
            return lab[0]
        if self.names is None and self.t.mode == "concrete":
            if isinstance(d, int) and d in set(self.t.sizes.values()):
                return f"n{d}"
        if isinstance(d, sympy.Symbol) and d.name in self.t.sizes:
            return d.name
        if self.t.mode == "concrete" and isinstance(d, int):
            cands = self.t.by_size.get(d, [])
            if len(cands) == 1:
                return cands[0]
            made = v.eqn.where() if v.eqn else "an argument"
            if cands:
                fail(f"cannot tell which axis the dimension of size {d} made by {made} is "
                     f"({' and '.join(cands)} both have that size, and fn does not trace "
                     f"with symbolic sizes: {self.t.reason}); write sizes through jnp so "
                     f"it does, or give the axes different sizes")
        made = v.eqn.where() if v.eqn else "an argument"
        fail(f"the dimension of size {d} made by {made} is none of the arguments' axes; "
             f"napkin axes come from fn's arguments (size it with an argument's shape, "
             f"e.g. jnp.arange(q.shape[0]))")

    def dims(self, v) -> tuple:
        """The axis of each of ``v``'s dimensions (None: a unit dimension)."""
        if v.id not in self._dims:
            self._dims[v.id] = tuple(self.name(v, j) for j in range(len(v.shape)))
        return self._dims[v.id]


def _reshape_advice(a, o) -> str:
    """What to write instead of a reshape that merges or splits dimensions."""
    made = a.eqn
    if len(o.shape) < len(a.shape) and made is not None and made.prim == "broadcast_in_dim" \
            and len(made.outs[0].shape) > len(made.ins[0].shape):
        return ("this is jnp.repeat / jnp.tile (a broadcast, then a merge): give the "
                "grouped operand its group axis and the other its groups as two axes, e.g. "
                "q[g, r, q, d] against k[g, x, d], jnp.einsum('grqd,gxd->grqx', q, k), "
                "and reshape q outside fn")
    if len(o.shape) > len(a.shape):
        return ("a head split: give the weights a head axis, w[e, h, d], and project with "
                "jnp.einsum('se,ehd->shd', x, w) (reshape the weights outside fn)")
    return "return the array with its axes apart and merge them outside fn"
