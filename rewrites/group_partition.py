"""Group partition (tiling): map a region over groups of a woven axis.

Matches: a convex region of boxes.  Parameters: ``axis``, group ``size`` (an
int or a symbol such as ``g_q``), memory ``level`` of the groups.
Premises: every box of the region is woven over the axis and acts on each index
independently (no box reduces it, softmaxes over it or streams it) — or computes a
constant along the axis (no value it touches carries it, and its inputs are broadcast
inputs or such constants: positions along another axis, a prologue on broadcast inputs;
the same in every group, replayed in each); every region
output carries the axis; some input carries it.  Inputs without the axis
are broadcast: re-sent to every group (this is where transfer cost comes from).
Replacement: one :class:`~napkin.core.streamed.Group` box whose body is the region
with the axis relabelled to the group size.
Proof: proofs/group_partition.py.
"""
from __future__ import annotations

from discopy import markov

from napkin.core.errors import RuleError
from napkin.hardware import CANONICAL_LEVELS
from napkin.core.ir import ops as op_order, to_diagram, view
from napkin.core.memo import IdentityMemo
from napkin.core.op import make_op
from napkin.core.region import Site, body_at, region, region_diagram, replace_at, splice
from napkin.core.streamed import Group
from rewrites import tiles
from rewrites.base import Rule, replacement

_MIXING = IdentityMemo()


def mixing_reason(box, axis: str) -> str | None:
    """Why ``box`` is not independent along ``axis`` (None when it is).  Memoised:
    boxes are immutable and the search asks about the same boxes in every state."""
    return _MIXING.get((box,), lambda: _mixing_reason(box, axis), axis)


def _mixing_reason(box, axis: str) -> str | None:
    spec = box.spec
    ins = [ob.type for ob in box.dom.inside]
    outs = [ob.type for ob in box.cod.inside]
    if any(t.has(axis) for t in ins) and not any(t.has(axis) for t in outs):
        return f"{box.name} reduces axis {axis}"
    if any(t.has(axis) for t in outs) and not all(t.has(axis) for t in outs):
        return f"{box.name} has an output without axis {axis}"
    if getattr(spec, "axis", None) == axis and spec.kind in ("softmax", "reduce", "stream"):
        return f"{box.name} mixes entries along axis {axis}"
    for inner in getattr(spec, "bodies", ()):
        for b in inner.boxes:
            if hasattr(getattr(b, "spec", None), "kind"):
                why = mixing_reason(b, axis)
                if why:
                    return f"{box.name} contains {why}"
    return None


def constants(graph, nodes, axis: str) -> set:
    """The boxes of ``nodes`` that compute constants along ``axis``: no value they touch
    carries the axis, and their inputs come from such boxes among ``nodes`` or from outside
    ``nodes`` (a box with no inputs — positions along another axis —, a prologue on the
    broadcast inputs — a LayerNorm's x − μ before a matmul grouped over its output
    columns —, and what is computed from those alone).  A group replays them in every
    piece: they are the same in each (the work is counted once per piece)."""
    pool, out = set(nodes), set()
    for n in nodes:  # topological order
        node = graph.nodes[n]
        if any(graph.nodes[v]["ob"].type.has(axis) for v in (*node["ins"], *node["outs"])):
            continue
        if all((m := next(iter(graph.predecessors(v)), None)) in out or m not in pool
               for v in node["ins"]):
            out.add(n)
    return out


def _reduces(graph, n) -> bool:
    """Whether op ``n`` reduces an axis (one of its inputs has an axis no output has)."""
    outs = {a for v in graph.nodes[n]["outs"] for a in graph.nodes[v]["ob"].type.names}
    return any(a not in outs for v in graph.nodes[n]["ins"]
               for a in graph.nodes[v]["ob"].type.names)


def nested_groups(box):
    """Every group spec in ``box`` (itself included) or anywhere inside it."""
    spec = box.spec
    if spec.kind == "group":
        yield spec
    for d in getattr(spec, "bodies", ()):
        for b in d.boxes:
            if hasattr(getattr(b, "spec", None), "kind"):
                yield from nested_groups(b)


def nesting_reason(boxes, axis: str, level: str) -> str | None:
    """Why a group over ``axis`` at ``level`` cannot hold ``boxes`` (None when it can):
    nesting goes down the hierarchy, and re-tiling an axis needs a higher level."""
    depth = CANONICAL_LEVELS.index
    for box in boxes:
        for inner in nested_groups(box):
            if depth(inner.level) < depth(level):
                return (f"{box.name} holds a group over {inner.axis} at {inner.level}, above "
                        f"{level} (groups nest down the memory hierarchy)")
            if inner.axis == axis and depth(level) >= depth(inner.level):
                return (f"{box.name} already groups {axis} at {inner.level} "
                        f"(regroup only at a higher level)")
    return None


