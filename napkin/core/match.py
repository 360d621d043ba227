"""Pattern matching on the networkx view of a diagram (:mod:`napkin.core.ir`).

A :class:`Pattern` is a small diagram traced with :mod:`napkin.frontend.ops` over *pattern
variables*: its inputs are array variables whose axes are *axis variables* (names
the pattern chooses, bound to the host's own axis names by the match), and the
constants of its parametrised maps may be *constant variables* (sympy symbols,
bound to the host's constants).  Sizes of axis variables (the symbol ``v`` of an
axis variable ``v``) bind to the host's sizes, so a parameter such as ``1/v`` (a
mean's scale) is compared with the host's after substitution.

What a match is
---------------
A match of a pattern at a host op (its *anchor*, the op that makes the pattern's
one output) binds every pattern op to a host op and every pattern value to a
host value, grown from the anchor along the edges of the host graph, upwards
(every pattern op is upstream of the pattern's output):

* **ops** match by primitive spec: the same kind and function; the axis a
  reduction or a softmax acts on, and the axes a contraction sums, are the
  images of the pattern's axis variables (one host axis per variable, one
  variable per host axis); parameters equal the pattern's after substitution;
  inputs port by port — for commutative primitives (add, mul, max, min and
  contractions) in either order;
* **values** match by their place: a pattern input binds to any host value, a
  value the pattern computes to the host value in the same output port of the
  host op bound to its producer.  A pattern value read twice (the array whose
  max is subtracted is the array reduced; the exponentials summed are those
  divided) binds ONE host value — or a host value computed twice the same way
  (the same spec on the same inputs: a duplicate the match takes in too);
* **types**: every host value carries the images of its pattern value's axes,
  plus any *extra* axes — none of them an axis the pattern binds (a value carries
  a bound axis exactly where the pattern's does); an extra axis is woven, never
  reduced, by every matched op (so one pattern matches softmax over v of X[n,v]
  and over x of S[h,q,x]).  An axis variable that no op binds (one a parameter
  names, such as the d of 1/|d|) is bound by the types when one host axis alone
  can be it;
* **gluing**: values the match computes, but for its output, are read by no op
  outside the match and are not outputs of the program.  With one output and
  every matched op upstream of it, the match is then convex (nothing outside
  lies between two of its ops).

Side conditions are data: the sharing of axis variables and of values in the
pattern diagram *is* the premise ("the max and the sum reduce the same axis",
"the subtracted value is the max of the same array"), each failure is named
after the ops of the pattern involved (their ``name=`` in the pattern), and a
pattern may add conditions of its own (:class:`Condition`).  A failed match
gives the reason of the attempt that got furthest.

Speed: a pattern is anchored at one op kind (its output's producer); the host's
op nodes are indexed by (kind, function) once per frozen graph view, and a
match grows from each candidate anchor along edges — no subgraph isomorphism
over the whole graph.  A host with no op of the anchor's kind costs one
dictionary lookup per pattern.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import sympy

from napkin.core.arrays import Axis
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, to_graph

__all__ = ["Condition", "Match", "Pattern", "anchor_key", "attempt", "find", "match_at"]


def anchor_key(spec) -> tuple:
    """What a host op must be to anchor a pattern ending in ``spec``: its kind and function."""
    return (spec.kind, getattr(spec, "fn", None))


def _commutative(spec) -> bool:
    # a contraction names its operands' axes: its inputs may come in either order
    return spec.kind == "contract" or spec.commutative


def _reduced(types_in, types_out) -> set:
    return {a for t in types_in for a in t.names} - {a for t in types_out for a in t.names}


@dataclass(frozen=True)
class Condition:
    """A side condition beyond the pattern's shape: ``test(match)`` returns None when it
    holds, else the reason (one line, naming the premise)."""
    description: str
    test: Callable


class Pattern:
    """A pattern: ``fn(*arrays, **variables)`` traced over array variables.

    ``inputs``: ``{name: (axis variable, ...)}`` in ``fn``'s argument order;
    ``consts``: names of constant variables (``fn`` gets a sympy symbol for each);
    ``conditions``: extra :class:`Condition` s; ``notes``: ``{op name: text}``
    explaining a parameter the pattern needs (``{axis}`` fields name host axes).
    The ops' ``name=`` in ``fn`` are their roles in messages ("the max")."""

    def __init__(self, name: str, fn: Callable, inputs: dict, consts=(), conditions=(),
                 notes: dict | None = None):
        from napkin.frontend.trace import trace
        self.name, self.fn = name, fn
        self.input_names = tuple(inputs)
        self.axis_vars = tuple(dict.fromkeys(a for axes_ in inputs.values() for a in axes_))
        self.const_vars = tuple(consts)
        self.conditions = tuple(conditions)
        self.notes = dict(notes or {})
        axes = {a: Axis(a, a) for a in self.axis_vars}
        self.const_symbols = {c: sympy.Symbol(c, real=True) for c in self.const_vars}
        kwargs = {**axes, **self.const_symbols}  # fn gets Axis objects: names and sizes
        self.diagram = trace(lambda *xs: fn(*xs, **kwargs),
                             [(n, tuple(axes[a] for a in inputs[n])) for n in self.input_names],
                             f"pattern {name}")
        g = to_graph(self.diagram)
        self.graph = g
        self.inputs = tuple(g.graph["inputs"])
        outs = g.graph["outputs"]
        if len(outs) != 1:
            raise NapkinError(f"pattern {name}: needs exactly one output, has {len(outs)}")
        self.output = outs[0]
        self.producer = {v: (n, k) for n in op_order(g) for k, v in enumerate(g.nodes[n]["outs"])}
        if self.output not in self.producer:
            raise NapkinError(f"pattern {name}: its output is an input, not computed")
        self.anchor = self.producer[self.output][0]
        self.ops = tuple(op_order(g))
        upstream = nx.ancestors(g, self.output)
        stray = [n for n in self.ops if n not in upstream]
        if stray:
            raise NapkinError(f"pattern {name}: {self.role(stray[0])} does not lead to the output")
        unused = [v for v in self.inputs if not g.out_degree(v)]
        if unused:
            raise NapkinError(f"pattern {name}: input {g.nodes[unused[0]]['ob'].name} is unused")
        self.key = anchor_key(g.nodes[self.anchor]["box"].spec)
        # which sympy symbols in parameters are sizes of axis variables
        self.size_symbols = {axes[a].size: a for a in self.axis_vars}

    # -- reading the pattern -----------------------------------------------------------------
    def role(self, n) -> str:
        return self.graph.nodes[n]["box"].name

    def value_name(self, v) -> str:
        return self.graph.nodes[v]["ob"].name

    def names(self, v) -> tuple:
        return self.graph.nodes[v]["ob"].type.names

    def _reduced(self, n) -> set:
        g = self.graph
        return _reduced([g.nodes[v]["ob"].type for v in g.nodes[n]["ins"]],
                        [g.nodes[v]["ob"].type for v in g.nodes[n]["outs"]])

    def __repr__(self):
        return f"Pattern({self.name!r})"


