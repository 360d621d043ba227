"""A networkx view of a diagram, and the way back.

``to_graph`` makes one linear pass over a diagram's boxes: copy, discard and
swap dissolve into wiring, leaving a DiGraph with *value* nodes (one per
array) and *op* nodes (one per box).  ``to_diagram`` emits a diagram from such
a graph in topological order, inserting exactly the copies, discards and swaps
needed.  The tracer (napkin.frontend.trace) and the rewriter both build graphs and use
the same emitter, so there is one way diagrams get made.

Graph conventions
-----------------
* node ``n`` with ``kind == "value"``: attrs ``ob`` (the wire's ArrayOb);
* node with ``kind == "op"``: attrs ``box`` (an Op), ``ins`` / ``outs``
  (lists of value nodes, in port order — a value may feed two ports);
* edges value→op and op→value (for reachability and matching);
* ``graph.graph["inputs"]`` / ``["outputs"]``: value nodes in dom / cod order.
"""
from __future__ import annotations

import itertools
from collections import Counter

import networkx as nx
from discopy import markov

from napkin.core.diagram import BOXES, Copy, Diagram, Discard, Swap, layer, ty
from napkin.core.errors import GraphError
from napkin.core.memo import IdentityMemo


class GraphBuilder:
    """Incrementally build a graph (used by to_graph, the tracer and rewrites)."""

    def __init__(self):
        self.graph = nx.DiGraph(inputs=[], outputs=[])
        self._ids = itertools.count()

    def value(self, ob) -> int:
        n = next(self._ids)
        self.graph.add_node(n, kind="value", ob=ob)
        return n

    def input(self, ob) -> int:
        n = self.value(ob)
        self.graph.graph["inputs"].append(n)
        return n

    def op(self, box, ins: list[int]) -> list[int]:
        n = next(self._ids)
        outs = [self.value(ob) for ob in box.cod.inside]
        self.graph.add_node(n, kind="op", box=box, ins=list(ins), outs=outs)
        for v in ins:
            self.graph.add_edge(v, n)
        for v in outs:
            self.graph.add_edge(n, v)
        return outs

    def finish(self, outputs: list[int]) -> nx.DiGraph:
        self.graph.graph["outputs"] = list(outputs)
        return self.graph


def add_op(graph: nx.DiGraph, box, ins: list) -> list[int]:
    """Add an op node for ``box`` reading the value nodes ``ins`` to a graph (a rewrite's
    own copy: ``to_graph``); returns its output value nodes, fresh."""
    n = max(graph.nodes, default=-1) + 1
    outs = list(range(n + 1, n + 1 + len(box.cod)))
    graph.add_node(n, kind="op", box=box, ins=list(ins), outs=outs)
    for v, ob in zip(outs, box.cod.inside):
        graph.add_node(v, kind="value", ob=ob)
        graph.add_edge(n, v)
    for v in ins:
        graph.add_edge(v, n)
    return outs


def reroute(graph: nx.DiGraph, old: int, new: int, readers) -> None:
    """The op nodes ``readers`` read value ``new`` where they read ``old``."""
    for r in readers:
        graph.remove_edge(old, r)
        graph.add_edge(new, r)
        graph.nodes[r]["ins"] = [new if v == old else v for v in graph.nodes[r]["ins"]]


def to_graph(diagram: markov.Diagram) -> nx.DiGraph:
    b = GraphBuilder()
    wires = [b.input(ob) for ob in diagram.dom.inside]
    for box, offset in zip(diagram.boxes, diagram.offsets):
        n_in = len(box.dom)
        args = wires[offset:offset + n_in]
        if isinstance(box, markov.Swap):
            outs = args[len(box.left):] + args[:len(box.left)]
        elif isinstance(box, markov.Copy):  # Discard is Copy with n = 0
            outs = args * len(box.cod)
        elif isinstance(box, markov.Merge):
            raise GraphError(f"the diagram merges wires {box.dom} into {box.cod}: a merge has "
                             "no meaning on arrays")
        else:
            outs = b.op(box, args)
        wires[offset:offset + n_in] = outs
    return b.finish(wires)


