"""Pictures of diagrams: PNG or SVG, headless.

DisCoPy does the layout (its ``Drawing`` is a plane graph with positions);
napkin does the painting, on top of DisCoPy's matplotlib backend, so that

* every wire is labelled with its array and axes (``Q[q,d]``, from ``str(ob)``),
* every box shows its (tidied) name and is wide enough for it,
* copy/discard dots are small and never cover a label,
* the figure grows with the diagram: one wire slot and one layer have a fixed
  size in inches, so a 200-box diagram is as legible as a 5-box one.

Two entry points: :func:`draw` (one diagram) and :func:`draw_side_by_side`
(e.g. an algorithm next to its streamed program, with an arrow between).
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: never open a window

import matplotlib.pyplot as plt  # noqa: E402
from discopy import markov  # noqa: E402
from discopy.drawing import Drawing, Matplotlib  # noqa: E402
from discopy.monoidal import Category, Functor, Ty  # noqa: E402
from discopy.utils import Node  # noqa: E402
from matplotlib.patches import Polygon  # noqa: E402
from matplotlib.textpath import TextPath  # noqa: E402

from napkin.core.errors import NapkinError  # noqa: E402

__all__ = ["draw", "draw_side_by_side", "FORMATS"]

FORMATS = (".png", ".svg")

BOX_FONT = 10.0          # points
WIRE_FONT = 8.5
TITLE_FONT = 12.0
Y_SCALE = 0.62           # inches per layer (a box is half a layer tall)
X_MIN, X_MAX = 0.9, 3.2  # inches per wire slot: enough for the longest label
DPI = 150
MAX_PIXELS = 16000       # longest side of a PNG; the dpi drops for huge diagrams
DOT_AREA = 18            # points^2: copy/discard dots (~5 pt across)
TEXTPAD = (0.07, 0.05)   # wire label offset from its wire, in layout units
GAP = 0.3                # layout units kept between a widened box and the next wire
WIRE_COLOR = "#1f4e9a"



# ----------------------------------------------------------------------------- labels
_LONG_FLOAT = re.compile(r"\d+\.\d{5,}")


def pretty(name: str) -> str:
    """Tidy a box name for display: ``softcap(30.0000000000000)`` -> ``softcap(30)``."""
    return _LONG_FLOAT.sub(lambda m: f"{float(m.group()):g}", str(name))


@functools.lru_cache(maxsize=4096)
def _text_width(text: str, size: float) -> float:
    """Width of ``text`` at ``size`` points, in inches."""
    if not text:
        return 0.0
    return TextPath((0, 0), text, size=size).get_extents().width / 72


# ----------------------------------------------------------------------------- layout
def to_drawing(diagram) -> Drawing:
    """DisCoPy's layout of ``diagram``, composed as a balanced tree of layers.

    Same picture as ``diagram.to_drawing()`` (composition of drawings is
    associative), but each composition copies the whole graph, so folding
    left to right is quadratic (22 s at 200 boxes); the tree takes 2.6 s.
    """
    if not isinstance(diagram, markov.Diagram):
        raise NapkinError(f"can only draw a diagram, got {type(diagram).__name__}")
    ob = ar = lambda x: x.to_drawing()  # noqa: E731
    functor = Functor(ob, ar, Category(diagram.ty_factory, diagram.factory),
                      Category(Ty, Drawing))
    parts = [functor(layer) for layer in diagram.inside]
    if not parts:
        return diagram.to_drawing()
    while len(parts) > 1:
        parts = [parts[i] >> parts[i + 1] if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    result = parts[0]
    result.add_box_corners()
    return result


def _is_plain_box(box) -> bool:
    return not (box.draw_as_spider or box.draw_as_wires)


def _segments(drawing: Drawing) -> list[tuple]:
    """Every wire segment as (lo_y, hi_y, x0, y0, x1, y1, box indices it touches)."""
    out = []
    pos = drawing.positions
    for s, t in drawing.edges:
        ps, pt = pos[s], pos[t]
        lo, hi = sorted((ps.y, pt.y))
        out.append((lo, hi, ps.x, ps.y, pt.x, pt.y,
                    {getattr(s, "j", None), getattr(t, "j", None)}))
    return out


def _room(drawing: Drawing, j: int, segments) -> float:
    """Layout units a box's label may span: the box, widened symmetrically
    until it would come within ``GAP`` of a wire passing at its height."""
    p0 = drawing.positions[Node("box-corner-00", j=j)]
    p1 = drawing.positions[Node("box-corner-10", j=j)]
    cx, y = (p0.x + p1.x) / 2, (p0.y + drawing.positions[Node("box-corner-01", j=j)].y) / 2
    left, right = float("-inf"), float("inf")
    for lo, hi, x0, y0, x1, y1, js in segments:
        if not lo <= y <= hi or j in js:
            continue
        x = x0 if hi == lo else x0 + (x1 - x0) * (y - y0) / (y1 - y0)
        if x < cx:
            left = max(left, x)
        else:
            right = min(right, x)
    half = min(cx - left, right - cx) - GAP
    return max(abs(p1.x - p0.x), 2 * half, 0.5)


class _Layout:
    """A drawing plus what painting it needs: scale, box rectangles, limits."""

    def __init__(self, diagram):
        self.diagram = diagram
        self.drawing = to_drawing(diagram)
        self.names, self.colors = {}, {}
        need = X_MIN
        segments = _segments(self.drawing)
        pos = self.drawing.positions
        self._boxes = {}  # j -> (name, text width in inches, x0, x1, y0, y1, cx, cy)
        for j, box in enumerate(self.drawing.boxes):
            if not _is_plain_box(box):
                continue
            name = pretty(box.drawing_name)
            orig = diagram.boxes[j] if j < len(diagram.boxes) else None
            # the fill its primitive declares; boxes without one (copies, swaps) are white
            self.colors[j] = getattr(getattr(orig, "spec", None), "colour", "#ffffff")
            (x0, y0), (x1, y1) = (pos[Node(f"box-corner-{c}", j=j)] for c in ("00", "11"))
            cx, cy = pos[Node("box", j=j, box=box)]
            text_w = _text_width(name, BOX_FONT) + 0.16
            self._boxes[j] = (name, text_w, x0, x1, y0, y1, cx, cy)
            need = max(need, text_w / _room(self.drawing, j, segments))
        labels = {pretty(ob) for ob in _wire_obs(diagram)}
        self.label_w = max((_text_width(s, WIRE_FONT) for s in labels), default=0.0)
        # two neighbouring wires are one slot apart: a label must fit in between
        need = max(need, (self.label_w + 0.1) / (1 - TEXTPAD[0]))
        self.set_scale(min(max(need, X_MIN), X_MAX))

    def set_scale(self, x_scale: float) -> None:
        """Fix inches per wire slot; box widths (in layout units) and limits follow."""
        self.x_scale = x_scale
        self.rects = {}
        w, h = max(self.drawing.width, 0.5), max(self.drawing.height, 0.5)
        lo, hi = -0.15, w + self.label_w / x_scale + 0.05
        for j, (name, text_w, x0, x1, y0, y1, cx, cy) in self._boxes.items():
            half = max((x1 - x0) / 2, text_w / x_scale / 2)
            self.rects[j] = (name, cx - half, cx + half, y0, y1, cx, cy)
            lo, hi = min(lo, cx - half - 0.05), max(hi, cx + half + 0.05)
        self.xlim = (lo, hi)
        self.ylim = (-0.3, h + 0.05)

    def widen_to(self, inches: float) -> None:
        """Pad the limits symmetrically so the picture is at least ``inches`` wide
        (e.g. to fit a title longer than the diagram is wide)."""
        extra = inches / self.x_scale - (self.xlim[1] - self.xlim[0])
        if extra > 0:
            self.xlim = (self.xlim[0] - extra / 2, self.xlim[1] + extra / 2)

    @property
    def size(self) -> tuple[float, float]:
        """Inches (width, height) of the plotting area at the layout's scale."""
        return ((self.xlim[1] - self.xlim[0]) * self.x_scale,
                (self.ylim[1] - self.ylim[0]) * Y_SCALE)