@dataclass(eq=False)
class Match:
    """One occurrence of a pattern in a host graph."""
    pattern: Pattern
    graph: nx.DiGraph = field(repr=False)
    ops: frozenset              # host op nodes (the pattern's, and duplicates it took in)
    inputs: dict                # pattern input name -> host value node
    output: int                 # host value node of the pattern's output
    axes: dict                  # axis variable -> host axis name
    sizes: dict                 # axis variable -> host axis size
    consts: dict                # constant variable -> host value

    def axis(self, var: str) -> str:
        return self.axes[var]

    def const(self, name: str):
        return self.consts[name]

    @property
    def anchor(self) -> int:
        return next(iter(self.graph.predecessors(self.output)))

    @property
    def out_ob(self):
        return self.graph.nodes[self.output]["ob"]

    def indices(self) -> tuple[int, ...]:
        """The matched ops as op indices of the body (a site's ``ops``)."""
        pos = _positions(self.graph)
        return tuple(sorted(pos[n] for n in self.ops))


# ----------------------------------------------------------------------------- the index
def _positions(g) -> dict:
    """op node -> op index (memoised on frozen views, as napkin.core.ir.ops is)."""
    frozen = nx.is_frozen(g)
    if frozen and "_op_index" in g.graph:
        return g.graph["_op_index"]
    pos = {n: i for i, n in enumerate(op_order(g))}
    if frozen:
        g.graph["_op_index"] = pos
    return pos


def by_kind(g) -> dict:
    """(kind, fn) -> host op nodes, in op order (memoised on frozen views)."""
    frozen = nx.is_frozen(g)
    if frozen and "_by_kind" in g.graph:
        return g.graph["_by_kind"]
    index: dict = {}
    for n in op_order(g):
        index.setdefault(anchor_key(g.nodes[n]["box"].spec), []).append(n)
    if frozen:
        g.graph["_by_kind"] = index
    return index


