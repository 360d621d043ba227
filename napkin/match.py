"""Pattern matching and rewriting on the networkx view of diagrams.

DisCoPy has no rewriting, so rules act on the graph of :mod:`napkin.ir`
(value nodes + op nodes).  A :class:`Pattern` is itself written as a diagram
(usually a traced ``@algorithm``); :func:`find_matches` finds its occurrences
in a host graph, :func:`replace` splices a replacement in, and
:func:`rewrite` does both on diagrams and emits the result with
:func:`napkin.ir.to_diagram`.

What a match is
---------------
* Structure: a subgraph monomorphism (networkx VF2, host first) from the
  pattern graph into the host graph: pattern ops -> host ops, pattern values
  -> host values, injective.  Two distinct pattern inputs never bind the same
  host value.
* Ports: every matched op takes its inputs port by port (pattern input port i
  is host input port i) and gives its outputs port by port.  Commutative ops
  (``Zip`` add/mul/max/min, and ``Contract``, whose operands are named) may
  take theirs in any order.
* Interior values (produced inside the pattern, not pattern outputs) are used
  by no host op outside the match and are not host outputs.
* Convexity: no host path leaves the match and re-enters it (splicing the
  replacement would make a cycle).
* Axes: one consistent, injective *axis binding* pattern-axis-name ->
  host-axis-name (the identity unless ``rename_axes=True``) such that every
  matched host wire carries exactly the image of its pattern wire's axes plus
  *extra* axes that are no image at all (weaving; forbidden with
  ``extra_axes=False``); extra axes entering a host op must leave it in every
  output (they are woven, never reduced); axis parameters of the specs
  (``Softmax.axis``, ``Reduce.axis``, ``Mask.q``/``k``) correspond.  Symbolic
  pattern sizes bind to host sizes consistently (``size_binding``); concrete
  pattern sizes must be equal.  Axis order on a wire is irrelevant (every
  primitive is written against axis names).
* Ops: by default a pattern op matches a host op with the same spec after
  renaming its axis parameters and sizes (any ``Contract``: its output axes
  are checked through the wire types).  A custom ``node_match(pattern_box,
  host_box) -> bool`` replaces that test (axis parameters are still bound
  when the two specs have the same class).
* Dtypes are ignored unless ``match_dtypes=True``.

Replacement
-----------
:func:`replace` wires the replacement's inputs to the host values bound to
the pattern's inputs (in order), re-points every host consumer and host
output of each pattern output to the replacement's output, and removes the
matched ops and the values they produced.  By default the replacement is
*re-instantiated* on the host's types (:func:`instantiate`): axis parameters
are renamed by the binding, symbolic sizes in parameters substituted, extra
woven axes kept by contractions (in front), outputs transposed into the
host's axis order when needed.  So a replacement is written over the same
wires as the pattern, whatever host it lands in.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import sympy
from discopy import markov
from networkx.algorithms.isomorphism import DiGraphMatcher

from napkin.arrays import ArrayOb, ArrayType
from napkin.errors import NapkinError, RuleError
from napkin.ir import GraphBuilder, ops, to_diagram, to_graph
from napkin.op import make_op
from napkin.primitives import Contract, Spec, Zip

__all__ = [
    "Pattern", "Match", "find_matches", "explain_no_match", "replace", "instantiate",
    "rewrite", "rewrite_all", "rename_spec", "is_commutative",
]

NodeMatch = Callable[[object, object], bool]

# Spec fields that hold one axis name.
AXIS_FIELDS = ("axis", "q", "k")
COMMUTATIVE_ZIPS = frozenset({"add", "mul", "max", "min"})
# Axis-binding search: at most this many complete assignments are tried.
_MAX_BINDINGS = 10_000


class _Reject(Exception):
    """A candidate fails a filter; the message is the human reason."""


# --------------------------------------------------------------------------- specs
def is_commutative(spec: Spec) -> bool:
    """Whether the op's inputs may be matched in any order."""
    return isinstance(spec, Contract) or (isinstance(spec, Zip) and spec.fn in COMMUTATIVE_ZIPS)