def _wire_obs(diagram):
    yield from diagram.dom.inside
    for box in diagram.boxes:
        yield from box.cod.inside


# ----------------------------------------------------------------------------- painting
class _Backend(Matplotlib):
    """DisCoPy's matplotlib backend with napkin's boxes, dots and wire labels."""

    def __init__(self, axis, layout: _Layout):
        super().__init__(axis=axis, linewidth=1.0)
        self.layout = layout

    def draw_wire_label(self, x, i, j, **params):
        if hasattr(x.inside[0], "reposition_label"):
            j += 0.25  # the outputs of a swap
        self.axis.text(i + TEXTPAD[0], j - TEXTPAD[1], pretty(x.inside[0]),
                       fontsize=WIRE_FONT, color=WIRE_COLOR, ha="left", va="top",
                       zorder=3)

    def draw_box(self, positions, node, **params):
        name, x0, x1, y0, y1, cx, cy = self.layout.rects[node.j]
        self.axis.add_patch(Polygon(
            [(x0, y0), (x1, y0), (x1, y1), (x0, y1)], closed=True,
            facecolor=self.layout.colors.get(node.j, "#ffffff"), edgecolor="black",
            linewidth=self.linewidth, zorder=2))
        self.axis.text(cx, cy, name, ha="center", va="center", fontsize=BOX_FONT, zorder=3)

    def draw_spiders(self, graph, draw_box_labels=True, **params):
        for node, p in graph.positions.items():
            if node.kind != "box" or not node.box.draw_as_spider:
                continue
            if node.box.drawing_name:  # a labelled spider: show its label
                self.axis.text(p.x, p.y, node.box.drawing_name, ha="center", va="center",
                               fontsize=BOX_FONT, zorder=3)
            else:                      # copy / discard: a small dot
                self.axis.scatter([p.x], [p.y], s=DOT_AREA, c="black", zorder=4,
                                  linewidths=0)