def find(pattern: Pattern, graph) -> list[Match]:
    """Every match of ``pattern`` in ``graph`` (one per set of host ops), anchors in op order."""
    out = []
    for n in by_kind(graph).get(pattern.key, ()):
        out += match_at(pattern, graph, n)[0]
    return out


# ----------------------------------------------------------------------------- matching
class _State:
    __slots__ = ("val", "op", "axis", "by", "reader", "dups")

    def __init__(self):
        self.val, self.op, self.axis, self.by, self.reader = {}, {}, {}, {}, {}
        self.dups: set = set()

    def copy(self) -> "_State":
        s = _State()
        s.val, s.op, s.axis = dict(self.val), dict(self.op), dict(self.axis)
        s.by, s.reader, s.dups = dict(self.by), dict(self.reader), set(self.dups)
        return s


class _Matcher:
    """One anchored attempt: grows bindings from the anchor, remembers the reason of
    the attempt that bound the most ops."""

    def __init__(self, pattern: Pattern, graph):
        self.p, self.g = pattern, graph
        self.reason, self.progress = "", -1
        self.outputs = set(graph.graph["outputs"])

    # -- helpers ------------------------------------------------------------------------------
    def ob(self, v):
        return self.g.nodes[v]["ob"]

    def host_role(self, n) -> str:
        return self.g.nodes[n]["box"].name

    def fail(self, st: _State, why: str):
        if len(st.op) >= self.progress:
            self.progress, self.reason = len(st.op), why
        return None

    # -- the search -----------------------------------------------------------------------
    def run(self, anchor) -> list[Match]:
        st = _State()
        outs, port = self.g.nodes[anchor]["outs"], self.p.producer[self.p.output][1]
        if port >= len(outs):
            self.fail(st, f"{self.host_role(anchor)} has no output port {port}")
            return []
        hv_out = outs[port]
        found, seen = [], set()
        for final in self.grow(st, [(self.p.output, hv_out, "the result")]):
            m = self.complete(final)
            if m is not None and m.ops not in seen:
                seen.add(m.ops)
                found.append(m)
        return found

    def grow(self, st: _State, work: list):
        p, g = self.p, self.g
        while work:
            pv, hv, reader = work.pop()
            if pv in st.val:
                if st.val[pv] == hv:
                    continue
                dups: set = set()
                if self.same(st.val[pv], hv, dups):
                    st.dups |= dups
                    continue
                first = st.reader[pv]
                return self.fail(st, f"{first} and {reader} must read the same array "
                                     f"{p.value_name(pv)}: here {first} reads "
                                     f"{self.ob(st.val[pv])} and {reader} reads {self.ob(hv)}")
            st.val[pv], st.reader[pv] = hv, reader
            if pv not in p.producer:
                continue  # a pattern input: any host value
            po, port = p.producer[pv]
            role = p.role(po)
            preds = list(g.predecessors(hv))
            if not preds:
                return self.fail(st, f"{role} should compute {self.ob(hv)}, which is an input "
                                     f"of the program")
            ho = preds[0]
            if g.nodes[ho]["outs"].index(hv) != port:
                return self.fail(st, f"{self.ob(hv)} is not output {port} of {self.host_role(ho)}")
            if po in st.op:
                if st.op[po] != ho:
                    return self.fail(st, f"{role} is bound twice")
                continue
            why = self.spec(st, po, ho)
            if why:
                return self.fail(st, why)
            st.op[po] = ho
            p_ins, h_ins = p.graph.nodes[po]["ins"], g.nodes[ho]["ins"]
            if len(p_ins) != len(h_ins):
                return self.fail(st, f"{role} takes {len(p_ins)} input(s), "
                                     f"{self.host_role(ho)} takes {len(h_ins)}")
            orders = [list(h_ins)]
            if len(h_ins) == 2 and _commutative(g.nodes[ho]["box"].spec) and h_ins[0] != h_ins[1]:
                orders.append([h_ins[1], h_ins[0]])
            if len(orders) == 1:
                work.extend((a, b, role) for a, b in reversed(list(zip(p_ins, h_ins))))
                continue
            for hs in orders:  # a commutative op: each order in a branch of its own
                branch = work + [(a, b, role) for a, b in reversed(list(zip(p_ins, hs)))]
                yield from self.grow(st.copy(), branch)
            return
        yield st

    def same(self, h1, h2, dups: set) -> bool:
        """Do host values h1 and h2 hold the same array, computed the same way (the same
        spec, on inputs that are the same)?  ``dups`` collects h2's ops."""
        if h1 == h2:
            return True
        g = self.g
        a, b = list(g.predecessors(h1)), list(g.predecessors(h2))
        if not a or not b:
            return False
        (o1,), (o2,) = a, b
        n1, n2 = g.nodes[o1], g.nodes[o2]
        if n1["box"].spec != n2["box"].spec or n1["outs"].index(h1) != n2["outs"].index(h2):
            return False
        if self.ob(h1).type != self.ob(h2).type or len(n1["ins"]) != len(n2["ins"]):
            return False
        orders = [list(n2["ins"])]
        if len(n2["ins"]) == 2 and _commutative(n2["box"].spec):
            orders.append(list(reversed(n2["ins"])))
        for ins2 in orders:
            trial: set = set()
            if all(self.same(x, y, trial) for x, y in zip(n1["ins"], ins2)):
                dups |= trial | {o2}
                return True
        return False

    def bind(self, st: _State, var: str, host_axis: str, role: str, verb: str) -> str | None:
        if var in st.axis:
            if st.axis[var] != host_axis:
                first, first_verb = st.by[var]
                return (f"{first} {first_verb} {st.axis[var]} but {role} {verb} {host_axis}")
            return None
        taken = [a for a, h in st.axis.items() if h == host_axis]
        if taken:
            first, first_verb = st.by[taken[0]]
            return (f"{role} {verb} {host_axis}, the axis {first} {first_verb}, where the pattern "
                    f"needs two different axes")
        st.axis[var], st.by[var] = host_axis, (role, verb)
        return None

    def spec(self, st: _State, po, ho) -> str | None:
        """Why host op ``ho`` is not the pattern's op ``po`` (None: it is, so far)."""
        ps, hs = self.p.graph.nodes[po]["box"].spec, self.g.nodes[ho]["box"].spec
        role = self.p.role(po)
        if type(ps) is not type(hs) or getattr(ps, "fn", None) != getattr(hs, "fn", None):
            return f"{role} should be {_describe(ps)}, here it is {self.host_role(ho)}"
        if ps.kind == "reduce":
            return self.bind(st, ps.axis, hs.axis, role, "reduces")
        if ps.kind == "softmax":
            return self.bind(st, ps.axis, hs.axis, role, "normalises over")
        if ps.kind == "contract":
            p_red = sorted(self.p._reduced(po))
            h_red = sorted(_reduced([self.ob(v).type for v in self.g.nodes[ho]["ins"]],
                                    [self.ob(v).type for v in self.g.nodes[ho]["outs"]]))
            free = [a for a in p_red if a not in st.axis]
            if len(free) == 1 and len(p_red) == len(h_red):
                rest = [h for h in h_red if h not in {st.axis[a] for a in p_red if a in st.axis}]
                if len(rest) == 1:
                    return self.bind(st, free[0], rest[0], role, "sums")
            if not free and sorted(st.axis[a] for a in p_red) != h_red:
                need = ", ".join(st.axis[a] for a in p_red)
                return f"{role} sums {', '.join(h_red) or 'nothing'} but the pattern sums {need}"
            return None
        if ps.kind == "map" or ps.kind == "zip":
            return None  # a map's parameter is compared once every size is bound
        return None if ps == hs else f"{role} should be {ps.label()}, here {hs.label()}"

    def complete(self, st: _State) -> Match | None:
        p, g = self.p, self.g
        sizes: dict = {}
        for pv, hv in st.val.items():  # an axis variable no op bound: by the types, if only
            loose = [a for a in p.names(pv) if a not in st.axis]  # one host axis can be it
            if loose:
                left = [h for h in self.ob(hv).type.names if h not in st.axis.values()]
                if len(loose) != 1 or len(left) != 1:
                    return self.fail(st, f"cannot tell which axis of {self.ob(hv)} is the "
                                         f"pattern's {loose[0]}")
                st.axis[loose[0]], st.by[loose[0]] = left[0], (p.value_name(pv), "carries")
        bound_axes = set(st.axis.values())
        for pv, hv in st.val.items():  # types: the images of the pattern's axes, plus extras
            t = self.ob(hv).type
            stray = sorted(bound_axes & set(t.names) - {st.axis[a] for a in p.names(pv)})
            if stray:  # an extra axis is none the pattern binds: v on a value it reduced away
                return self.fail(st, f"{self.ob(hv)} carries {stray[0]}, which the pattern's "
                                     f"{p.value_name(pv)} lacks")
            for a in p.names(pv):
                h = st.axis[a]
                if not t.has(h):
                    return self.fail(st, f"{self.ob(hv)} lacks axis {h}, which the pattern's "
                                         f"{p.value_name(pv)} carries as {a}")
                size = t.axis(h).size
                if sizes.setdefault(a, size) != size:
                    return self.fail(st, f"axis {h} has size {sizes[a]} and {size} in the match")
        image = st.axis
        for po, ho in st.op.items():  # extra axes are woven, never reduced
            h_red = _reduced([self.ob(v).type for v in g.nodes[ho]["ins"]],
                             [self.ob(v).type for v in g.nodes[ho]["outs"]])
            extra = sorted(h_red - {image[a] for a in p._reduced(po)})
            if extra:
                return self.fail(st, f"{p.role(po)} also reduces {', '.join(extra)}, an axis "
                                     f"the pattern does not reduce (an extra axis must be woven)")
        consts: dict = {}
        subs = {s: sizes[a] for s, a in p.size_symbols.items() if a in sizes}
        for po in p.ops:  # parameters, once every size is known (pattern order: consts bind)
            ps = p.graph.nodes[po]["box"].spec
            if ps.kind != "map" or ps.param is None:
                continue
            hs = g.nodes[st.op[po]]["box"].spec
            param = sympy.sympify(ps.param)
            var = next((c for c, s in p.const_symbols.items() if s == param), None)
            if var is not None:
                if var not in consts:
                    consts[var] = hs.param
                    continue
                want = consts[var]
            else:
                known = {p.const_symbols[c]: value for c, value in consts.items()}
                want = param.xreplace({**subs, **known})
            if not _same_number(want, hs.param):
                note = p.notes.get(p.role(po))
                note = f" ({note.format(**image)})" if note else ""
                return self.fail(st, f"{p.role(po)} is {hs.label()} but the pattern needs "
                                     f"{ps.fn}({want}){note}")
        matched = frozenset(st.op.values()) | frozenset(st.dups)
        hv_out = st.val[p.output]
        for name, v in zip(p.input_names, p.inputs):  # the rhs reads its inputs: keep them
            made = set(g.predecessors(st.val[v])) & matched
            if made:
                maker = self.host_role(next(iter(made)))
                return self.fail(st, f"the pattern's input {name} is {self.ob(st.val[v])}, which "
                                     f"{maker} inside the match computes")
        for n in matched:  # gluing: what the match computes stays inside it
            for v in g.nodes[n]["outs"]:
                if v == hv_out:
                    continue
                outside = [c for c in g.successors(v) if c not in matched]
                if outside:
                    return self.fail(st, f"{self.ob(v)} (from {self.host_role(n)}) is also read "
                                         f"by {self.host_role(outside[0])} outside the pattern")
                if v in self.outputs:
                    return self.fail(st, f"{self.ob(v)} (from {self.host_role(n)}) is also an "
                                         f"output of the program")
        m = Match(p, g, matched, {name: st.val[v] for name, v in zip(p.input_names, p.inputs)},
                  hv_out, dict(image), sizes, consts)
        for c in p.conditions:
            why = c.test(m)
            if why:
                return self.fail(st, why)
        return m