_VIEWS = IdentityMemo(20000)


def view(diagram) -> nx.DiGraph:
    """``to_graph(diagram)``, memoised for read-only use (rules' checks, the
    search): never mutate the result — take ``to_graph`` for a private copy."""
    # frozen: shared, so a mutation would corrupt every reader
    return _VIEWS.get((diagram,), lambda: nx.freeze(to_graph(diagram)))


_COMMON = IdentityMemo(20000)


def common_view(diagram) -> nx.DiGraph:
    """:func:`view` with common subexpressions merged, as a compiler's CSE merges them: a box
    of no body (no group or stream) applied again to the same values — the copies of a
    softmax that recomputation makes for two readers in one loop — is computed once.  What
    a kernel holds and computes (``napkin.schedule``) is read off it; read-only too."""
    def make():
        g = view(diagram)
        b, same, seen = GraphBuilder(), {}, {}
        for v in g.graph["inputs"]:
            same[v] = b.input(g.nodes[v]["ob"])
        for n in ops(g):
            node = g.nodes[n]
            box, args = node["box"], [same[v] for v in node["ins"]]
            spec = getattr(box, "spec", None)
            key = None
            if spec is not None and not getattr(spec, "bodies", ()):
                try:
                    key = (spec, box.cod, tuple(args))
                    hash(key)
                except TypeError:  # a spec holding something unhashable: kept apart
                    key = None
            outs = seen.get(key) if key is not None else None
            if outs is None:
                outs = b.op(box, args)
                if key is not None:
                    seen[key] = outs
            same.update(zip(node["outs"], outs))
        return nx.freeze(b.finish([same[v] for v in g.graph["outputs"]]))
    return _COMMON.get((diagram,), make)


def ops(graph: nx.DiGraph) -> list[int]:
    """Op nodes in a deterministic topological order (memoised on frozen views,
    where rules and the search ask for it again and again)."""
    frozen = nx.is_frozen(graph)  # a copy of a view carries the key but may change
    if frozen and "_op_order" in graph.graph:
        return list(graph.graph["_op_order"])
    order = nx.lexicographical_topological_sort(graph, key=lambda n: n)
    result = [n for n in order if graph.nodes[n]["kind"] == "op"]
    if frozen:
        graph.graph["_op_order"] = tuple(result)
    return result


class Emitter:
    """Emits a diagram layer by layer (one box per layer), tracking the wires.

    Building layers directly avoids DisCoPy's ``@``/``>>`` re-checking every
    composite, which made emission the search's bottleneck."""

    def __init__(self, wires: list[int], ob_of):
        self.wires, self.ob_of, self.layers = list(wires), ob_of, []

    def _obs(self, vals) -> tuple:
        return tuple(self.ob_of(v) for v in vals)

    def ty(self, vals) -> markov.Ty:
        return ty(self._obs(vals))

    def layer(self, i: int, box, n_in: int, outs: list[int]):
        w = self.wires
        self.layers.append(layer(self._obs(w[:i]), box, self._obs(w[i + n_in:])))
        self.wires = w[:i] + outs + w[i + n_in:]

    def wire_to(self, target: list[int]):
        """Copies/discards then adjacent swaps taking the wires to ``target``."""
        need = Counter(target)
        missing = [v for v in need if v not in self.wires]
        if missing:
            raise GraphError(f"cannot emit the graph as a diagram: "
                             f"{', '.join(str(self.ob_of(v)) for v in missing)} is read but no "
                             f"input or earlier op produces it")
        i = 0
        while i < len(self.wires):
            v, k = self.wires[i], need[self.wires[i]]
            if k == 1:
                i += 1
                continue
            ob = self.ob_of(v)
            box = BOXES.get((ob,), lambda: Discard(ty((ob,))) if k == 0 else Copy(ty((ob,)), k), k)
            self.layer(i, box, 1, [v] * k)
            i += k
        for j, v in enumerate(target):  # selection sort by adjacent swaps
            at = next(i for i in range(j, len(self.wires)) if self.wires[i] == v)
            while at > j:
                a, b = self.wires[at - 1], self.wires[at]
                oa, ob = self.ob_of(a), self.ob_of(b)
                swap = BOXES.get((oa, ob), lambda: Swap(ty((oa,)), ty((ob,))), "swap")
                self.layer(at - 1, swap, 2, [b, a])
                at -= 1


