"""The equations translated into napkin's ops, one by one: a graph of :class:`Node` (one
napkin box each, over named axes), constants folded, common subexpressions shared."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from napkin.frontend.jaxpr.constants import closed, convert, fold, fold2, number, python, reciprocal
from napkin.frontend.jaxpr.naming import Naming, flat
from napkin.frontend.jaxpr.tracing import Lit, Traced, Var
from napkin.frontend.jaxpr.vocabulary import (BINARY, COMPARE, FLOAT, IDENTITY, LOGIC, REDUCE, UNARY,
                                     WIRING, fail, gather_mode, napkin_dtype, take_along,
                                     take_at, unit_pick, unsupported)
from napkin.core.primitives import Compare


@dataclass(eq=False)
class Node:
    op: str                 # input map zip reduce contract compare where and or not positions
    args: list              # take cast softmax mask
    p: dict
    axes: tuple             # names of the axes the value has (broadcast ones excluded)
    dtype: str
    src: str = ""

    def __repr__(self):
        return f"Node({self.op}, {self.p}, {self.axes})"

    def is_(self, op, **p) -> bool:
        return self.op == op and all(self.p.get(k) == v for k, v in p.items())

    def become(self, op, args, p):
        """This node now computes ``op`` (a pattern read back): its users follow."""
        self.op, self.args, self.p = op, list(args), dict(p)


@dataclass
class C:
    """A constant: one value everywhere (a literal, a size, a broadcast of those)."""
    value: object
    dtype: str


@dataclass
class A:
    """An array: the node computing it and the axis of each jaxpr dimension (None: unit)."""
    node: Node
    dims: tuple


def _union(*axes_lists):
    return tuple(dict.fromkeys(n for t in axes_lists for n in t))


class Uses(dict):
    """Use counts of the nodes the outputs depend on (``live``, in graph order), and
    ``users[id(node)]``: the live nodes reading it (an output counts as one use)."""

    def __init__(self, graph, outs):
        roots = [v.node for v in outs if isinstance(v, A)]
        seen, stack = set(), list(roots)
        while stack:
            n = stack.pop()
            if id(n) not in seen:
                seen.add(id(n))
                stack.extend(n.args)
        super().__init__()
        self.graph, self.outs, self.users = graph, outs, {}
        self.live = [n for n in graph.nodes if id(n) in seen]
        for m in self.live:
            for a in m.args:
                self[id(a)] = self.get(id(a), 0) + 1
                self.users.setdefault(id(a), []).append(m)
        for r in roots:
            self[id(r)] = self.get(id(r), 0) + 1

    def replace(self, n, by):
        """Every use of ``n`` reads ``by`` instead."""
        for m in self.users.get(id(n), []):
            m.args = [by if a is n else a for a in m.args]
        for i, o in enumerate(self.outs):
            if isinstance(o, A) and o.node is n:
                self.outs[i] = A(by, o.dims)


class Graph:
    def __init__(self, naming: Naming, traced: Traced):
        self.naming, self.t = naming, traced
        self.nodes: list[Node] = []
        self.inputs: list[Node] = []
        self.stopped: list = []  # (node, where): the values jax.lax.stop_gradient was applied to
        self._cse: dict = {}

    def node(self, op, args, p, axes, dtype, src="") -> Node:
        """A new node, or the one already computing the same (JAX does not share common
        subexpressions: ``jnp.exp(x) / jnp.exp(x).sum()`` computes exp twice)."""
        key = (op, tuple(id(a) for a in args), repr(sorted(p.items())), dtype)
        if op != "input" and key in self._cse:
            return self._cse[key]
        n = Node(op, list(args), dict(p), tuple(axes), dtype, src)
        self.nodes.append(n)
        self._cse[key] = n
        return n

    def size(self, name):
        new = self.naming.new_axes.get(name)
        return self.t.symbols[name] if new is None else sympy.Integer(new)

    # -- building
    def build(self, eqns, invars, outvars):
        """The graph of ``eqns``: the value of each output (an :class:`A` or a :class:`C`)."""
        env = {}
        for i, v in enumerate(invars):
            dims = self.naming.dims(v)
            n = self.node("input", [], {"index": i}, flat(dims),
                          napkin_dtype(v.dtype, f"argument {i}"))
            self.inputs.append(n)
            env[v.id] = A(n, dims)

        def val(a):
            if isinstance(a, Lit):
                return C(a.value, napkin_dtype(a.dtype, "a literal"))
            return env[a.id]

        for e in eqns:
            outs = self.eqn(e, [val(a) for a in e.ins])
            for o, r in zip(e.outs, outs):
                if isinstance(r, A):
                    r = A(r.node, self.naming.dims(o))
                env[o.id] = r
        return [val(a) for a in outvars]

    def eqn(self, e, vals):
        p = e.prim
        dt = napkin_dtype(e.outs[0].dtype, e.where())
        src = e.at()
        if p == "stop_gradient" and isinstance(vals[0], A):  # the identity here; see grad
            self.stopped.append((vals[0].node, src))
        if p in IDENTITY or p in WIRING:
            return [vals[0]]
        if p in UNARY:
            return [self.unary(UNARY[p], vals[0], dt, src)]
        if p == "exp2":  # 2ˣ = exp(x·log 2)
            if isinstance(vals[0], C):
                return [C(fold("exp2", vals[0].value), dt)]
            return [A(self.map("exp", self.map("scale", vals[0].node, dt, src, sympy.log(2)),
                               dt, src), ())]
        if p == "integer_pow":
            return [self.power(vals[0], e.params["y"], dt, src)]
        if p in BINARY:
            return [self.binary(p, vals[0], vals[1], dt, src)]
        if p in COMPARE:
            return [self.compare(p, vals[0], vals[1], src)]
        if p in LOGIC:
            return [self.logic(p, vals, dt, src)]
        if p == "select_n":
            return [self.select(vals, dt, src)]
        if p == "clamp":
            lo, x, hi = vals
            if not (isinstance(lo, C) and isinstance(hi, C)):
                unsupported(e, "clamp with array bounds")
            return [self.binary("min", self.binary("max", x, lo, dt, src), hi, dt, src)]
        if p == "convert_element_type":
            x = vals[0]
            if isinstance(x, C):
                return [C(convert(x.value, dt), dt)]
            if x.node.dtype == dt:
                return [x]
            return [A(self.node("cast", [x.node], {"dtype": dt}, x.node.axes, dt, src), x.dims)]
        if p in REDUCE:
            return [self.reduce(REDUCE[p], vals[0], e, dt, src)]
        if p == "dot_general":
            return [self.dot(vals, e, dt, src)]
        if p == "iota":
            return [self.iota(e, dt, src)]
        if p == "dim_as_value":
            return [C(sympy.sympify(str(e.params["dim"]), locals=dict(self.t.symbols)), dt)]
        if p == "gather":
            return [self.gather(vals, e, dt, src)]
        unsupported(e)

    # -- helpers that make nodes
    def map(self, fn, n: Node, dt, src, param=None) -> Node:
        return self.node("map", [n], {"fn": fn, "param": param}, n.axes, dt, src)

    def unary(self, fn, x, dt, src):
        if isinstance(x, C):
            return C(fold(fn, x.value), dt)
        return A(self.map(fn, x.node, dt, src), x.dims)

    def power(self, x, y, dt, src):
        if isinstance(x, C):
            return C(fold2("pow", x.value, y), dt)
        named = {1: None, 2: "square", -1: "recip", 0.5: "sqrt", -0.5: "rsqrt"}
        if y in named:
            return x if y == 1 else A(self.map(named[y], x.node, dt, src), x.dims)
        return A(self.map("pow", x.node, dt, src, y), x.dims)

    def binary(self, fn, a, b, dt, src):
        if isinstance(a, C) and isinstance(b, C):
            return C(fold2(fn, a.value, b.value), dt)
        if fn == "div" and dt not in FLOAT:
            fail(f"integer division ({src}) has no napkin primitive")
        if isinstance(a, A) and isinstance(b, A):
            if fn == "pow":
                fail(f"pow with an array exponent ({src}) has no napkin primitive; write "
                     f"exp(y·log x)")
            n = self.node("zip", [a.node, b.node], {"fn": fn}, _union(a.node.axes, b.node.axes),
                          dt, src)
            return A(n, ())
        swapped = isinstance(a, C)
        x, c = (b, a.value) if swapped else (a, b.value)
        n, c = x.node, number(c)
        if fn == "pow":
            if not swapped:
                return self.power(x, c, dt, src)
            if not (closed(c) and float(c) > 0):  # cˣ = exp(x·log c) only for c > 0
                fail(f"pow with the constant base {c} ({src}) has no napkin primitive "
                     f"(napkin writes cˣ as exp(x·log c), for c > 0)")
            return A(self.map("exp", self.map("scale", n, dt, src, sympy.log(c)), dt, src), ())
        if fn == "add" or (fn == "sub" and not swapped):
            c = c if fn == "add" else -c
            return x if c == 0 else A(self.map("add_const", n, dt, src, c), ())
        if fn == "sub":  # c − x
            m = self.map("neg", n, dt, src)
            return A(m if c == 0 else self.map("add_const", m, dt, src, c), ())
        if fn == "mul":
            if c == 1:
                return x
            return A(self.map("neg", n, dt, src) if c == -1 else
                     self.map("scale", n, dt, src, c), ())
        if fn == "div":
            if not swapped:
                return x if c == 1 else A(self.map("scale", n, dt, src, reciprocal(c)), ())
            r = self.map("recip", n, dt, src)
            return A(r if c == 1 else self.map("scale", r, dt, src, c), ())
        # max / min with a constant
        if not closed(c):
            fail(f"{fn} with the size expression {c} ({src}) has no napkin primitive")
        c = python(c, dt)
        if (fn == "max" and c == -float("inf")) or (fn == "min" and c == float("inf")):
            return x
        if fn == "max" and c == 0 and dt in FLOAT:
            return A(self.map("relu", n, dt, src), ())
        return A(self.map(f"{fn}_const", n, dt, src, c), ())

    def compare(self, fn, a, b, src):
        if isinstance(a, C) and isinstance(b, C):
            return C(bool(fold2(fn, a.value, b.value)), "bool")
        if isinstance(a, A) and isinstance(b, A):
            return A(self.node("compare", [a.node, b.node], {"fn": fn, "const": None},
                               _union(a.node.axes, b.node.axes), "bool", src), ())
        if isinstance(a, C):
            fn, a, b = Compare(fn).flipped(), b, a
        c = number(b.value)
        if not closed(c):
            fail(f"a comparison with the size expression {c} ({src}) has no napkin primitive")
        c = int(c) if isinstance(c, bool) else c if isinstance(c, (int, float)) else float(c)
        return A(self.node("compare", [a.node], {"fn": fn, "const": c}, a.node.axes, "bool",
                           src), ())

    def logic(self, fn, vals, dt, src):
        if dt != "bool":
            fail(f"bitwise {fn} on integers ({src}) has no napkin primitive")
        if fn == "not":
            x = vals[0]
            if isinstance(x, C):
                return C(not x.value, "bool")
            return A(self.node("not", [x.node], {}, x.node.axes, "bool", src), ())
        a, b = vals
        if isinstance(a, C):
            a, b = b, a
        if isinstance(b, C):
            if isinstance(a, C):
                return C(bool(a.value and b.value) if fn == "and" else bool(a.value or b.value),
                         "bool")
            keep = bool(b.value) if fn == "and" else not bool(b.value)
            return a if keep else C(fn == "or", "bool")
        return A(self.node(fn, [a.node, b.node], {}, _union(a.node.axes, b.node.axes), "bool",
                           src), ())

    def select(self, vals, dt, src):
        if len(vals) != 3:
            fail(f"select_n with {len(vals) - 1} cases ({src}) has no napkin primitive "
                 f"(where takes two)")
        pred, f, t = vals
        if isinstance(pred, C):
            return t if pred.value else f
        return self.where(pred.node, t, f, dt, src)

    def where(self, cond: Node, t, f, dt, src):
        """where(cond, t, f), each of t and f an :class:`A` or a :class:`C`."""
        args, consts = [cond], []
        for v in (t, f):
            if isinstance(v, A):
                args.append(v.node)
                consts.append(None)
                continue
            c = number(v.value)
            if not closed(c) and not isinstance(c, bool):
                fail(f"where with the size expression {c} ({src}) has no napkin primitive")
            consts.append(python(c, dt))
        return A(self.node("where", args, {"a": consts[0], "b": consts[1]},
                           _union(*(n.axes for n in args)), dt, src), ())

    def reduce(self, fn, x, e, dt, src):
        dims = self.naming.dims(e.ins[0]) if isinstance(e.ins[0], Var) else ()
        names = flat(dims[j] for j in e.params["axes"]) if dims else []
        if isinstance(x, C):  # a constant summed over axes: times their sizes
            v = x.value
            for a in names:
                if fn == "sum" and a is not None:
                    v = fold2("mul", v, self.size(a))
            return C(v, dt)
        n = x.node
        for a in names:
            if a is None:
                continue
            if a not in n.axes:  # broadcast along a: a sum is |a| times, max/min the same
                if fn == "sum":
                    n = self.map("scale", n, dt, src, self.size(a))
                continue
            if fn == "min":  # min = −max(−x)
                n = self.map("neg", self.node("reduce", [self.map("neg", n, dt, src)],
                                              {"fn": "max", "axis": a},
                                              tuple(m for m in n.axes if m != a), dt, src),
                             dt, src)
            else:
                n = self.node("reduce", [n], {"fn": fn, "axis": a},
                              tuple(m for m in n.axes if m != a), dt, src)
        return A(n, ())

    def dot(self, vals, e, dt, src):
        lhs, rhs = vals
        if not (isinstance(lhs, A) and isinstance(rhs, A)):
            fail(f"dot_general with a constant operand ({src}) has no napkin primitive")
        (lc, _), _ = e.params["dimension_numbers"]
        present = _union(lhs.node.axes, rhs.node.axes)
        out = tuple(n for n in flat(self.naming.dims(e.outs[0])) if n in present)
        # dt is the result's (preferred_element_type): emission casts where napkin's
        # promotion gives another
        n = self.node("contract", [lhs.node, rhs.node], {"out": out}, out, dt, src)
        ldims = self.naming.dims(e.ins[0])
        for a in flat(ldims[i] for i in lc):  # an axis both operands are broadcast along
            if a not in present:              # is |a| times the sum
                n = self.map("scale", n, dt, src, self.size(a))
        return A(n, ())

    def iota(self, e, dt, src):
        a = self.naming.dims(e.outs[0])[e.params["dimension"]]
        if a is None:
            return C(0, dt)
        if isinstance(a, tuple):
            fail(f"jnp.arange over a merged axis ({' × '.join(a)}, {src}) has no napkin "
                 f"primitive; give positions over each axis apart")
        return A(self.node("positions", [], {"axis": a}, (a,), dt, src), ())

    def gather(self, vals, e, dt, src):
        """take_along_axis's gather, or a pick from unit dimensions, under JAX's index mode
        (``fill``: an index out of range gives the fill, NaN by default; ``clip``: it is
        clamped into range; ``promise``: none is).  napkin's take_along_axis gives 0 out of
        range (the documented difference); a clamping one has no napkin primitive."""
        x, idx = vals
        mode, j = gather_mode(e), take_along(e)
        if j is None and not unit_pick(e):  # x[:, index]: the index's axes are new ones
            j = take_at(e)
        if unit_pick(e) or self.naming.dims(e.ins[0])[j] is None:
            return self._pick_unit(x, idx, e, mode, dt, src)
        if not isinstance(x, A) or not isinstance(idx, A):
            unsupported(e)
        if mode == "clip":
            unsupported(e, "take_along_axis with mode='clip'")
        a = self.naming.dims(e.ins[0])[j]
        if isinstance(a, tuple):
            unsupported(e, f"take_along_axis along a merged axis ({' × '.join(a)})")
        if a not in x.node.axes:  # x is one value along a: it, where the index is in range
            if mode != "promise":
                unsupported(e, f"take_along_axis along {a}, of an array broadcast along it,")
            return A(x.node, ())
        rest = tuple(m for m in x.node.axes if m != a)
        n = self.node("take", [x.node, idx.node], {"axis": a},
                      rest + tuple(m for m in idx.node.axes if m not in rest), dt, src)
        return A(n, ())

    def _pick_unit(self, x, idx, e, mode, dt, src):
        """The one entry of a unit dimension at ``idx``: x where idx is 0 (every index in
        range is), the fill elsewhere in mode ``fill``."""
        if mode != "fill" or (isinstance(idx, C) and idx.value == 0):
            return x
        if dt not in FLOAT or isinstance(idx, C) or \
                len(e.params["dimension_numbers"].collapsed_slice_dims) != 1:
            unsupported(e, "gather of a unit dimension at an index that may be out of range")
        fill = e.params.get("fill_value")
        keep = self.node("compare", [idx.node], {"fn": "eq", "const": 0}, idx.node.axes,
                         "bool", src)
        return self.where(keep, x, C(float("nan") if fill is None else fill, dt), dt, src)
