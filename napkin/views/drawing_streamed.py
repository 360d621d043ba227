"""Pictures of streamed programs, drawn as the paper draws them.

A streamed program is a diagram whose group and stream boxes hold diagrams of their own.
:func:`draw_streamed` opens them up: the bodies are inlined into one picture, and

* every **group** becomes a frame labelled with its axis, tile and level
  (``group q: g_q rows per SM @smem``), the wires crossing its edge marked ▼ (loaded) and
  ▲ (stored) and relabelled from the axis to the tile (``Q[q,d]`` outside, ``Q[g_q,d]``
  inside);
* every **stream** becomes a frame holding its accumulator's three parts, each framed:
  ``init`` (the state's starting value), ``update — each chunk s_x of x`` (the chunks enter
  relabelled ``K[s_x,d]``; the state wires ``mu``, ``z``, ``o`` run through it) and
  ``finalize``;
* every **wire is coloured by the memory level** its array sits in (GMEM, L2, SMEM,
  registers; legend in the corner), and labelled with its array and its axes' sizes.

The function never changes (paper: "resources by relabelling"): only where arrays live and
how big the pieces are.  Layout is DisCoPy's (one flattened diagram, layers merged where the
boxes belong to the same frame); painting reuses :mod:`napkin.views.drawing`'s backend.

    draw_streamed(program, "fa.png", hardware="h100", tiles={"g_q": 128, "s_x": 64})
    draw_before_after(get("attention").diagram(), program, "fa_side.png")
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from discopy import cat, markov  # noqa: E402
from discopy.utils import AxiomError  # noqa: E402
from matplotlib.patches import (FancyArrowPatch, FancyBboxPatch, PathPatch,  # noqa: E402
                                Rectangle)
from matplotlib.path import Path as MPath  # noqa: E402

from napkin.views import drawing as _d  # noqa: E402
from napkin.core.diagram import Box  # noqa: E402
from napkin.hardware import CANONICAL_LEVELS, resolve_level  # noqa: E402
from napkin.core.ir import GraphBuilder, ops as op_order, to_graph  # noqa: E402

__all__ = ["LEVEL_COLORS", "draw_before_after", "draw_streamed", "flatten"]

LEVEL_COLORS = {
    "gmem": "#1f4e9a",       # blue
    "l2": "#7b3fa0",         # purple
    "smem": "#1e8a3c",       # green
    "registers": "#d2691e",  # orange
}
FRAME_FILL = {"gmem": "#eef3fb", "l2": "#f4eefa", "smem": "#edf8f0", "registers": "#fdf1e6"}
SECTION_FILL = {"init": "#fafafa", "update": "#fffbe6", "finalize": "#fafafa"}
LOOP_COLOR = "#b8860b"   # the update's state carried to the next chunk
WIRING_HEIGHT = 0.55     # layout units of a layer of copies/swaps (a box layer is 1)
MARKER_HEIGHT = 0.7


def _level_color(level: str) -> str:
    return LEVEL_COLORS.get(level, "#555555")


# ----------------------------------------------------------------------------- flattening
class WireOb(cat.Ob):
    """A wire of the flattened picture: its label (array and axis sizes) and memory level.

    Equality is by identity of label *and* level, so two wires never compose by accident
    across levels in the picture (the picture is only drawn, never evaluated)."""

    def __init__(self, label: str, level: str):
        super().__init__(label)
        self.level = level

    def __eq__(self, other):
        return isinstance(other, WireOb) and (self.name, self.level) == (other.name, other.level)

    def __hash__(self):
        return hash((self.name, self.level))

    def __str__(self):
        return self.name


@dataclass(frozen=True)
class Tag:
    """What a picture box is: an op (``kind`` of its primitive), or a boundary marker."""
    kind: str                 # primitive kind, or "load" / "store" / "chunk"
    level: str
    frames: tuple             # ids of the frames it sits in, outermost first
    edge: int | None = None   # for markers: the frame whose edge it marks


@dataclass
class Frame:
    id: int
    kind: str                 # "group" | "stream" | "init" | "update" | "finalize"
    label: str
    level: str
    parent: int | None
    depth: int
    state: tuple = ()         # an update's state wires (carried to the next chunk)


def _size_text(s) -> str:
    return str(s)


def _label(name: str, t, tiles=None) -> str:
    sizes = []
    for a in t.axes:
        s = _size_text(a.size)
        if tiles and s in tiles:
            s = f"{s}={tiles[s]}"
        sizes.append(s)
    return f"{name}[{','.join(sizes)}]"


class _Flattener:
    def __init__(self, hardware=None, tiles=None):
        self.b = GraphBuilder()
        self.frames: list[Frame] = []
        self.tiles = {str(k): v for k, v in dict(tiles or {}).items()}
        self.hw = hardware
        self.level_names = (tuple(lv.name for lv in hardware.levels) if hardware
                            else CANONICAL_LEVELS)

    def level_of(self, name: str) -> str:
        if name not in self.level_names and name not in CANONICAL_LEVELS:
            return name  # a level of its own: drawn as named
        return self.level_names[resolve_level(self.level_names, name)]

    def ob(self, src_ob, level):
        return WireOb(_label(src_ob.name, src_ob.type, self.tiles), level)

    def frame(self, kind, label, level, parent, state=()):
        depth = 0 if parent is None else self.frames[parent].depth + 1
        f = Frame(len(self.frames), kind, label, level, parent, depth, tuple(state))
        self.frames.append(f)
        return f.id

    def anchor(self, fid, frames):
        """An invisible 0 → 0 box: a layer of room for frame ``fid``'s title."""
        self.op("", "anchor", self.frames[fid].level, frames, [], [], edge=fid, spider=True)

    def op(self, name, kind, level, frames, ins, outs_obs, edge=None, spider=False):
        params = {}
        if spider:
            params = dict(draw_as_spider=True, drawing_name="")
        dom = markov.Ty(*(self.b.graph.nodes[v]["ob"] for v in ins))
        cod = markov.Ty(*outs_obs)
        box = Box(name, dom, cod, data=Tag(kind, level, tuple(frames), edge), **params)
        return self.b.op(box, list(ins))

    def marker(self, kind, v, new_ob, level, frames, edge):
        """A ▼/▲ marker on a frame's edge: the wire changes level or is cut into tiles."""
        return self.op("", kind, level, frames, [v], [new_ob], edge=edge, spider=True)[0]

    # -- the walk ------------------------------------------------------------------------
    def diagram(self, D, ins, level, frames):
        """Inline diagram ``D`` (inputs already in the graph as ``ins``); returns outputs."""
        g = to_graph(D)
        val = dict(zip(g.graph["inputs"], ins))
        for n in op_order(g):
            node = g.nodes[n]
            box, spec = node["box"], node["box"].spec
            args = [val[v] for v in node["ins"]]
            if spec.kind == "group":
                outs = self.group(box, spec, args, level, frames)
            elif spec.kind == "stream":
                outs = self.stream(box, spec, args, level, frames)
            else:
                outs = self.op(box.name, spec.kind, level, frames, args,
                               [self.ob(g.nodes[v]["ob"], level) for v in node["outs"]])
            val.update(zip(node["outs"], outs))
        return [val[v] for v in g.graph["outputs"]]

    def group(self, box, spec, args, level, frames):
        inner = max(self.level_of(spec.level), level, key=self._rank)
        size = _size_text(spec.size)
        shown = f"{size}={self.tiles[size]}" if size in self.tiles else size
        full = next(ob.type.axis(spec.axis).size for ob in box.dom.inside if ob.type.has(spec.axis))
        where = {"smem": "per SM", "registers": "per warpgroup", "l2": "per L2 pass"}.get(
            inner, f"per {inner}")
        fid = self.frame("group", f"group {spec.axis}: {shown} of {full} {where}, "
                         f"{full}/{size} groups @{inner}", inner,
                         frames[-1] if frames else None)
        fr = (*frames, fid)
        body_in = []
        for v, ob in zip(args, spec.body.dom.inside):
            body_in.append(self.marker("load", v, self.ob(ob, inner), inner, frames, fid))
        self.anchor(fid, fr)
        outs = self.diagram(spec.body, body_in, inner, fr)
        res = []
        for v, ob in zip(outs, box.cod.inside):
            res.append(self.marker("store", v, self.ob(ob, level), level, frames, fid))
        return res

    def _rank(self, lv):
        return self.level_names.index(lv) if lv in self.level_names else len(self.level_names)

    def stream(self, box, spec, args, level, frames):
        axis = spec.axis
        chunk = _size_text(spec.chunk)
        shown = f"{chunk}={self.tiles[chunk]}" if chunk in self.tiles else chunk
        fid = self.frame("stream", f"stream {axis} [{spec.rule}]", level,
                         frames[-1] if frames else None)
        fr = (*frames, fid)
        self.anchor(fid, fr)
        n = spec.n_state
        ins = list(box.dom.inside)
        # init: () -> state
        f_init = self.frame("init", "init", level, fid)
        self.anchor(f_init, (*fr, f_init))
        state = self.diagram(spec.init, [], level, (*fr, f_init))
        # update: state @ chunks -> state, once per chunk
        f_up = self.frame("update", f"update: each chunk {shown} of {axis}", level, fid,
                          [ob.name for ob in list(spec.update.dom.inside)[:n]])
        up_in = list(state)
        for v, ob, dob in zip(args, ins, list(spec.update.dom.inside)[n:]):
            if ob.type.has(axis):
                up_in.append(self.marker("chunk", v, self.ob(dob, level), level, fr, f_up))
            else:
                up_in.append(v)
        self.anchor(f_up, (*fr, f_up))
        state = self.diagram(spec.update, up_in, level, (*fr, f_up))
        # finalize: state @ fixed inputs -> outputs (inputs it ignores are not drawn)
        f_fin = self.frame("finalize", "finalize", level, fid)
        self.anchor(f_fin, (*fr, f_fin))
        fixed = [v for v, ob in zip(args, ins) if not ob.type.has(axis)]
        fin_in = list(state) + fixed
        return self.diagram(spec.finalize, fin_in, level, (*fr, f_fin))