def primitive_boxes(diagram):
    """Every primitive box of ``diagram``, group and stream bodies included, in order
    (wiring — copies, swaps, discards — has no spec and is left out)."""
    for box in diagram.boxes:
        spec = getattr(box, "spec", None)
        if spec is None:
            continue
        bodies = getattr(spec, "bodies", None)
        if bodies is None:
            yield box
        for body in bodies or ():
            yield from primitive_boxes(body)


def to_diagram(graph: nx.DiGraph) -> Diagram:
    obs = lambda v: graph.nodes[v]["ob"]  # noqa: E731
    order = ops(graph)
    outputs = graph.graph["outputs"]
    # remaining[v]: uses of v by ops not yet emitted, plus by the outputs.
    remaining = Counter(outputs)
    for n in order:
        remaining.update(graph.nodes[n]["ins"])
    inputs = graph.graph["inputs"]
    if len(set(inputs)) != len(inputs):
        twice = next(v for v in inputs if inputs.count(v) > 1)
        raise GraphError(f"cannot emit the graph as a diagram: input {obs(twice)} is listed twice")
    em = Emitter(inputs, obs)
    for n in order:
        node = graph.nodes[n]
        remaining.subtract(node["ins"])
        live = em.wires
        keep = [v for v in live if remaining[v] > 0]
        # Put the box where its first input already is, so that a chain of
        # boxes over adjacent wires needs no swaps (wire_to names an input not live).
        first = min((live.index(v) for v in node["ins"] if v in live), default=len(live))
        pos = sum(1 for v in keep if live.index(v) < first)
        em.wire_to(keep[:pos] + node["ins"] + keep[pos:])
        em.layer(pos, node["box"], len(node["ins"]), list(node["outs"]))
    em.wire_to(list(outputs))
    return Diagram(tuple(em.layers), em.ty(inputs), em.ty(outputs), _scan=False)


def without_dead_boxes(diagram) -> Diagram:
    """``diagram`` without the boxes no output depends on (a Markov category's discard of
    a deterministic box is the discard of its inputs: the same morphism); the diagram
    itself when every box is live."""
    g = to_graph(diagram)
    live = set().union(*(nx.ancestors(g, v) | {v} for v in g.graph["outputs"])) \
        if g.graph["outputs"] else set()
    dead = [n for n in g.nodes if g.nodes[n]["kind"] == "op" and n not in live]
    if not dead:
        return diagram
    g.remove_nodes_from(dead + [v for n in dead for v in g.nodes[n]["outs"]])
    return to_diagram(g)


def relabel(graph: nx.DiGraph, mapping: dict | None = None) -> nx.DiGraph:
    """Copy of ``graph`` with op/value ids renumbered: by ``mapping``, or else in
    topological order."""
    if mapping is None:
        order = list(nx.lexicographical_topological_sort(graph, key=lambda n: n))
        mapping = {n: i for i, n in enumerate(order)}
    new = nx.relabel_nodes(graph, mapping, copy=True)
    for n, data in new.nodes(data=True):
        if data["kind"] == "op":
            data["ins"] = [mapping[v] for v in data["ins"]]
            data["outs"] = [mapping[v] for v in data["outs"]]
    new.graph["inputs"] = [mapping[v] for v in graph.graph["inputs"]]
    new.graph["outputs"] = [mapping[v] for v in graph.graph["outputs"]]
    return new