def rename_spec(spec: Spec, axis_binding: dict | None = None, size_binding: dict | None = None,
                woven: tuple[str, ...] = ()) -> Spec:
    """``spec`` with its axis parameters renamed by ``axis_binding`` (names not
    in it are kept), symbolic sizes in numeric parameters substituted by
    ``size_binding``, and, for a Contract, the axes ``woven`` prepended to its
    output axes."""
    axis_binding = axis_binding or {}
    if not dataclasses.is_dataclass(spec):
        return spec
    changes = {}
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if f.name in AXIS_FIELDS and isinstance(v, str):
            if axis_binding.get(v, v) != v:
                changes[f.name] = axis_binding[v]
        elif f.name == "out" and isinstance(spec, Contract):
            new = tuple(woven) + tuple(axis_binding.get(a, a) for a in v)
            if new != v:
                changes["out"] = new
        elif isinstance(v, sympy.Basic) and size_binding and v.free_symbols:
            new = v.subs(size_binding, simultaneous=True)
            if new != v:
                changes[f.name] = new
    return dataclasses.replace(spec, **changes) if changes else spec


def _signature(spec: Spec):
    """What the default predicate compares before any axis is bound."""
    if isinstance(spec, Contract):
        return (type(spec),)
    if not dataclasses.is_dataclass(spec):
        return (type(spec), spec)
    sig = [type(spec)]
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if f.name in AXIS_FIELDS and isinstance(v, str):
            sig.append((f.name, "<axis>"))
        elif isinstance(v, sympy.Basic) and v.free_symbols:
            sig.append((f.name, "<expr>"))
        else:
            sig.append((f.name, v))
    return tuple(sig)


# --------------------------------------------------------------------------- pattern
def _as_graph(d) -> nx.DiGraph:
    if isinstance(d, nx.DiGraph):
        return d
    if isinstance(d, markov.Diagram):
        return to_graph(d)
    raise NapkinError(f"expected a diagram or an ir graph, got {type(d).__name__}")


def _name(graph, n) -> str:
    node = graph.nodes[n]
    return node["box"].name if node["kind"] == "op" else node["ob"].name


def _wire(graph, v) -> str:
    return str(graph.nodes[v]["ob"])


class Pattern:
    """A small graph to find in hosts, written as a diagram.

    ``source``: a diagram (e.g. a traced ``@algorithm``) or an ir graph.  Its
    inputs (dom order) are the pattern's inputs, its outputs (cod order) the
    pattern's outputs; every input must be used and every output must be
    computed by a pattern op (distinct outputs).  Options: ``node_match``
    (custom op predicate ``(pattern_box, host_box) -> bool``), ``rename_axes``
    (match up to a consistent renaming of axis names), ``extra_axes`` (allow
    extra woven host axes), ``match_dtypes`` (wire dtypes must be equal).
    """

    def __init__(self, source, node_match: NodeMatch | None = None, *, rename_axes: bool = False,
                 extra_axes: bool = True, match_dtypes: bool = False, name: str | None = None):
        g = _as_graph(source)
        self.graph = g
        self.node_match = node_match
        self.rename_axes = rename_axes
        self.extra_axes = extra_axes
        self.match_dtypes = match_dtypes
        self.inputs: list[int] = list(g.graph["inputs"])
        self.outputs: list[int] = list(g.graph["outputs"])
        self.ops: list[int] = ops(g)
        if not self.ops:
            raise NapkinError("a pattern needs at least one op")
        self.name = name or " → ".join(_name(g, o) for o in self.ops)
        produced = {v: o for o in self.ops for v in g.nodes[o]["outs"]}
        for v in self.inputs:
            if g.out_degree(v) == 0:
                raise NapkinError(f"pattern {self.name}: input {_wire(g, v)} is unused "
                                  "(it would bind no host value)")
        if len(set(self.outputs)) != len(self.outputs):
            raise NapkinError(f"pattern {self.name}: an output is listed twice")
        for v in self.outputs:
            if v not in produced:
                raise NapkinError(f"pattern {self.name}: output {_wire(g, v)} is an input, "
                                  "not computed by the pattern")
        outs = set(self.outputs)
        self.interior: list[int] = [v for v in produced if v not in outs]
        self.producer = produced
        self._signatures = {o: _signature(g.nodes[o]["box"].data) for o in self.ops}

    def __repr__(self):
        return f"Pattern({self.name!r})"

    # VF2 node predicate: host attrs first, pattern attrs second.
    def _vf2_node_match(self, h: dict, p: dict) -> bool:
        if h["kind"] != p["kind"]:
            return False
        if p["kind"] == "value":
            pt, ht = p["ob"].type, h["ob"].type
            if self.match_dtypes and pt.dtype != ht.dtype:
                return False
            if self.extra_axes:
                if len(pt.axes) > len(ht.axes):
                    return False
            elif len(pt.axes) != len(ht.axes):
                return False
            if not self.rename_axes and not set(pt.names) <= set(ht.names):
                return False
            return True
        pb, hb = p["box"], h["box"]
        if len(pb.dom) != len(hb.dom) or len(pb.cod) != len(hb.cod):
            return False
        if self.node_match is not None:
            return bool(self.node_match(pb, hb))
        ps, hs = pb.data, hb.data
        return ps.kind == hs.kind and _signature(ps) == _signature(hs)


