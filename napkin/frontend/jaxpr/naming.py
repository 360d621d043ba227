"""Axes: the ``axes=`` argument read, and every jaxpr dimension given an axis by
unification along the data flow (elementwise operands, dot_general's contracting and batch
dimensions, broadcast_in_dim's mapped dimensions, ...).  A dimension of size 1 is no axis:
napkin broadcasts by name.  A dimension a reshape merges from others or splits into others
(or jnp.tile makes of copies) is the product of their axes: its class keeps its parts
(``factors``), unified part by part wherever two such dimensions meet."""
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
_KEEP_APART = ("keep each axis its own dimension (return the array with its axes apart and "
               "reshape it outside fn)")

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
        # a dimension that is the product of others (a reshape that splits or merges it,
        # jnp.repeat, jnp.tile): root -> its parts' slots, outer first; a part's axis is
        # named by its own class or after the dimension it is part of (``h_1``)
        self.factors: dict = {}
        self.part_of: dict = {}      # part slot -> (slot of the product, its place)
        self.virtual: dict = {}      # a part no variable has (tile's copies) -> its size
        self.new_axes: dict = {}     # a part's generated axis name -> its int size
        self._generated: dict = {}   # root -> generated name

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
        parts = self.factors.pop(rb, None)
        if parts is not None:
            self._factor(ra, parts, eqn)

    # -- dimensions that are products of others
    def size_of(self, k):
        """The size of slot ``k``."""
        return self.virtual[k] if k in self.virtual else self.vars[k[0]].shape[k[1]]

    def factor(self, k, parts, eqn):
        """Slot ``k`` is the product of the slots ``parts`` (outer first)."""
        if k is None:
            return
        for i, q in enumerate(parts):
            self.part_of.setdefault(q, (k, i))
        self._factor(self.find(k), list(parts), eqn)

    def _factor(self, r, parts, eqn):
        old = self.factors.get(r)
        if old is None:
            self.factors[r] = parts
            return
        sizes = [self.size_of(q) for q in old], [self.size_of(q) for q in parts]
        if sizes[0] != sizes[1]:
            fail(f"fn splits one axis into parts of sizes {tuple(sizes[0])} and of sizes "
                 f"{tuple(sizes[1])} ({eqn.where()}); napkin reads a merged axis as its "
                 f"parts, one way")
        for a, b in zip(old, parts):
            self.union(a, b, eqn)

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
        dims = flat(self.dims(v))
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
        if n not in full:  # a part of a merged dimension: no second reading
            return None
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
            # a merge of dimensions is one dimension whose axis is their product, a split
            # the converse (jnp.repeat's broadcast-then-merge, a head split (s, h·d) ->
            # (s, h, d)): the merged dimension is read as its parts, each an axis
            a, o = ins[0], outs[0]
            ka = [j for j in range(len(a.shape)) if not unit(a.shape[j])]
            ko = [j for j in range(len(o.shape)) if not unit(o.shape[j])]
            groups = _regrouping([a.shape[j] for j in ka], [o.shape[j] for j in ko])
            if groups is None:
                fail(f"{p} from {tuple(a.shape)} to {tuple(o.shape)} ({e.src}) regroups "
                     f"dimensions napkin cannot read as products of axes; {_KEEP_APART}")
            for ia, io in groups:
                if len(ia) == 1 and len(io) == 1:
                    u(s(a, ka[ia[0]]), s(o, ko[io[0]]), e)
                elif len(ia) == 1:
                    self.factor(s(a, ka[ia[0]]), [s(o, ko[k]) for k in io], e)
                elif len(io) == 1:
                    self.factor(s(o, ko[io[0]]), [s(a, ka[k]) for k in ia], e)
                else:
                    fail(f"{p} from {tuple(a.shape)} to {tuple(o.shape)} ({e.src}) turns "
                         f"dimensions {tuple(a.shape[ka[k]] for k in ia)} into "
                         f"{tuple(o.shape[ko[k]] for k in io)}: neither a merge nor a split "
                         f"of axes; {_KEEP_APART}")
        elif p == "tile" and vs:  # jnp.tile: a dimension of n copies is (copy, the axis)
            a, o = ins[0], outs[0]
            for j, rep in enumerate(e.params["reps"]):
                if rep == 1:
                    u(s(a, j), s(o, j), e)
                elif not unit(a.shape[j]):
                    copy = ("tile", id(e), j)
                    self.virtual[copy] = rep
                    self.factor(s(o, j), [copy, s(a, j)], e)
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
        part = self._part_name(r)
        if part:
            return part
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
        """The axis of each of ``v``'s dimensions (None: a unit dimension; a tuple of axes,
        outer first: a dimension that is their product)."""
        if v.id not in self._dims:
            self._dims[v.id] = tuple(None if unit(v.shape[j]) else self._entry((v.id, j))
                                     for j in range(len(v.shape)))
        return self._dims[v.id]

    def _entry(self, k):
        """Slot ``k``'s axis, or the tuple of its parts' axes."""
        parts = self.factors.get(self.find(k))
        if parts is None:
            if k in self.virtual:
                return self.label.get(self.find(k), (None,))[0] or self._part_name(self.find(k))
            return self.name(self.vars[k[0]], k[1])
        return tuple(flat(self._entry(q) for q in parts))

    def _part_name(self, r):
        """The axis of the class ``r`` where it is a part of a merged dimension and nothing
        else names it: ``<the merged axis>_<its place>`` (h = (g, h_1): jnp.repeat's copies),
        of the int size it has in fn."""
        if r in self._generated:
            return self._generated[r]
        found = next(((m, i) for q, (m, i) in self.part_of.items() if self.find(q) == r), None)
        if found is None:
            return None
        m, i = found
        whole = self.label.get(self.find(m), (None,))[0] or self._part_name(self.find(m)) or "ax"
        size = self.size_of(next(q for q in self.part_of if self.find(q) == r))
        if not isinstance(size, (int, np.integer)):
            fail(f"fn splits axis {whole} into parts, one of size {size}: a part napkin names "
                 f"itself must have a fixed size (give its size as a number)")
        taken = set(self.t.sizes) | {lab[0] for lab in self.label.values()} | \
            set(self.new_axes) | set(self.aliases)
        name, n = f"{whole}_{i}", 2
        while name in taken:
            name, n = f"{whole}_{i}_{n}", n + 1
        self._generated[r] = name
        self.new_axes[name] = int(size)
        return name