def _paint(layout: _Layout, ax, ylim=None, backend=None) -> None:
    """Draw a laid-out diagram on ``ax`` (``backend``: a _Backend subclass)."""
    backend = (backend or _Backend)(ax, layout)
    params = dict(wire_labels=True, draw_box_labels=True, asymmetry=0)
    backend.draw_wires(layout.drawing, **params)
    backend.draw_boxes(layout.drawing, **params)
    backend.draw_spiders(layout.drawing, **params)
    ax.set_xlim(*layout.xlim)
    ax.set_ylim(*(ylim or layout.ylim))
    ax.set_aspect("auto")
    ax.axis("off")


# ----------------------------------------------------------------------------- output
PAD = 0.2          # inches of white around the picture
TITLE_SPACE = 0.35  # inches above the picture for a title


def _check_path(path) -> Path:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        shown = suffix or "no suffix"
        raise NapkinError(f"cannot draw to {str(path)!r}: unsupported file type {shown!r}; "
                          f"use one of {', '.join(FORMATS)}")
    if not path.parent.is_dir():
        raise NapkinError(f"cannot draw to {str(path)!r}: directory {str(path.parent)!r} "
                          f"does not exist")
    return path


def _figure(content: tuple[float, float], titled: bool, figsize=None):
    """A figure holding ``content`` inches of picture, plus padding and title room.

    Returns (figure, (left, bottom, right, top) of the content in figure fractions).
    """
    top_space = PAD + (TITLE_SPACE if titled else 0)
    if figsize:
        fw, fh = (float(v) for v in figsize)
        if fw <= 0 or fh <= 0:
            raise NapkinError(f"figsize must be two positive numbers (inches), got {figsize!r}")
    else:
        fw, fh = content[0] + 2 * PAD, content[1] + PAD + top_space
    fig = plt.figure(figsize=(fw, fh), facecolor="white")
    box = (min(PAD / fw, 0.45), min(PAD / fh, 0.45),
           max(1 - PAD / fw, 0.55), max(1 - top_space / fh, 0.55))
    return fig, box


def _save(fig, path: Path) -> Path:
    w, h = fig.get_size_inches()
    dpi = max(20, min(DPI, MAX_PIXELS / max(w, h, 1e-3)))
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG keeps real <text>
            fig.savefig(path, dpi=dpi, facecolor="white")
    except OSError as e:
        raise NapkinError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def draw(diagram, path, *, title: str | None = None, figsize=None) -> Path:
    """Draw ``diagram`` to ``path`` (``.png`` or ``.svg``); return the path.

    The size grows with the diagram: a fixed number of inches per wire slot
    (enough for the widest label) and per layer.  ``figsize`` (inches)
    overrides it and stretches the picture to fit.
    """
    path = _check_path(path)
    layout = _Layout(diagram)
    if title:
        layout.widen_to(_text_width(title, TITLE_FONT) + 0.1)
    fig, (l, b, r, t) = _figure(layout.size, bool(title), figsize)
    ax = fig.add_axes((l, b, r - l, t - b))
    _paint(layout, ax)
    if title:
        ax.set_title(title, fontsize=TITLE_FONT, pad=10)
    return _save(fig, path)


def draw_side_by_side(left, right, path, titles=("algorithm", "streamed program"), *,
                      symbol: str = "→", figsize=None) -> Path:
    """Draw two diagrams next to each other with ``symbol`` between them.

    Both halves share one scale (a box is the same size on both sides), are
    aligned at the top under their titles, and the symbol sits level with the
    middle of the shorter one.
    """
    path = _check_path(path)
    titles = ("", "") if titles is None else tuple(titles)
    if len(titles) != 2:
        raise NapkinError(f"draw_side_by_side takes two titles, got {len(titles)}")
    lay = [_Layout(left), _Layout(right)]
    x_scale = max(lo.x_scale for lo in lay)
    for lo, title in zip(lay, titles):
        lo.set_scale(x_scale)
        if title:
            lo.widen_to(_text_width(title, TITLE_FONT) + 0.3)
    height = max(lo.ylim[1] - lo.ylim[0] for lo in lay)
    gap = 0.8  # inches for the symbol
    widths = [lo.size[0] for lo in lay]
    fig, (l, b, r, t) = _figure((widths[0] + gap + widths[1], height * Y_SCALE),
                                any(titles), figsize)
    grid = fig.add_gridspec(1, 3, width_ratios=[widths[0], gap, widths[1]],
                            left=l, right=r, bottom=b, top=t, wspace=0)
    for col, lo, title in ((0, lay[0], titles[0]), (2, lay[1], titles[1])):
        ax = fig.add_subplot(grid[0, col])
        _paint(lo, ax, ylim=(lo.ylim[1] - height, lo.ylim[1]))  # tops aligned
        if title:
            ax.set_title(title, fontsize=TITLE_FONT, pad=10)
    mid = fig.add_subplot(grid[0, 1])
    mid.axis("off")
    short = min(lo.ylim[1] - lo.ylim[0] for lo in lay)
    mid.text(0.5, 1 - short / height / 2, symbol, ha="center", va="center", fontsize=28,
             transform=mid.transAxes)
    return _save(fig, path)