# --------------------------------------------------------------------------- match
@dataclass(eq=False)
class Match:
    """One occurrence of a pattern in a host graph."""
    pattern: Pattern
    host: nx.DiGraph = field(repr=False)
    mapping: dict          # pattern node -> host node (ops and values)
    axis_binding: dict     # pattern axis name -> host axis name
    size_binding: dict     # pattern size symbol -> host size
    extra_axes: tuple      # host axis names on matched wires that no pattern axis binds

    def __getitem__(self, pattern_node):
        return self.mapping[pattern_node]

    @property
    def ops(self) -> frozenset:
        """The host op nodes matched."""
        return frozenset(self.mapping[o] for o in self.pattern.ops)

    @property
    def inputs(self) -> list:
        """Host values bound to the pattern's inputs, in pattern input order."""
        return [self.mapping[v] for v in self.pattern.inputs]

    @property
    def outputs(self) -> list:
        """Host values bound to the pattern's outputs, in pattern output order."""
        return [self.mapping[v] for v in self.pattern.outputs]

    @property
    def interior(self) -> list:
        return [self.mapping[v] for v in self.pattern.interior]

    def describe(self) -> str:
        return ", ".join(_name(self.host, self.mapping[o]) for o in self.pattern.ops)

    def __repr__(self):
        ren = {a: b for a, b in self.axis_binding.items() if a != b}
        extra = f", extra axes {list(self.extra_axes)}" if self.extra_axes else ""
        return f"Match({self.pattern.name!r} at [{self.describe()}]" + \
            (f", axes {ren}" if ren else "") + extra + ")"


class _Context:
    """Per-host data shared by all candidates."""

    def __init__(self, host: nx.DiGraph):
        self.host = host
        self.host_outputs = set(host.graph["outputs"])
        self._pos = None

    @property
    def pos(self) -> dict:
        if self._pos is None:
            self._pos = {n: i for i, n in enumerate(nx.topological_sort(self.host))}
        return self._pos


def _check_ports(p: Pattern, ctx: _Context, m: dict, label: str) -> None:
    g, host = p.graph, ctx.host
    for o in p.ops:
        pn, hn = g.nodes[o], host.nodes[m[o]]
        want = [m[v] for v in pn["ins"]]
        have = list(hn["ins"])
        if want != have:
            spec = hn["box"].data
            ok = False
            if len(want) == len(have) and is_commutative(spec) and is_commutative(pn["box"].data):
                ok = Counter(want) == Counter(have)
            if not ok:
                raise _Reject(
                    f"matched {label} but {_name(host, m[o])} takes its inputs in another order "
                    f"({', '.join(_name(host, v) for v in have)}) than the pattern's "
                    f"{_name(g, o)} ({', '.join(_name(g, v) for v in pn['ins'])})")
        if [m[v] for v in pn["outs"]] != list(hn["outs"]):
            raise _Reject(f"matched {label} but the outputs of {_name(host, m[o])} are in "
                          "another order than in the pattern")