def flatten(program, hardware=None, tiles=None):
    """(picture diagram, frames): the program with every group and stream body inlined."""
    from napkin.hardware import get_hardware
    hw = get_hardware(hardware) if hardware is not None else None
    fl = _Flattener(hw, tiles)
    top = fl.level_names[0]
    ins = [fl.b.input(fl.ob(ob, top)) for ob in program.dom.inside]
    outs = fl.diagram(program, ins, top, ())
    graph = fl.b.finish(outs)
    D = _emit(graph)
    for box in D.boxes:
        if _tag(box) is None:   # copies and swaps: half-height layers
            box.height = WIRING_HEIGHT
        elif _tag(box).kind in ("load", "store", "chunk", "anchor"):
            box.height = MARKER_HEIGHT
    return _merge_layers(D), fl.frames


def _emit(graph):
    """napkin.core.ir.to_diagram with a layout-minded placement: a box goes at the median of its
    inputs' positions (fewer swaps than at its first input) and a box without inputs (the
    accumulator's init) at the left, next to the wires that will read its state."""
    from collections import Counter

    from napkin.core.diagram import Diagram
    from napkin.core.ir import Emitter
    obs = lambda v: graph.nodes[v]["ob"]  # noqa: E731
    order = _close_order(graph, op_order(graph))
    outputs = graph.graph["outputs"]
    remaining = Counter(outputs)
    for n in order:
        remaining.update(graph.nodes[n]["ins"])
    em = Emitter(graph.graph["inputs"], obs)
    placed_left = Counter()   # frame -> wires already put at the left by input-less boxes
    for n in order:
        node = graph.nodes[n]
        remaining.subtract(node["ins"])
        live = em.wires
        keep = [v for v in live if remaining[v] > 0]
        if node["ins"]:
            idx = sorted(live.index(v) for v in node["ins"])
            first = idx[(len(idx) - 1) // 2]
            pos = sum(1 for v in keep if live.index(v) < first)
        else:
            t = _tag(node["box"])
            if t is not None and t.kind == "anchor":
                pos = len(keep)
            else:
                key = t.frames if t is not None else ()
                pos = min(placed_left[key], len(keep))
                placed_left[key] += len(node["outs"])
        em.wire_to(keep[:pos] + node["ins"] + keep[pos:])
        em.layer(pos, node["box"], len(node["ins"]), list(node["outs"]))
    em.wire_to(list(outputs))
    return Diagram(tuple(em.layers), em.ty(graph.graph["inputs"]), em.ty(outputs), _scan=False)


def _close_order(graph, order):
    """``order`` rescheduled so that an op follows what it reads as closely as it can (the
    ready op reading the latest-made wire first, one reading nothing — an init — before
    all): short-lived wires, fewer crossings.  Ops
    stay within their frame's section: the order is cut at every anchor (a frame's title) and
    each cut scheduled on its own (the ops of a cut read only earlier cuts and themselves)."""
    made_at: dict = {v: -1 for v in graph.graph["inputs"]}
    cuts, cut = [], []
    for n in order:
        t = _tag(graph.nodes[n]["box"])
        if t is not None and t.kind == "anchor":
            cuts += [cut, [n]]
            cut = []
        else:
            cut.append(n)
    cuts.append(cut)
    out = []
    for cut in cuts:
        left = list(cut)
        while left:
            ready = [n for n in left if all(v in made_at for v in graph.nodes[n]["ins"])]
            best = max(ready, key=lambda n: (max((made_at[v] for v in graph.nodes[n]["ins"]),
                                                 default=len(out)), -left.index(n)))
            left.remove(best)
            for v in graph.nodes[best]["outs"]:
                made_at[v] = len(out)
            out.append(best)
    return out


def _tag(box):
    return box.data if isinstance(getattr(box, "data", None), Tag) else None


def _merge_layers(D):
    """Put adjacent independent boxes side by side (one eager pass, like DisCoPy's
    ``foliation`` but linear): boxes of one frame with each other, markers of one frame edge
    with each other, and wiring (copies, swaps) with anything."""
    layers = list(D.inside)
    if not layers:
        return D
    out = [layers[0]]
    key = [_layer_key(layers[0])]
    for lay in layers[1:]:
        k = _layer_key(lay)
        joint = _join(key[-1], k)
        if joint is not False:
            try:
                out[-1] = out[-1].merge(lay)
                key[-1] = joint
                continue
            except AxiomError:
                pass
        out.append(lay)
        key.append(k)
    return D.factory(tuple(out), D.dom, D.cod, _scan=False)


_WIRING = "wiring"


def _layer_key(layer):
    tags = set()
    for box in layer.boxes_or_types[1::2]:
        t = _tag(box)
        if t is None:
            continue  # copies and swaps fit anywhere
        tags.add((t.frames, t.edge,
                  t.kind if t.kind in ("load", "store", "chunk", "anchor") else "op"))
    if not tags:
        return _WIRING
    return tags.pop() if len(tags) == 1 else None


def _join(a, b):
    """The key of two merged layers, or False when they must stay apart."""
    if a is None or b is None:
        return False
    if a == _WIRING:
        return b
    if b == _WIRING:
        return a
    return a if a == b else False


# ----------------------------------------------------------------------------- painting
LABEL_H = 0.34        # layout units a frame's title takes above its content
PAD_X, PAD_Y = 0.22, 0.14


def _orig_ob(D, node):
    """The picture's own wire object (with its level) behind a drawing node."""
    try:
        if node.kind == "dom":
            return D.dom.inside[node.i]
        if node.kind == "cod":
            return D.cod.inside[node.i]
        if node.kind == "box_dom":
            return D.boxes[node.j].dom.inside[node.i]
        if node.kind == "box_cod":
            return D.boxes[node.j].cod.inside[node.i]
    except (AttributeError, IndexError):
        return None
    return None


class _StreamLayout(_d._Layout):
    def __init__(self, diagram, frames):
        super().__init__(diagram)
        self.frames = frames
        self.frame_rects = {}
        self._frame_geometry(diagram)

    def _frame_geometry(self, diagram):
        pos = self.drawing.positions
        centres = {getattr(n, "j", None): pos[n] for n in pos if n.kind == "box"}
        members: dict = {f.id: [] for f in self.frames}
        self.anchors = {}
        for j, orig in enumerate(diagram.boxes):
            t = _tag(orig)
            if t is None:
                continue
            if t.kind == "anchor":
                if j in centres:
                    self.anchors[t.edge] = centres[j].y
                continue
            if j in self.rects:
                _, x0, x1, y0, y1, _, _ = self.rects[j]
                pts = [(x0, min(y0, y1)), (x1, max(y0, y1))]
            elif j in centres:
                p = centres[j]
                pts = [(p.x, p.y)]
            else:
                continue
            for fid in t.frames:
                members[fid].extend(pts)
            if t.edge is not None:
                members[t.edge].extend(pts)
        self.frame_rects = {}
        for f in sorted(self.frames, key=lambda f: -f.depth):  # children first
            pts = list(members[f.id])
            tops = [p[1] for p in pts]
            bottoms = [p[1] for p in pts]
            xs = [p[0] for p in pts]
            for c in self.frames:
                if c.parent == f.id and c.id in self.frame_rects:
                    x0, x1, y0, y1 = self.frame_rects[c.id]
                    xs += [x0 - PAD_X * 0.6, x1 + PAD_X * 0.6]
                    tops.append(y1 + 0.06)
                    bottoms.append(y0 - 0.06)
            if not xs:
                continue
            top = max(tops) + PAD_Y
            if f.id in self.anchors:
                top = max(top, self.anchors[f.id] + LABEL_H * 0.7)
            self.frame_rects[f.id] = (min(xs) - PAD_X, max(xs) + PAD_X,
                                      min(bottoms) - PAD_Y, top)
        for (x0, x1, y0, y1) in self.frame_rects.values():
            lo, hi = self.xlim
            self.xlim = (min(lo, x0 - 0.1), max(hi, x1 + 0.1))
            lo, hi = self.ylim
            self.ylim = (min(lo, y0 - 0.1), max(hi, y1 + 0.15))


class _StreamBackend(_d._Backend):
    def _color(self, node):
        ob = _orig_ob(self.layout.diagram, node)
        return _level_color(ob.level) if isinstance(ob, WireOb) else _d.WIRE_COLOR

    def _labelled(self, node) -> bool:
        """Label a wire where a box makes it, not again after every copy or swap."""
        D = self.layout.diagram
        j = getattr(node, "j", None)
        return j is not None and j < len(D.boxes) and _tag(D.boxes[j]) is not None

    def draw_wire_label(self, x, i, j, node=None, **params):
        color = self._color(node) if node is not None else _d.WIRE_COLOR
        ob = x.inside[0]
        if hasattr(ob, "reposition_label"):
            j += 0.25
        self.axis.text(i + _d.TEXTPAD[0], j - _d.TEXTPAD[1], _d.pretty(ob),
                       fontsize=_d.WIRE_FONT, color=color, ha="left", va="top", zorder=6)

    def draw_wires(self, graph, **params):
        def inside_a_box(node):
            return node.kind == "box" and not node.box.draw_as_wires \
                and not node.box.draw_as_spider
        for source, target in graph.edges():
            if inside_a_box(source) or inside_a_box(target):
                continue
            sp, tp = graph.positions[source], graph.positions[target]
            wire_node = source if source.kind != "box" else target
            color = self._color(wire_node)
            if source.kind == "dom" or (source.kind == "box_cod" and self._labelled(source)):
                self.draw_wire_label(source.x, *sp, node=source)
            if sp == tp:
                continue
            bend_out = source.kind == "box"
            mid = (tp[0], sp[1]) if bend_out else (sp[0], tp[1])
            path = MPath([tuple(sp), mid, tuple(tp)], [MPath.MOVETO, MPath.CURVE3, MPath.CURVE3])
            self.axis.add_patch(PathPatch(path, facecolor="none", edgecolor=color,
                                          linewidth=1.5, zorder=1.5))

    def draw_spiders(self, graph, draw_box_labels=True, **params):
        D = self.layout.diagram
        for node, p in graph.positions.items():
            if node.kind != "box" or not node.box.draw_as_spider:
                continue
            j = getattr(node, "j", None)
            t = _tag(D.boxes[j]) if j is not None and j < len(D.boxes) else None
            if t is not None and t.kind == "anchor":
                continue
            if t is not None and t.kind in ("load", "store", "chunk"):
                marker = "v" if t.kind in ("load", "chunk") else "^"
                self.axis.scatter([p.x], [p.y], s=52, marker=marker, c=_level_color(t.level),
                                  zorder=7, linewidths=0.6, edgecolors="white")
            else:
                self.axis.scatter([p.x], [p.y], s=_d.DOT_AREA, c="black", zorder=4,
                                  linewidths=0)


def _paint_frames(layout: _StreamLayout, ax):
    for f in sorted(layout.frames, key=lambda f: f.depth):
        if f.id not in layout.frame_rects:
            continue
        x0, x1, y0, y1 = layout.frame_rects[f.id]
        if f.kind in ("group", "stream"):
            edge = _level_color(f.level) if f.kind == "group" else "#555555"
            fill = FRAME_FILL.get(f.level, "#f5f5f5") if f.kind == "group" else "none"
            ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0,
                                        boxstyle="round,pad=0,rounding_size=0.12",
                                        facecolor=fill, edgecolor=edge,
                                        linewidth=1.6 if f.kind == "group" else 1.2,
                                        linestyle="-" if f.kind == "group" else (0, (5, 3)),
                                        zorder=0.2 + 0.1 * f.depth))
            weight = "bold" if f.kind == "group" else "normal"
            ty, va = (layout.anchors[f.id], "center") if f.id in layout.anchors else \
                (y1 - 0.05, "top")
            ax.text(x0 + 0.1, ty, f.label, ha="left", va=va, fontsize=9.5,
                    color=edge, fontweight=weight, zorder=8,
                    bbox=dict(facecolor="white", alpha=0.8, edgecolor="none", pad=1.0))
        else:
            ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0,
                                   facecolor=SECTION_FILL.get(f.kind, "#fafafa"),
                                   edgecolor="#9a9a9a", linewidth=0.8, linestyle=":",
                                   zorder=0.2 + 0.1 * f.depth))
            ty, va = (layout.anchors[f.id], "center") if f.id in layout.anchors else \
                (y1 - 0.05, "top")
            ax.text(x0 + 0.08, ty, f.label, ha="left", va=va, fontsize=8.5,
                    color="#555555", style="italic", zorder=8,
                    bbox=dict(facecolor="white", alpha=0.7, edgecolor="none", pad=0.8))
            if f.state:
                _paint_loop_back(ax, f, (x0, x1, y0, y1), ty)