def flat(entries) -> list:
    """The axis names of ``entries`` (a variable's dims): units left out, parts spread."""
    out = []
    for e in entries:
        if isinstance(e, tuple):
            out.extend(e)
        elif e:
            out.append(e)
    return out


def _regrouping(a: list, b: list):
    """The dimensions ``a`` and ``b`` (sizes, ints or sympy) of a reshape in groups of equal
    product, in order: [(indices into a, indices into b)], or None where they do not line
    up."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while sympy.simplify(sympy.sympify(pa) - pb) != 0:
            if _divides(pa, pb) and i < len(a):    # a's product is short: take its next
                ga.append(i)
                pa, i = pa * a[i], i + 1
            elif _divides(pb, pa) and j < len(b):
                gb.append(j)
                pb, j = pb * b[j], j + 1
            else:
                return None
        groups.append((ga, gb))
    return groups if i == len(a) and j == len(b) else None


def _divides(x, y) -> bool:
    """``x`` divides ``y`` and is smaller (ints, or sympy products of sizes)."""
    if isinstance(x, (int, np.integer)) and isinstance(y, (int, np.integer)):
        return y > x and y % x == 0
    q = sympy.cancel(sympy.sympify(y) / sympy.sympify(x))
    return sympy.fraction(q)[1] == 1 and q != 1