def _check_escape(p: Pattern, ctx: _Context, m: dict, label: str) -> None:
    host = ctx.host
    matched = {m[o] for o in p.ops}
    for v in p.interior:
        hv = m[v]
        producer = _name(host, m[p.producer[v]])
        for c in host.successors(hv):
            if c not in matched:
                raise _Reject(f"matched {label} but the output {_name(host, hv)} of {producer} "
                              f"is also used by {_name(host, c)} outside the pattern")
        if hv in ctx.host_outputs:
            raise _Reject(f"matched {label} but the output {_name(host, hv)} of {producer} "
                          "is also an output of the host, and the pattern hides it")


def _check_convex(p: Pattern, ctx: _Context, m: dict, label: str) -> None:
    host = ctx.host
    matched = {m[o] for o in p.ops}
    pos = ctx.pos
    limit = max(pos[o] for o in matched)
    parent: dict = {}
    stack = []
    for o in matched:
        for v in host.nodes[o]["outs"]:
            for c in host.successors(v):
                if c not in matched and c not in parent:
                    parent[c] = o
                    stack.append(c)
    while stack:
        n = stack.pop()
        for s in host.successors(n):
            if s in matched:  # left the match at the start of this chain, back in at s
                path = [s, n]
                while path[-1] not in matched:
                    path.append(parent[path[-1]])
                names = [_name(host, x) for x in reversed(path) if host.nodes[x]["kind"] == "op"]
                raise _Reject(f"matched {label} but the path {' → '.join(names)} leaves the "
                              "pattern and re-enters it (replacing it would make a cycle)")
            if s not in parent and pos[s] < limit:
                parent[s] = n
                stack.append(s)