def _paint_loop_back(ax, f, rect, title_y):
    """An update's state loops back: what leaves it at the bottom is what enters it at the
    top for the next chunk — an arrow up its left edge, named by the state's wires."""
    x0, _, y0, y1 = rect
    top = min(title_y - LABEL_H * 0.6, y1 - 0.2)
    if top - y0 < 0.6:
        return
    x = x0 + 0.07
    ax.add_patch(FancyArrowPatch((x, y0 + 0.08), (x, top), arrowstyle="-|>", mutation_scale=9,
                                 color=LOOP_COLOR, linewidth=1.1, linestyle=(0, (4, 2)),
                                 zorder=7))
    ax.text(x + 0.05, (y0 + top) / 2, f"state {', '.join(f.state)}: carried to the next chunk",
            rotation=90, ha="left", va="center", fontsize=7.5, color=LOOP_COLOR, zorder=8,
            bbox=dict(facecolor="white", alpha=0.75, edgecolor="none", pad=0.6))


def _paint_streamed(layout: _StreamLayout, ax, levels, ylim=None):
    _paint_frames(layout, ax)
    _d._paint(layout, ax, ylim, backend=_StreamBackend)


def _levels_used(frames, top) -> list:
    seen = [top]
    for f in frames:
        if f.level not in seen:
            seen.append(f.level)
    return seen