def match_at(pattern: Pattern, graph, op) -> tuple[list[Match], str]:
    """The matches of ``pattern`` anchored at host op ``op`` (its output is the
    pattern's), and — when there is none — the reason, in words."""
    found, why, _ = attempt(pattern, graph, op)
    return found, why


def attempt(pattern: Pattern, graph, op) -> tuple[list[Match], str, int]:
    """:func:`match_at`, with how far the furthest failed attempt got (ops bound): of
    several patterns that all fail, the furthest names the premise that matters."""
    spec = graph.nodes[op]["box"].spec
    if anchor_key(spec) != pattern.key:
        p_spec = pattern.graph.nodes[pattern.anchor]["box"].spec
        return [], (f"the pattern ends in {pattern.role(pattern.anchor)} "
                    f"({_describe(p_spec)}), and {graph.nodes[op]['box'].name} is not one"), -1
    m = _Matcher(pattern, graph)
    found = m.run(op)
    return found, ("" if found else m.reason), m.progress


def _describe(spec) -> str:
    if spec.kind == "reduce":
        return f"{spec.fn}_{spec.axis}"
    if spec.kind == "map":
        return spec.fn
    if spec.kind == "zip":
        return spec.fn
    return spec.kind


def _same_number(a, b) -> bool:
    """Two parameters are equal: symbolically, or as numbers to 1e-12 (a host's 1/4096
    is a float, the pattern's 1/|v| a rational)."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    if a == b:
        return True
    if a.is_number and b.is_number:
        fa, fb = complex(a), complex(b)
        return abs(fa - fb) <= 1e-12 * max(abs(fa), abs(fb), 1e-300)
    return sympy.simplify(a - b) == 0