def _bind_axes(p: Pattern, ctx: _Context, m: dict, label: str) -> tuple[dict, dict, tuple]:
    """The axis binding of a structural match, or _Reject with the reason."""
    g, host = p.graph, ctx.host
    values = [v for v in g.nodes if g.nodes[v]["kind"] == "value"]
    ptype = {v: g.nodes[v]["ob"].type for v in values}
    htype = {v: host.nodes[m[v]]["ob"].type for v in values}
    cand: dict[str, set] = {}
    order: list[str] = []
    for v in values:
        for a in ptype[v].names:
            if a not in cand:
                cand[a] = {a} if not p.rename_axes else None
                order.append(a)

    def narrow(a, allowed, where):
        cur = cand[a]
        cand[a] = set(allowed) if cur is None else cur & set(allowed)
        if not cand[a]:
            raise _Reject(f"matched {label} but pattern axis {a} has no counterpart "
                          f"in {where}")

    for v in values:
        hn = htype[v].names
        for a in ptype[v].names:
            narrow(a, hn, f"host {_wire(host, m[v])} (pattern {_wire(g, v)})")
    pairs = [(g.nodes[o]["box"].data, host.nodes[m[o]]["box"].data, o) for o in p.ops]
    for ps, hs, o in pairs:
        if type(ps) is not type(hs):
            continue
        for f in AXIS_FIELDS:
            pa, ha = getattr(ps, f, None), getattr(hs, f, None)
            if isinstance(pa, str):
                if not isinstance(ha, str):
                    raise _Reject(f"matched {label} but {_name(host, m[o])} has no {f} axis")
                if pa in cand:
                    narrow(pa, {ha}, f"{_name(host, m[o])} ({f} = {ha})")

    names = sorted(order, key=lambda a: len(cand[a]))
    binding: dict[str, str] = {}
    used: set = set()
    last = [f"matched {label} but no consistent axis binding exists"]
    tried = [0]

    def complete():
        image = set(binding.values())
        sizes: dict = {}
        for v in values:
            hn = set(htype[v].names)
            want = {binding[a] for a in ptype[v].names}
            if hn & image != want:
                stray = sorted((hn & image) - want)
                raise _Reject(f"matched {label} but host {_wire(host, m[v])} also carries "
                              f"axis {stray[0]}, which the pattern's {_wire(g, v)} lacks")
            if p.match_dtypes and ptype[v].dtype != htype[v].dtype:
                raise _Reject(f"matched {label} but host {_wire(host, m[v])} is "
                              f"{htype[v].dtype}, the pattern's {_wire(g, v)} {ptype[v].dtype}")
            if not p.extra_axes and hn != want:
                raise _Reject(f"matched {label} but host {_wire(host, m[v])} has extra axes "
                              f"{sorted(hn - want)} (extra axes not allowed)")
            for ax in ptype[v].axes:
                hsize, psize = htype[v].axis(binding[ax.name]).size, ax.size
                if isinstance(psize, sympy.Symbol):
                    if sizes.setdefault(psize, hsize) != hsize:
                        raise _Reject(f"matched {label} but pattern size {psize} binds both "
                                      f"{sizes[psize]} and {hsize}")
                elif sympy.sympify(psize) != sympy.sympify(hsize):
                    raise _Reject(f"matched {label} but pattern axis {ax.name} has size "
                                  f"{psize}, host axis {binding[ax.name]} has {hsize}")
        for ps, hs, o in pairs:
            hn = host.nodes[m[o]]
            extra_in = {a for v in hn["ins"] for a in host.nodes[v]["ob"].type.names} - image
            for w in hn["outs"]:
                missing = extra_in - set(host.nodes[w]["ob"].type.names)
                if missing:
                    raise _Reject(f"matched {label} but {_name(host, m[o])} reduces the extra "
                                  f"axis {sorted(missing)[0]} (extra axes must be woven)")
            if p.node_match is None and not isinstance(ps, Contract):
                renamed = rename_spec(ps, binding, sizes)
                if renamed != hs:
                    raise _Reject(f"matched {label} but pattern op {_name(g, o)} becomes "
                                  f"{renamed.label()} here, and the host has {hs.label()}")
        extras = {a for v in values for a in htype[v].names} - image
        return dict(binding), sizes, tuple(sorted(extras))

    def search(i):
        if i == len(names):
            tried[0] += 1
            try:
                return complete()
            except _Reject as e:
                last[0] = str(e)
                return None
        a = names[i]
        for h in sorted(cand[a]):
            if h in used:
                continue
            binding[a] = h
            used.add(h)
            r = search(i + 1)
            used.discard(h)
            del binding[a]
            if r is not None or tried[0] >= _MAX_BINDINGS:
                return r
        return None

    result = search(0)
    if result is None:
        raise _Reject(last[0])
    return result


class _Matcher(DiGraphMatcher):
    """VF2 (networkx) with the node test on node ids (so degrees prune too) and
    the pattern's nodes visited from its most selective op outwards."""

    def __init__(self, host: nx.DiGraph, pattern: nx.DiGraph, test, order):
        super().__init__(host, pattern)
        self._test = test
        self.G2_node_order = {n: i for i, n in enumerate(order)}

    def semantic_feasibility(self, n1, n2):
        G1, G2 = self.G1, self.G2
        if G1.out_degree(n1) < G2.out_degree(n2) or G1.in_degree(n1) < G2.in_degree(n2):
            return False
        return self._test(G1.nodes[n1], G2.nodes[n2])


def _search_order(p: Pattern, host: nx.DiGraph, test) -> list:
    """Pattern nodes in BFS order (undirected) from the op with fewest host candidates."""
    g = p.graph
    host_ops = [n for n, d in host.nodes(data=True) if d["kind"] == "op"]
    counts = {}
    for o in p.ops:
        pd = g.nodes[o]
        counts[o] = sum(1 for h in host_ops if test(host.nodes[h], pd))
    order: list = []
    seen: set = set()
    for root in sorted(p.ops, key=lambda o: (counts[o], p.ops.index(o))):
        if root in seen:
            continue
        seen.add(root)
        queue = [root]
        while queue:
            n = queue.pop(0)
            order.append(n)
            nbrs = list(g.successors(n)) + list(g.predecessors(n))
            for m in nbrs:
                if m not in seen:
                    seen.add(m)
                    queue.append(m)
    order += [n for n in g.nodes if n not in seen]  # isolated values (none in valid patterns)
    return order