class GroupPartition(Rule):
    name = "group_partition"
    params = ("axis", "size", "level")
    summary = "tile a woven axis: run the region once per group of g entries at a lower level"
    proof = "proofs.group_partition"
    groups_axis = True
    tiles_inside_kernels = True

    def _region(self, program, site, params):
        axis = params.get("axis")
        if not isinstance(axis, str):
            raise RuleError("group_partition needs a parameter axis (an axis name)")
        level = params.get("level", "smem")
        if level not in CANONICAL_LEVELS:
            raise RuleError(f"group_partition: unknown level {level!r}; "
                            f"known: {', '.join(CANONICAL_LEVELS)}")
        body = body_at(program, site.path)
        graph = view(body)
        reg = region(graph, site.ops)
        why = nesting_reason(reg.boxes(), axis, level)
        if why:
            raise RuleError(f"cannot group {axis} at {level}: {why}")
        fixed = constants(graph, reg.nodes, axis)
        for n in reg.nodes:
            box = graph.nodes[n]["box"]
            if not any(ob.type.has(axis) for ob in box.cod.inside) and n not in fixed:
                raise RuleError(f"cannot group {axis}: {box.name} is not woven over {axis} "
                                f"(its outputs {box.cod} lack the axis)")
            why = mixing_reason(box, axis)
            if why:
                raise RuleError(f"cannot group {axis}: {why}")
        for v in reg.outputs:
            if not graph.nodes[v]["ob"].type.has(axis):
                raise RuleError(f"cannot group {axis}: region output {graph.nodes[v]['ob']} lacks it")
        if not any(graph.nodes[v]["ob"].type.has(axis) for v in reg.inputs):
            raise RuleError(f"cannot group {axis}: no input of the region carries it")
        # a regroup at a higher level needs a tile of its own: g_<axis>_<level>
        regroup = any(g.axis == axis for box in reg.boxes() for g in nested_groups(box))
        size = tiles.choose(program, site.path, reg.boxes(), params.get("size"), "group", axis,
                            f"g_{axis}_{level}" if regroup else f"g_{axis}",
                            f"cannot group {axis}")
        return body, graph, reg, axis, level, size

    def check(self, program, site, params):
        self._region(program, site, params)

    def apply(self, program, site, params):
        body, graph, reg, axis, level, size = self._region(program, site, params)

        def make():
            inner = region_diagram(reg, axis, size)
            dom = markov.Ty(*(graph.nodes[v]["ob"] for v in reg.inputs))
            names = [graph.nodes[v]["ob"].name for v in reg.outputs]
            return make_op(Group(axis, size, inner, level), dom, names, f"group {axis}")
        box = replacement(self.name, (axis, size, level), reg, make)
        return replace_at(program, site.path, to_diagram(splice(reg, box)))

    def candidates(self, program, path=()):
        """Per axis some input carries: all boxes woven over it, then each connected
        piece of them (a stack of layers groups layer by layer); premises unchecked."""
        import networkx as nx
        body = body_at(program, path)
        graph = view(body)
        order = op_order(graph)
        index = {n: i for i, n in enumerate(order)}
        axes = dict.fromkeys(a for v in graph.graph["inputs"] for a in graph.nodes[v]["ob"].type.names)
        for axis in axes:
            ok = [n for n in order
                  if any(o.type.has(axis) for o in graph.nodes[n]["box"].cod.inside)
                  and mixing_reason(graph.nodes[n]["box"], axis) is None]
            if not ok:
                continue
            # constants along the axis (positions along another axis, a prologue on broadcast
            # inputs, and what is computed from them alone) read only inside are replayed in
            # every group, not broadcast: all of them, and the elementwise ones only (a
            # prologue replayed per group; what reduces stays a kernel of its own)
            fixed, outputs = constants(graph, order, axis), set(graph.graph["outputs"])
            sites = []
            for cheap in (False, True):
                chosen = set(ok)
                for m in reversed(order):
                    users = [u for v in graph.nodes[m]["outs"] for u in graph.successors(v)]
                    if m in fixed and m not in chosen and users \
                            and all(u in chosen for u in users) \
                            and not outputs & set(graph.nodes[m]["outs"]) \
                            and (not cheap or graph.nodes[m]["box"].spec.elementwise
                                 or not graph.nodes[m]["ins"]):
                        chosen.add(m)
                site = tuple(index[n] for n in order if n in chosen)
                if site not in sites:
                    sites.append(site)
                    yield Site(tuple(path), site), {"axis": axis}
            ok = [m for m in order if m in set(ok) | {order[i] for i in sites[0]}]
            links = nx.Graph()
            links.add_nodes_from(ok)
            for n in ok:
                for v in graph.nodes[n]["outs"]:
                    links.add_edges_from((n, m) for m in graph.successors(v) if m in links)
            pieces = list(nx.connected_components(links))
            if len(pieces) > 1:
                for piece in sorted(pieces, key=lambda c: min(index[n] for n in c)):
                    yield Site(tuple(path), tuple(sorted(index[n] for n in piece))), {"axis": axis}
            # a kernel's grid grows by this axis on its own, and what is left of the region
            # becomes a kernel beside it (a LayerNorm's statistics beside the matmul they
            # feed): one site per group or stream already made that reads a reduction the
            # body computes (statistics of another pass), and the pieces left
            for m in ok:
                if graph.nodes[m]["box"].spec.kind not in ("group", "stream") or len(ok) == 1 \
                        or not any(_reduces(graph, u) for v in graph.nodes[m]["ins"]
                                   for u in graph.predecessors(v)):
                    continue
                yield Site(tuple(path), (index[m],)), {"axis": axis}
                rest = links.subgraph([n for n in ok if n != m])
                for piece in sorted(nx.connected_components(rest),
                                    key=lambda c: min(index[n] for n in c)):
                    yield Site(tuple(path), tuple(sorted(index[n] for n in piece))), {"axis": axis}