LEGEND_SPACE = 1.9   # inches at the right for the legend


def draw_streamed(program, path, hardware=None, tiles=None, *, title: str | None = None,
                  figsize=None) -> Path:
    """Draw a streamed program with its groups and streams opened up as nested frames.

    ``hardware`` (a profile or name) maps group levels onto its hierarchy (default: the
    canonical gmem / l2 / smem / registers); ``tiles`` ({"g_q": 128, ...}) adds the tile
    values to the labels (``Q[g_q=128,d]``).  PNG or SVG by suffix; returns the path.
    """
    path = _d._check_path(path)
    D, frames = flatten(program, hardware, tiles)
    layout = _StreamLayout(D, frames)
    if title:
        layout.widen_to(_d._text_width(title, _d.TITLE_FONT) + 0.1)
    w, h = layout.size
    fig, (l, b, r, t) = _d._figure((w + LEGEND_SPACE, h), bool(title), figsize)
    fw = fig.get_size_inches()[0]
    right = r - LEGEND_SPACE / fw if figsize is None else r - 0.1
    ax = fig.add_axes((l, b, right - l, t - b))
    top = flatten_levels(hardware)[0]
    _paint_streamed(layout, ax, _levels_used(frames, top))
    leg = fig.add_axes((right, b, r - right, t - b))
    leg.axis("off")
    leg.set_xlim(0, 1)
    leg.set_ylim(0, 1)
    _legend_fig(leg, _levels_used(frames, top))
    if title:
        ax.set_title(title, fontsize=_d.TITLE_FONT, pad=10)
    return _d._save(fig, path)