def _candidates(p: Pattern, host: nx.DiGraph, relaxed: bool = False):
    """Yield (mapping, Match | None, stage reached, reason) for every structural
    match.  ``relaxed``: value nodes match any value (for explanations only)."""
    ctx = _Context(host)
    test = p._vf2_node_match
    if relaxed:
        def test(h, q):
            return h["kind"] == q["kind"] and (q["kind"] == "value" or p._vf2_node_match(h, q))
    gm = _Matcher(host, p.graph, test, _search_order(p, host, test))
    for inv in gm.subgraph_monomorphisms_iter():
        m = {pn: hn for hn, pn in inv.items()}
        label = ", ".join(_name(host, m[o]) for o in p.ops)
        stage, binding = 0, None
        try:
            _check_ports(p, ctx, m, label)
            stage = 1
            binding = _bind_axes(p, ctx, m, label)
            stage = 2
            _check_escape(p, ctx, m, label)
            stage = 3
            _check_convex(p, ctx, m, label)
            stage = 4
        except _Reject as e:
            yield m, None, stage, str(e)
            continue
        axes_, sizes, extras = binding
        yield m, Match(p, host, m, axes_, sizes, extras), stage, None


def _pattern(pattern, options) -> Pattern:
    if isinstance(pattern, Pattern):
        if options:
            raise NapkinError(f"options {sorted(options)} go to Pattern(...), not here")
        return pattern
    return Pattern(pattern, **options)


def find_matches(pattern, host, *, limit: int | None = None, rejected: list | None = None,
                 **options) -> list[Match]:
    """All matches of ``pattern`` (a Pattern, or a diagram/graph made into one
    with ``options``) in ``host`` (a diagram or an ir graph), one per set of
    host ops, in the order VF2 finds them; at most ``limit``.  Pass a list as
    ``rejected`` to collect ``(mapping, reason)`` for every structural
    candidate that a filter rejected."""
    p = _pattern(pattern, options)
    host = _as_graph(host)
    found, seen = [], set()
    for mapping, match, _, reason in _candidates(p, host):
        if match is None:
            if rejected is not None:
                rejected.append((mapping, reason))
            continue
        if match.ops in seen:
            continue
        seen.add(match.ops)
        found.append(match)
        if limit is not None and len(found) >= limit:
            break
    return found


def explain_no_match(pattern, host, **options) -> str | None:
    """Why ``pattern`` does not match ``host``: one short human sentence (the
    reason of the candidate that got furthest), or None when it matches."""
    p = _pattern(pattern, options)
    host = _as_graph(host)
    best, best_stage = None, -1
    for _, match, stage, reason in _candidates(p, host):
        if match is not None:
            return None
        if stage > best_stage:
            best, best_stage = reason, stage
    if best is None:  # no structural match: try again ignoring wire types, for the reason
        for _, match, stage, reason in _candidates(p, host, relaxed=True):
            if match is None and stage > best_stage:
                best, best_stage = reason, stage
    if best is not None:
        return best
    host_ops = [n for n, d in host.nodes(data=True) if d["kind"] == "op"]
    for o in p.ops:
        pd = p.graph.nodes[o]
        if not any(p._vf2_node_match(host.nodes[h], pd) for h in host_ops):
            return f"no host op matches the pattern's {_name(p.graph, o)}"
    return (f"the host has ops like each of {p.name}, but never wired together as in the "
            "pattern (or on wires with other axes)")


# --------------------------------------------------------------------------- replacement
def instantiate(graph, input_types: list[ArrayType], axis_binding: dict | None = None,
                size_binding: dict | None = None, output_types: list[ArrayType] | None = None,
                output_names: list[str] | None = None) -> nx.DiGraph:
    """Rebuild ``graph`` (a diagram or ir graph written over pattern axes) on
    new input types: axis parameters renamed by ``axis_binding`` (default: the
    identity on the graph's input axes), symbolic sizes in parameters
    substituted by ``size_binding``, axes of the new inputs that no pattern axis
    binds (extra axes) woven through every op (contractions keep them, in
    front).  With ``output_types`` each output is transposed into that type's
    axis order where needed (RuleError if its axes or dtype differ);
    ``output_names`` relabels the outputs' wires."""
    g = _as_graph(graph)
    inputs = g.graph["inputs"]
    if len(input_types) != len(inputs):
        raise RuleError(f"instantiate: {len(inputs)} inputs but {len(input_types)} types given")
    if axis_binding is None:
        axis_binding = {a: a for v in inputs for a in g.nodes[v]["ob"].type.names}
    image = set(axis_binding.values())
    b = GraphBuilder()
    env = {}
    for v, t in zip(inputs, input_types):
        env[v] = b.input(ArrayOb(g.nodes[v]["ob"].name, t))
    outputs = g.graph["outputs"]
    rename_out = {}
    if output_names is not None:
        for v, nm in zip(outputs, output_names):
            rename_out.setdefault(v, nm)
    for o in ops(g):
        node = g.nodes[o]
        box, spec = node["box"], node["box"].data
        args = [env[v] for v in node["ins"]]
        dom = markov.Ty(*(b.graph.nodes[a]["ob"] for a in args))
        woven = ()
        if isinstance(spec, Contract):
            seen = dict.fromkeys(n for ob in dom.inside for n in ob.type.names)
            woven = tuple(n for n in seen if n not in image)
        new = rename_spec(spec, axis_binding, size_binding, woven)
        name = new.label() if box.name == spec.label() else box.name
        out_names = [rename_out.get(v, name if ob.name == box.name else ob.name)
                     for v, ob in zip(node["outs"], box.cod.inside)]
        try:
            newbox = make_op(new, dom, out_names, name)
        except NapkinError as e:
            raise RuleError(f"cannot retype the replacement: {e}") from None
        for v, w in zip(node["outs"], b.op(newbox, args)):
            env[v] = w
    outs = [env[v] for v in outputs]
    if output_types is not None:
        if len(output_types) != len(outs):
            raise RuleError(f"instantiate: {len(outs)} outputs but {len(output_types)} types given")
        names = output_names or [b.graph.nodes[w]["ob"].name for w in outs]
        for i, (w, t) in enumerate(zip(outs, output_types)):
            have = b.graph.nodes[w]["ob"].type
            if have == t:
                continue
            if set(have.names) != set(t.names) or have.dtype != t.dtype:
                raise RuleError(f"the replacement's output {i} is {_typestr(have)} but the host "
                                f"needs {_typestr(t)}")
            box = make_op(Contract(t.names), markov.Ty(b.graph.nodes[w]["ob"]), [names[i]],
                          "transpose")
            outs[i] = b.op(box, [w])[0]
    return b.finish(outs)


def _typestr(t: ArrayType) -> str:
    return f"{t} ({t.dtype})"