def flatten_levels(hardware) -> tuple:
    if hardware is None:
        return CANONICAL_LEVELS
    from napkin.hardware import get_hardware
    return tuple(lv.name for lv in get_hardware(hardware).levels)


def _legend_fig(ax, levels):
    """Level colours and markers, at a fixed size in inches whatever the figure height."""
    fig = ax.figure
    h_in = ax.get_position().height * fig.get_size_inches()[1]
    step = 0.24 / max(h_in, 0.5)
    y = 0.995
    ax.text(0.05, y, "memory level", fontsize=8.5, va="top", color="#333333")
    y -= step * 1.3
    for lv in levels:
        ax.plot([0.05, 0.3], [y, y], color=_level_color(lv), linewidth=2.2)
        ax.text(0.36, y, lv, va="center", fontsize=8.5, color=_level_color(lv))
        y -= step
    y -= step * 0.4
    for marker, what in (("v", "load / cut into chunks"), ("^", "store")):
        ax.scatter([0.17], [y], marker=marker, s=40, c="#555555")
        ax.text(0.36, y, what, va="center", fontsize=8)
        y -= step


def draw_before_after(algorithm, program, path, *, hardware=None, tiles=None,
                      titles=("algorithm", "streamed program"), figsize=None) -> Path:
    """The algorithm (a plain diagram) next to its streamed program, frames opened up."""
    path = _d._check_path(path)
    D, frames = flatten(program, hardware, tiles)
    left = _d._Layout(algorithm)
    right = _StreamLayout(D, frames)
    x_scale = max(left.x_scale, right.x_scale)
    for lo, ttl in ((left, titles[0]), (right, titles[1])):
        lo.set_scale(x_scale)
        if isinstance(lo, _StreamLayout):
            lo._frame_geometry(D)
        if ttl:
            lo.widen_to(_d._text_width(ttl, _d.TITLE_FONT) + 0.3)
    height = max(lo.ylim[1] - lo.ylim[0] for lo in (left, right))
    gap = 0.8
    widths = [left.size[0], right.size[0]]
    fig, (l, b, r, t) = _d._figure((widths[0] + gap + widths[1] + LEGEND_SPACE,
                                    height * _d.Y_SCALE), any(titles), figsize)
    grid = fig.add_gridspec(1, 4, width_ratios=[widths[0], gap, widths[1], LEGEND_SPACE],
                            left=l, right=r, bottom=b, top=t, wspace=0)
    ax = fig.add_subplot(grid[0, 0])
    _d._paint(left, ax, ylim=(left.ylim[1] - height, left.ylim[1]))
    if titles[0]:
        ax.set_title(titles[0], fontsize=_d.TITLE_FONT, pad=10)
    ax = fig.add_subplot(grid[0, 2])
    top = flatten_levels(hardware)[0]
    _paint_streamed(right, ax, _levels_used(frames, top),
                    ylim=(right.ylim[1] - height, right.ylim[1]))
    if titles[1]:
        ax.set_title(titles[1], fontsize=_d.TITLE_FONT, pad=10)
    mid = fig.add_subplot(grid[0, 1])
    mid.axis("off")
    short = min(lo.ylim[1] - lo.ylim[0] for lo in (left, right))
    mid.text(0.5, 1 - short / height / 2, "→", ha="center", va="center", fontsize=28,
             transform=mid.transAxes)
    leg = fig.add_subplot(grid[0, 3])
    leg.axis("off")
    leg.set_xlim(0, 1)
    leg.set_ylim(0, 1)
    _legend_fig(leg, _levels_used(frames, top))
    return _d._save(fig, path)