def replace(host_graph, match: Match, replacement, *, retype: bool = True) -> nx.DiGraph:
    """A new host graph with ``match`` replaced by ``replacement`` (a diagram
    or ir graph with as many inputs and outputs as the pattern).  With
    ``retype`` the replacement is written over the pattern's wires and is
    re-instantiated on the host's (see :func:`instantiate`); without, its
    input and output types must already be the host's."""
    host = _as_graph(host_graph)
    p = match.pattern
    r = _as_graph(replacement)
    if len(r.graph["inputs"]) != len(p.inputs) or len(r.graph["outputs"]) != len(p.outputs):
        raise RuleError(f"replacement has {len(r.graph['inputs'])} inputs and "
                        f"{len(r.graph['outputs'])} outputs; pattern {p.name} has "
                        f"{len(p.inputs)} and {len(p.outputs)}")
    in_types = [host.nodes[v]["ob"].type for v in match.inputs]
    out_types = [host.nodes[v]["ob"].type for v in match.outputs]
    if retype:
        r = instantiate(r, in_types, match.axis_binding, match.size_binding, out_types,
                        [host.nodes[v]["ob"].name for v in match.outputs])
    else:
        for i, (v, t) in enumerate(zip(r.graph["inputs"], in_types)):
            if r.nodes[v]["ob"].type != t:
                raise RuleError(f"replacement input {i} is {_typestr(r.nodes[v]['ob'].type)} "
                                f"but the host value is {_typestr(t)}")
        for i, (v, t) in enumerate(zip(r.graph["outputs"], out_types)):
            if r.nodes[v]["ob"].type != t:
                raise RuleError(f"replacement output {i} is {_typestr(r.nodes[v]['ob'].type)} "
                                f"but the host value is {_typestr(t)}")
    return _splice(host, match, r)


def _splice(host: nx.DiGraph, match: Match, r: nx.DiGraph) -> nx.DiGraph:
    new = host.copy()
    new.graph["inputs"] = list(host.graph["inputs"])
    matched = match.ops
    removed_values = {v for o in matched for v in host.nodes[o]["outs"]}
    next_id = max(host.nodes, default=-1) + 1
    env = dict(zip(r.graph["inputs"], match.inputs))
    for o in ops(r):
        node = r.nodes[o]
        outs = []
        for v in node["outs"]:
            new.add_node(next_id, kind="value", ob=r.nodes[v]["ob"])
            env[v] = next_id
            outs.append(next_id)
            next_id += 1
        ins = [env[v] for v in node["ins"]]
        n = next_id
        next_id += 1
        new.add_node(n, kind="op", box=node["box"], ins=ins, outs=outs)
        for v in ins:
            new.add_edge(v, n)
        for v in outs:
            new.add_edge(n, v)
    repoint = {w: env[v] for w, v in zip(match.outputs, r.graph["outputs"])}
    consumers = {c for w in repoint for c in host.successors(w) if c not in matched}
    for c in consumers:
        ins = [repoint.get(v, v) for v in host.nodes[c]["ins"]]
        new.nodes[c]["ins"] = ins
        for v in ins:
            new.add_edge(v, c)
    new.graph["outputs"] = [repoint.get(v, v) for v in host.graph["outputs"]]
    new.remove_nodes_from(matched)
    new.remove_nodes_from(removed_values)
    return new


def rewrite(host, pattern, replacement, *, site: int = 0, **options):
    """Replace one match (the ``site``-th) of ``pattern`` in the diagram ``host``
    by ``replacement`` (written over the pattern's wires) and return the new
    diagram (same dom and cod).  RuleError, with the reason, if there is no
    match.  ``options`` build the Pattern when ``pattern`` is a diagram."""
    p = _pattern(pattern, options)
    g = to_graph(host)
    matches = find_matches(p, g, limit=site + 1)
    if len(matches) <= site:
        why = explain_no_match(p, g) if not matches else f"only {len(matches)} match(es)"
        raise RuleError(f"pattern {p.name} does not apply (site {site}): {why}")
    result = to_diagram(replace(g, matches[site], replacement))
    if result.dom != host.dom or result.cod != host.cod:  # a bug, not a user error
        raise AssertionError("rewrite changed the diagram's dom/cod")
    return result


def rewrite_all(host, pattern, replacement, *, max_steps: int = 1000, **options):
    """Rewrite matches one at a time (re-matching after each) until none is
    left; RuleError after ``max_steps`` (e.g. the replacement contains the
    pattern).  Returns (diagram, number of rewrites)."""
    p = _pattern(pattern, options)
    g = to_graph(host)
    for step in range(max_steps + 1):
        matches = find_matches(p, g, limit=1)
        if not matches:
            return to_diagram(g), step
        if step == max_steps:
            break
        g = replace(g, matches[0], replacement)
    raise RuleError(f"pattern {p.name} still matches after {max_steps} rewrites")
