"""The kernel plan: what a streamed program's kernel does, decided once, for any backend.

A backend (``napkin.lower.backends``) only *spells* a :class:`KernelPlan`; every decision
about the kernel is made here, for concrete shapes:

* **the grid** — the groups at the top of the program (the GMEM → on-chip boundary), one
  grid dimension per grouped axis in nesting order (:class:`GridAxis`: tile, size,
  whether the last tile overhangs the array);
* **the blocks** — every input and output as an :class:`ArrayPlan`: its block (each
  grouped axis cut to its tile, a streamed axis kept whole and padded as the backend's
  :class:`BlockRules` ask, other axes whole), which grid dimension indexes each block
  axis, and whether it is streamed or loaded whole;
* **the loops** — every stream box as a :class:`StreamPlan`: full chunks and the ragged
  tail, and its tile skipping (:class:`SkipPlan`, from causal / window masks whose
  masked entries the accumulator absorbs);
* **masked tails** — which boxes of a ragged tail see their reduced inputs replaced by
  the reduction's neutral element (:func:`reduction_neutral`), as the primitives declare.

The plan reads the same program the schedule (``napkin.schedule``) prices; its
:meth:`KernelPlan.loops` is the grid-and-stream nest the schedule's kernel holds, which the
tests compare.  Backend limits (powers of two, a minimum dot size) are :class:`BlockRules`
the backend declares; a violated one is a NapkinError naming the array, axis and size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import sympy

from napkin.core.arrays import Axis, array_types
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, primitive_boxes, to_graph, view
from napkin.lower.emit import identifier
from napkin.core.primitives import matmul_sides
from napkin.core.semantics import bind_sizes
from napkin.frontend.weave import unweavable, unweave


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class pow2ceil(sympy.Function):
    """The least power of two >= n (block size of a streamed axis), symbolic."""

    @classmethod
    def eval(cls, n):
        if n.is_Integer:
            return sympy.Integer(pow2_at_least(int(n)))


@dataclass(frozen=True)
class BlockRules:
    """What a backend needs of block shapes (declared by the backend, enforced here)."""
    name: str                 # the backend, for messages ("Triton")
    pow2: bool = True         # tiles, chunks and whole blocks are powers of two
    dot_min: int | None = 16  # a contraction with a dimension below this is multiply-and-sum
    tails: bool = True        # a tile need not divide its axis (the last one is masked)

    def block(self, n, chunk: int):
        """The block that holds a streamed axis of ``n`` in chunks of ``chunk`` (the
        ragged tail's chunk lies inside it); an int for an int ``n``, else symbolic."""
        if not isinstance(n, (int, np.integer)):
            n = sympy.sympify(n)
            return sympy.Max(pow2ceil(n), chunk) if self.pow2 else sympy.ceiling(n / chunk) * chunk
        return max(pow2_at_least(n), chunk) if self.pow2 else -(-int(n) // chunk) * chunk

    def size_ok(self, n: int) -> bool:
        """Whether a tile, a chunk or a block kept whole may be ``n`` long."""
        return is_pow2(n) or not self.pow2


# ------------------------------------------------------------------ structure
@dataclass
class Structure:
    """The nested groups at the top of a program and the body they hold."""
    groups: list            # Group specs, outermost first
    body: object            # the innermost body diagram (the kernel body)
    in_map: list[int]       # body input i  -> program input in_map[i]
    out_map: list[int]      # program output j -> body output out_map[j]


def peel(program) -> Structure:
    """Descend through the groups that make up a whole diagram."""
    groups, d = [], program
    in_map = list(range(len(program.dom.inside)))
    out_map = list(range(len(program.cod.inside)))
    while True:
        g = to_graph(d)
        opn = [n for n in g.nodes if g.nodes[n]["kind"] == "op"]
        if len(opn) != 1:
            break
        node = g.nodes[opn[0]]
        spec = node["box"].spec
        if getattr(spec, "kind", None) != "group":
            break
        inputs, outputs = g.graph["inputs"], g.graph["outputs"]
        if any(v not in node["outs"] for v in outputs):
            raise NapkinError("the program passes an input straight to an output; "
                              "nothing to lower for it")
        groups.append(spec)
        in_map = [in_map[inputs.index(v)] for v in node["ins"]]
        out_map = [node["outs"].index(outputs[k]) for k in out_map]
        d = spec.body
    return Structure(groups, d, in_map, out_map)


class Refusal(str):
    """Why a backend cannot write a program (a ``str``), and whether the reason is ``final``:
    one no rewrite removes.  Rules only nest boxes deeper — none splits a kernel's body or
    removes a group — so a group whose output its kernel reads again, or whose input its
    kernel computes, stays so in every program derived from this one (a search need not
    derive them)."""
    final: bool = False

    def __new__(cls, text: str, final: bool = False):
        self = super().__new__(cls, text)
        self.final = final
        return self


def unlowerable(program, sizes: dict | None = None, rules: BlockRules | None = None) -> str:
    """Why the kernel backends cannot write ``program`` ("" when they can).  Each top-level
    box is a kernel of its own (a program of several runs them in order, the values between
    them in HBM); each kernel spells a grid of groups, and inside it streams and groups as
    loops (:func:`_writable` says what those need).  An axis of a size the backend's blocks
    cannot take is padded and masked: no size is a reason."""
    g = view(program)  # each top-level box is a kernel
    for box in (g.nodes[n]["box"] for n in op_order(g)):
        why = kernel_unlowerable(box)
        if why:
            return why
    return ""


def kernel_unlowerable(kernel) -> str:
    """Why no backend writes the one kernel ``kernel`` is ("" when one can)."""
    try:
        structure = peel(kernel)
    except NapkinError as e:
        return str(e)
    if any(g.level == "gmem" for g in structure.groups):
        return "a group at gmem (sequential launches) has no kernel spelling"
    cut, parts = [], []
    for spec in structure.groups:
        if spec.axis in cut + parts:
            return _twice(spec, "group")
        (parts if spec.stack else cut).append(spec.axis)
    body = structure.body
    if parts:
        why = _split_body(body, parts)
        if why:
            return why
    return _writable(body, set(range(len(body.dom))), set(range(len(body.cod))), frozenset(cut))


def _split_body(body, parts) -> str:
    """Why a kernel over the parts of ``parts`` (split-K) cannot write ``body`` ("" when it
    can): its body is the one stream each part folds, reading kernel inputs."""
    g = view(body)
    boxes = [g.nodes[n]["box"] for n in op_order(g)]
    if len(boxes) != 1 or boxes[0].spec.kind != "stream" or boxes[0].spec.axis not in parts:
        return Refusal(f"a split of {', '.join(parts)} whose part is not one stream over it",
                       final=True)
    spec = boxes[0].spec
    return _writable(spec.update, set(range(spec.n_state, len(spec.update.dom))), set(),
                     frozenset(parts)) or _writable(spec.init, set(), set()) or \
        _writable(spec.finalize, set(), set())


def _twice(spec, enclosing: str) -> Refusal:
    """A loop over an axis an enclosing loop already cuts: every array plan indexes an axis
    by one grid dimension or one loop, so a tile of a tile has no spelling (and rules only
    nest deeper: no derived program loses it)."""
    return Refusal(f"{spec.kind} {spec.axis} inside a {enclosing} over {spec.axis}: an axis cut "
                   f"twice in one kernel (a tile of a tile) has no kernel spelling", final=True)


def _writable(diagram, refs: set, stored: set, cut: frozenset = frozenset()) -> str:
    """Why a kernel cannot write ``diagram`` ("" when it can).  ``refs``: the input positions
    still in HBM (kernel inputs, or their tiles); ``stored``: the output positions that go
    straight to the kernel's outputs; ``cut``: the axes the enclosing grid and loops cut.  A
    group's loop inside the kernel tiles what it reads from HBM (a value computed in the
    kernel has no tiles to load; a stream's chunks of one are its equal parts) and writes its
    outputs straight to the kernel's."""
    g = view(diagram)
    ref_values = {g.graph["inputs"][i] for i in refs}
    store_values = {g.graph["outputs"][j] for j in stored}
    for n in op_order(g):
        node = g.nodes[n]
        box, spec = node["box"], node["box"].spec
        if spec.kind not in ("stream", "group"):
            continue
        if spec.axis in cut:
            return _twice(spec, "loop or group")
        types = [g.nodes[v]["ob"] for v in node["ins"]]
        for v, ob in zip(node["ins"], types):
            if spec.kind == "group" and ob.type.has(spec.axis) and v not in ref_values:
                return Refusal(f"{box.name}: its input {ob.name} is computed inside the kernel, "
                               f"and a loop over a group inside a kernel tiles only arrays it "
                               f"loads", final=True)
        outs = [v in store_values and not list(g.successors(v)) for v in node["outs"]]
        inner_refs = {j for j, v in enumerate(node["ins"]) if v in ref_values}
        if spec.kind == "group":
            if not all(outs):
                return Refusal(f"{box.name}: a group inside the kernel body whose outputs the "
                               f"kernel reads again; its loop writes them straight to the "
                               f"kernel's outputs", final=True)
            why = _writable(spec.body, inner_refs, set(range(len(node["outs"]))),
                            cut | {spec.axis})
        else:
            k = spec.n_state
            chunked = {k + j for j in inner_refs if types[j].type.has(spec.axis)}
            why = _writable(spec.update, chunked, set(), cut | {spec.axis}) \
                or _writable(spec.init, set(), set(), cut) \
                or _writable(spec.finalize, set(), {j for j, ok in enumerate(outs) if ok}, cut)
        if why:
            return why
    return ""


def stream_boxes(diagram) -> list:
    """Every stream box in ``diagram`` (a kernel's body), at any depth, in program order."""
    return [b for b in loop_boxes(diagram) if b.spec.kind == "stream"]


def inner_groups(diagram) -> list:
    """Every group box in a kernel's body (below its grid), at any depth: loops the kernel
    runs, one tile after another."""
    return [b for b in loop_boxes(diagram) if b.spec.kind == "group"]


def loop_boxes(diagram) -> list:
    """Every stream and group box of ``diagram`` and of their bodies, in the order the
    schedule walks them (a box, then the loops inside it)."""
    g = view(diagram)
    out = []
    for n in op_order(g):
        box = g.nodes[n]["box"]
        if box.spec.kind in ("stream", "group"):
            out.append(box)
            for body in box.spec.bodies:
                out += loop_boxes(body)
    return out


# ------------------------------------------------------------------ masks and tails
def absorbing(update, axis: str, streamed: str = "k") -> str | None:
    """Why masked entries of the update are *not* absorbed (None when they are), for a
    stream over the masks' ``streamed`` axis ("k": their keys; "q": their queries, a
    stream that skips the query chunks keeping no key of a key tile).

    Tags follow the mask's output: NEG (masked positions hold the fill, about
    −1e30) and ZERO (masked positions hold exactly 0: a mask filling 0, a backward's on its
    cotangent).  NEG may be scaled by a
    positive constant, shifted by a value without the streamed axis, re-masked
    or reduced by max / logsumexp over the axis; exp turns NEG into ZERO; ZERO
    may be multiplied and summed or contracted over the axis.  Each primitive
    declares its own part (``absorbs``).
    """
    g = to_graph(update)
    work, keys = [], set()
    for n in g.nodes:
        spec = g.nodes[n].get("box") and g.nodes[n]["box"].spec
        if g.nodes[n]["kind"] == "op" and getattr(spec, "kind", None) == "mask" \
                and spec.kind_ in ("causal", "window") and getattr(spec, streamed) == axis:
            if spec.fill == 0:  # a backward's mask on a cotangent: masked entries exactly 0
                work += [(v, "ZERO") for v in g.nodes[n]["outs"]]
                continue
            if spec.fill > -1e4:
                return f"mask fill {spec.fill} is neither a large negative nor 0"
            work += [(v, "NEG") for v in g.nodes[n]["outs"]]
            keys.add(spec.k)
    if len(keys) > 1:
        return f"masks over the {streamed} axis {axis} with different key axes"
    return _leak(g, work, axis, next(iter(keys), axis))


def _leak(g, work: list, axis: str, key: str | None = None) -> str | None:
    """Why the masked entries ``work`` ((value, tag) pairs) reach the update's result (None
    when every one is absorbed: see :func:`absorbing`)."""
    out_values = set(g.graph["outputs"])
    seen = set()
    while work:
        v, tag = work.pop()
        if (v, tag) in seen:
            continue
        seen.add((v, tag))
        if v in out_values:
            return "a masked value leaves the update unreduced"
        for n in g.successors(v):
            node = g.nodes[n]
            ins = [g.nodes[u]["ob"].type for u in node["ins"]]
            new = node["box"].spec.absorbs(tag, node["ins"].index(v), ins, axis, key)
            if new is None:
                return f"{node['box'].name} does not absorb masked entries"
            if new != "ABSORBED":
                work += [(u, new) for u in node["outs"]]
    return None


@dataclass
class ChunkGuard:
    """A mask over a stream's chunk whose condition is data (segment ids, a prefix length, a
    validity array) rather than index arithmetic: ``where(keep, x, fill)`` or a padding mask,
    with ``keep`` computed from the update's inputs by elementwise boxes only (``cone``: a
    diagram from the stream's inputs at positions ``inputs`` (the state not counted) to the
    condition, its output ``output``; None when ``keep`` is an input itself).  A chunk whose condition is false
    everywhere leaves the accumulator as it was (its fill is absorbed): the kernel evaluates
    the condition first and skips the chunk's work.  ``nonzero``: ``keep`` is a number read
    as ``!= 0`` (the padding mask's)."""
    box: str
    cone: object
    inputs: list
    output: int
    nonzero: bool = False


def chunk_guards(spec) -> list:
    """The :class:`ChunkGuard` of a stream's update, where skipping a chunk it masks whole
    is exact: the fill is −∞ (it adds nothing to a max, a logsumexp or a sum of exp), or,
    for softmax-contraction, at most −5·10²⁹ (the finalize zeroes a row that kept nothing,
    skipped or not); the masked entries are absorbed (:func:`absorbing`'s walk); and the
    condition reads no state and no contraction or reduction (cheap, before the chunk's
    matrix products)."""
    from napkin.core.region import region, region_diagram
    g = to_graph(spec.update)
    order = op_order(g)
    inputs = g.graph["inputs"]
    state = set(inputs[:spec.n_state])
    out = []
    for n in order:
        box = g.nodes[n]["box"]
        b = box.spec
        if getattr(b, "kind", None) == "where" and b.a is None and b.b is not None:
            fill, keep, nonzero = float(b.b), g.nodes[n]["ins"][0], False
        elif getattr(b, "kind", None) == "mask" and b.kind_ == "padding":
            fill, keep, nonzero = float(b.fill), g.nodes[n]["ins"][1], True
        else:
            continue
        exact = fill == float("-inf") or (fill <= -5e29 and spec.rule == "softmax_contraction")
        outs = g.nodes[n]["outs"]
        if not exact or not g.nodes[outs[0]]["ob"].type.has(spec.axis) \
                or _leak(g, [(v, "NEG") for v in outs], spec.axis):
            continue
        cone = nx.ancestors(g, keep) | {keep}
        ops_ = [m for m in order if m in cone]
        if cone & state or any(not (g.nodes[m]["box"].spec.elementwise
                                    or not g.nodes[m]["ins"]) for m in ops_):
            continue
        k = spec.n_state
        if not ops_:
            out.append(ChunkGuard(box.name, None, [inputs.index(keep) - k], 0, nonzero))
            continue
        reg = region(g, [order.index(m) for m in ops_])
        out.append(ChunkGuard(box.name, region_diagram(reg),
                              [inputs.index(v) - k for v in reg.inputs],
                              reg.outputs.index(keep), nonzero))
    return out


def reduction_neutral(box, axis: str):
    """In a ragged tail over ``axis``: the value that pads ``box``'s inputs holding the axis
    (None: the box acts position by position, or does not see the axis)."""
    ins, outs = array_types(box.dom), array_types(box.cod)
    if not any(t.has(axis) for t in ins):
        return None
    neutral = box.spec.neutral(axis)  # what the box declares pads its reduction
    if neutral is None and any(t.has(axis) for t in outs):
        return None  # woven over the axis: its garbage at invalid positions is discarded
    if neutral is None:
        raise NapkinError(f"{box.name} reduces the streamed axis {axis}; the lowering knows "
                          f"no neutral element for it (ragged chunks need one): make {axis} "
                          f"a multiple of the chunk")
    return neutral


# ------------------------------------------------------------------ the plan
@dataclass
class GridAxis:
    axis: str
    tile: int
    size: int
    reverse: bool = False   # programs run last tile first (causal: the heaviest tiles first)
    # split-K: the parts of a stream over ``axis``, one per program, each writing its partial
    # state along this stacked axis (the inputs keep ``axis`` whole: the stream reads its part)
    stacked: str | None = None

    @property
    def tiles(self) -> int:
        return -(-self.size // self.tile)

    @property
    def ragged(self) -> bool:
        return self.size % self.tile != 0


RASTER_GROUP = 8  # row tiles a group of programs shares (the GROUP_M of Triton's matmul tutorial)


@dataclass(frozen=True)
class Raster:
    """Grid dimensions ``rows`` and ``cols`` launched as one, in groups of ``group`` row
    tiles: a group's programs sweep the column tiles one by one, each column tile for the
    group's rows in turn, so a column operand's panel is read by ``group`` programs in a
    row and the group's row panels stay in L2 over the sweep (grouped ordering).  Chosen
    for a grid whose two dimensions each index an operand the other does not (matmul's
    A[a,b] and B[b,c]); row-major order would read every B panel once per row tile."""
    rows: int
    cols: int
    group: int

    def tiles(self, grid) -> tuple[int, int]:
        return grid[self.rows].tiles, grid[self.cols].tiles


@dataclass
class ArrayPlan:
    """One kernel input or output: its block and how the grid indexes it."""
    name: str               # identifier-safe name (unique among the kernel's arrays)
    type: object            # body-level ArrayType
    shape: tuple            # full array shape
    dtype: object
    block: tuple            # block shape
    index: tuple            # per dim: grid dimension or None (the whole axis)
    streamed: set = field(default_factory=set)
    whole: bool = False     # also used whole inside the kernel
    squeezed: tuple = ()    # grid axes of tile 1 the block drops (the kernel never sees them)

    @property
    def names(self) -> tuple:
        """The block's axes as the kernel sees them."""
        return tuple(a for a in self.type.names if a not in self.squeezed)

    @property
    def kernel_block(self) -> tuple:
        """The block as the kernel sees it."""
        return tuple(b for a, b in zip(self.type.names, self.block) if a not in self.squeezed)

    def describe(self, grid_axes) -> str:
        parts = []
        for a, n, b in zip(self.type.names, self.shape, self.block):
            if a in self.squeezed:
                parts.append(f"{a}: one per program, squeezed")
            elif a in grid_axes:
                parts.append(f"{a}: tile of {b}")
            elif b != n:
                parts.append(f"{a}: whole, padded to {b}, streamed")
            else:
                parts.append(f"{a}: whole")
        return f"{self.name}[{','.join(self.type.names)}] " + "; ".join(parts)


@dataclass
class SkipPlan:
    """Only the chunks holding a key some row of the tile keeps: for rows [r0, r1] the kept
    keys are [max(0, r0 + low), min(n, r1 + high)) (``low`` None: from 0)."""
    query: str              # the masks' query axis
    kinds: tuple            # the mask kinds ("causal", "window")
    low: int | None
    high: int
    static: tuple | None    # (first chunk, end chunk) when the query axis is whole
    tile: GridAxis | None   # the query axis's grid axis otherwise


@dataclass
class StreamPlan:
    axis: str
    chunk: int
    size: int
    rule: str
    # split-K: (grid dimension, chunks per part): this program folds the chunks
    # [j·per, min((j+1)·per, chunks)) of part j, its index along that dimension
    part: tuple | None = None
    skip: SkipPlan | None = None
    # a stream over the masks' query axis in a program per key tile (a backward's dK, dV):
    # only the query chunks holding a row that keeps a key of the tile (``query`` names the
    # key axis then; Triton spells it, other backends visit every chunk)
    skip_queries: SkipPlan | None = None
    guards: list = field(default_factory=list)  # ChunkGuard: data masks that skip a chunk

    @property
    def chunks(self) -> int:
        return -(-self.size // self.chunk)

    @property
    def full(self) -> int:
        return self.size // self.chunk

    @property
    def tail(self) -> int:
        return self.size % self.chunk


@dataclass
class InnerGroupPlan:
    """A group inside a kernel's body: a loop over its tiles (``chunk``: the tile)."""
    axis: str
    chunk: int
    size: int

    @property
    def tile(self) -> int:
        return self.chunk


def _loop_key(spec) -> tuple:
    return (spec.kind, spec.axis, str(spec.chunk if spec.kind == "stream" else spec.size))


@dataclass
class KernelPlan:
    """Everything a backend spells, for one set of input shapes (see the module doc)."""
    name: str
    describe: str           # the program's groups and streams, in words
    grid: list              # GridAxis, outermost first
    inputs: list            # ArrayPlan
    outputs: list           # ArrayPlan
    streams: dict           # id(stream spec) -> StreamPlan
    env: dict               # size symbol -> value (axis sizes and tiles)
    sizes: dict             # axis name -> size
    notes: list
    body: object            # the diagram the kernel runs: the program's body, squeezed axes out
    gpu_refusal: str = ""   # why it cannot run compiled (a tile makes a dot too small)
    raster: Raster | None = None  # two grid dimensions launched as one, grouped
    # axis -> its block: a whole axis the backend's blocks cannot take at its size, padded
    # (loads and stores masked, every reduction over it sees its neutral element there)
    padded: dict = field(default_factory=dict)
    inner: dict = field(default_factory=dict)  # id(group spec) -> InnerGroupPlan: loops in the body

    @property
    def grid_shape(self) -> tuple:
        """Tiles per grid dimension (one per grouped axis)."""
        return tuple(g.tiles for g in self.grid) or (1,)

    @property
    def launch_dims(self) -> list[list[int]]:
        """The grid dimensions each launched dimension runs: one each, except a raster's
        rows and columns, launched together where the rows were."""
        r = self.raster
        return [[d] if r is None or d != r.rows else [r.rows, r.cols]
                for d in range(len(self.grid)) if r is None or d != r.cols]

    @property
    def launch_shape(self) -> tuple:
        """The grid the kernel is launched with."""
        return tuple(int(np.prod([self.grid[d].tiles for d in dims]))
                     for dims in self.launch_dims) or (1,)

    @property
    def grid_axes(self) -> dict:
        """Axis -> the grid dimension that cuts every array along it (a split's parts cut
        none: their stream reads its part of the whole axis)."""
        return {g.axis: i for i, g in enumerate(self.grid) if g.stacked is None}

    def stream(self, spec) -> StreamPlan:
        return self.streams[id(spec)]

    def summary(self) -> list[str]:
        """The program, its inputs and outputs, in words (a written module's docstring)."""
        return [f"program: {self.describe}",
                "inputs:  " + ", ".join(f"{a.name}{list(a.shape)} {np.dtype(a.dtype).name}"
                                       for a in self.inputs),
                "outputs: " + ", ".join(f"{o.name}{list(o.shape)} {np.dtype(o.dtype).name}"
                                       for o in self.outputs)]

    def loops(self) -> list:
        """The nest, outermost first: ("group", axis, tile) per grid dimension, then the loops
        inside the kernel in the order the schedule walks them: ("stream", axis, chunk) per
        stream and ("group", axis, tile) per group of the body."""
        inside = []
        for box in loop_boxes(self.body):
            p = self.streams.get(id(box.spec)) or self.inner[id(box.spec)]
            inside.append((box.spec.kind, p.axis, p.chunk))
        return [("group", g.axis, g.tile) for g in self.grid] + inside


def tile_indices(plan, ids: list[str]) -> list[str]:
    """Per grid dimension, the expression of this program's tile from the launched grid's
    indices ``ids``: the index itself, a raster's grouped order (see plan.Raster), counted
    from the last tile where the dimension runs heaviest first."""
    out = {}
    for i, dims in zip(ids, plan.launch_dims):
        if len(dims) == 1:
            out[dims[0]] = i
            continue
        r = plan.raster
        (rows, cols), g = r.tiles(plan.grid), r.group
        width = g * cols  # programs per group: `g` row tiles × every column tile
        first = f"{i} // {width} * {g}"
        size = g if rows % g == 0 else f"jnp.minimum({rows} - {first}, {g})"
        out[r.rows] = f"{first} + {i} % {width} % {size}"
        out[r.cols] = f"{i} % {width} // {size}"
    return [f"{g.tiles - 1} - ({out[d]})" if g.reverse and " " in out[d] else
            f"{g.tiles - 1} - {out[d]}" if g.reverse else out[d]
            for d, g in enumerate(plan.grid)]


def schedule_loops(schedule) -> list:
    """The group and stream loops of a schedule (``napkin.schedule``), in its order."""
    from napkin.schedule.nest import Loop
    return [it for it, _ in schedule.walk()
            if isinstance(it, Loop) and it.kind in ("group", "stream")]


class Planner:
    """Builds the :class:`KernelPlan` of a lowered kernel for concrete shapes.

    The loops come from the kernel's schedule: the grid is its outer group loops, each
    stream runs its stream loop's chunks over its loop's extent; the program's own group
    and stream boxes must be those loops (else an internal error: the kernel would not be
    the program the schedule prices)."""

    def __init__(self, kernel, shapes, dtypes, rules: BlockRules, sizes: dict | None = None):
        self.k, self.st, self.rules = kernel, kernel.structure, rules
        program = kernel.program
        prog_in = array_types(program.dom)
        dummies = [np.broadcast_to(np.zeros((), bool), s) for s in shapes]
        # ``sizes``: sizes bound outside (a program's kernel may use a size none of its own
        # arrays has, e.g. the 1/sqrt(d) of a scale over scores)
        self.env = bind_sizes(prog_in, dummies, {**(sizes or {}), **kernel.tiles},
                              [str(ob) for ob in program.dom.inside])
        self.sizes = {}
        for t in prog_in + array_types(program.cod):
            for a in t.axes:
                val = sympy.sympify(a.size).subs(self.env)
                if val.is_Number:
                    self.sizes.setdefault(a.name, int(val))
        self.shapes, self.dtypes = [tuple(s) for s in shapes], list(dtypes)
        loops = schedule_loops(kernel.schedule)
        groups = loops[:len(self.st.groups)]
        inner = loops[len(self.st.groups):]  # streams and groups inside the kernel's body
        if [(lp.kind, lp.axis, lp.size) for lp in groups] != \
                [("group", s.axis, s.size) for s in self.st.groups] \
                or [(lp.kind, lp.axis, str(lp.size)) for lp in inner] != \
                [_loop_key(b.spec) for b in loop_boxes(self.st.body)]:
            raise NapkinError(f"internal: the loops of {kernel.name}'s schedule are not its "
                              f"program's groups and streams")
        self.grid = []
        for loop, spec in zip(groups, self.st.groups):
            tile = kernel.size_of(loop.size, f"group {loop.axis}", self.extent(loop))
            self.grid.append(GridAxis(loop.axis, tile, self.extent(loop), stacked=spec.stack))
            if isinstance(loop.size, sympy.Symbol):
                self.env[loop.size] = tile
        # a grid axis run one index per program that every box only carries leaves the
        # body: blocks squeeze it (a unit axis in a block costs Triton layout conversions
        # through shared memory: 1.5x batched matmul's, and spills)
        self.body, self.squeezed = self.st.body, []
        for g in self.grid:
            if g.tile == 1 and not unweavable(self.body, g.axis):
                self.body = unweave(self.body, g.axis)
                self.squeezed.append(g.axis)
        # id(stream or group spec) -> its schedule loop (the same walk, the same order)
        self.loop_of = {id(box.spec): lp for box, lp in zip(loop_boxes(self.body), inner)}
        # the axes the grid cuts every array along; a stacked group's axis is not one (its
        # stream reads its part of the whole axis; its outputs gain the stacked axis)
        self.gaxes = {g.axis: i for i, g in enumerate(self.grid) if g.stacked is None}
        self.parts = {g.axis: i for i, g in enumerate(self.grid) if g.stacked is not None}
        self.notes: list[str] = []
        self.padded: dict = {}
        self.chunks: dict = {}  # axis -> the largest chunk a stream or loop cuts it in

    def extent(self, loop) -> int:
        """How far a schedule loop runs, at these shapes."""
        return int(sympy.sympify(loop.full).subs(self.env))

    def plan(self) -> KernelPlan:
        streams = {id(box.spec): self.stream(box) for box in stream_boxes(self.body)}
        inner = {id(box.spec): self.inner_group(box) for box in inner_groups(self.body)}
        chunks = {}
        for s in [*streams.values(), *inner.values()]:  # the largest cut of an axis sets
            chunks[s.axis] = max(chunks.get(s.axis, 1), s.chunk)  # its block
        self.chunks = chunks  # (an axis kept whole beside its stream's larger chunk: padded)
        inputs = self.inputs()
        outputs = self.outputs({s.axis: s.chunk for s in inner.values()})
        for a, block in self.padded.items():
            self.notes.append(f"axis {a}={self.sizes.get(a)}: padded to {block} in every block, "
                              f"masked")
        return KernelPlan(self.k.name, self.k.describe(), self.grid, inputs, outputs, streams,
                          self.env, self.sizes, self.notes, self.body, self.small_dot(),
                          self.raster(inputs), dict(self.padded), inner)

    def raster(self, inputs) -> Raster | None:
        """Grouped ordering for the first pair of grid dimensions that each index an input
        the other does not, when there are more row tiles than a group (fewer: the plain
        order already is one group)."""
        for rows in range(len(self.grid)):
            for cols in range(rows + 1, len(self.grid)):
                alone = [any(d in a.index and e not in a.index for a in inputs)
                         for d, e in ((rows, cols), (cols, rows))]
                if all(alone) and self.grid[rows].tiles > RASTER_GROUP \
                        and self.grid[cols].tiles > 1:
                    self.notes.append(f"groups {self.grid[rows].axis}, {self.grid[cols].axis}: "
                                      f"launched in groups of {RASTER_GROUP} "
                                      f"{self.grid[rows].axis} tiles (L2 reuse)")
                    return Raster(rows, cols, RASTER_GROUP)
        return None

    def squeezed_of(self, t) -> tuple:
        return tuple(a for a in t.names if a in self.squeezed)

    def small_dot(self) -> str:
        """Why the kernel cannot be compiled: a matrix product with a dimension under the
        backend's least dot that a tile makes so ("" when none).  Interpret mode runs such
        a product as multiply-and-sum; on a GPU it would leave the tensor cores (and
        Triton's compile time explodes), so compiled kernels refuse it.  A whole axis that
        small is the problem's own size, not a choice: it runs as multiply-and-sum."""
        least, tiles = self.rules.dot_min, set(self.k.tiles)
        for box in primitive_boxes(self.body):
            for what, axes in (matmul_sides(box) or {}).items():
                at = {a: int(sympy.sympify(n).subs(self.env)) for a, n in axes}
                extent = int(np.prod(list(at.values())))
                tiled = [(a, n) for a, n in axes if sympy.sympify(n).free_symbols & tiles]
                if extent < least and tiled:
                    why = ", ".join(f"{a} in tiles of {n} = {at[a]}" for a, n in tiled)
                    return (f"{box.name}: its {what} dimension is {extent} ({why}), under "
                            f"{least}, the least dot dimension of the {self.rules.name} backend "
                            f"on a GPU; choose tiles of at least {least}")
        return ""

    def inputs(self) -> list:
        """Each input's plan (its blocks cut by ``self.chunks``: the chunk of every streamed
        axis)."""
        body, rules, chunks = self.st.body, self.rules, self.chunks
        g = to_graph(body)
        names = _unique([identifier(ob.name, "x") for ob in body.dom.inside])
        out = []
        for i, (v, t) in enumerate(zip(g.graph["inputs"], array_types(body.dom))):
            uses = _cuts(g, v)
            streamed = set().union(*uses) if uses else set()
            uncut = {a for a in t.names if any(a not in c for c in uses)}
            whole = bool(uncut)
            p = self.st.in_map[i]
            shape = self.shapes[p]
            block, index = [], []
            for d, a in enumerate(t.names):
                n = shape[d]
                if a in self.gaxes:
                    block.append(self.grid[self.gaxes[a]].tile)
                    index.append(self.gaxes[a])
                    continue
                index.append(None)
                if a in streamed:
                    padded = rules.block(n, chunks[a])
                    if a in uncut and padded != n:
                        self.pad(a, n, padded)
                    block.append(padded)
                else:
                    block.append(self.whole(a, n))
            out.append(ArrayPlan(names[i], t, shape, self.dtypes[p], tuple(block), tuple(index),
                                 streamed, whole, self.squeezed_of(t)))
        return out

    def outputs(self, tiles: dict) -> list:
        """``tiles``: the tile of every axis a loop inside the body groups (its tiles are
        stored straight to the outputs: their blocks hold the last tile's overhang)."""
        k = self.k
        body_outs = array_types(self.st.body.cod)
        labels = [ob.name for ob in self.st.body.cod.inside]
        names = _unique([identifier(nm, "out") for nm in labels])
        out = []
        for i, t in enumerate(body_outs):
            shape, block, index = [], [], []
            squeezed = self.squeezed_of(t)
            for ax, d in self.parts.items():  # one partial state per part: its own entry
                parts = self.grid[d]
                t = t.with_axis(Axis(parts.stacked, parts.tiles))
                shape.insert(0, parts.tiles)
                block.insert(0, 1)
                index.insert(0, d)
                squeezed = (parts.stacked, *squeezed)
            for a in t.names[len(self.parts):]:
                n = self.sizes.get(a)
                if n is None:
                    n = int(sympy.sympify(t.axis(a).size).subs(self.env))
                shape.append(n)
                if a in self.gaxes:
                    block.append(self.grid[self.gaxes[a]].tile)
                    index.append(self.gaxes[a])
                elif a in tiles:
                    padded = self.rules.block(n, tiles[a])
                    block.append(self.pad(a, n, padded) if padded != n else n)
                    index.append(None)
                else:
                    block.append(self.whole(a, n))
                    index.append(None)
            dtype = np.dtype(k.dtypes_for([t], [labels[i]])[0])
            out.append(ArrayPlan(names[i], t, tuple(shape), dtype, tuple(block), tuple(index),
                                 squeezed=squeezed))
        return out

    def whole(self, axis: str, n: int) -> int:
        """The block of an axis kept whole: its size, or the least size the backend's blocks
        take above it — and above the chunk a stream of the axis reads, which may be larger
        than the axis (the axis is then padded and masked, in every block alike)."""
        block = self.rules.block(n, self.chunks.get(axis, 1))
        return n if block == n else self.pad(axis, n, block)

    def pad(self, axis: str, n: int, block: int) -> int:
        if self.padded.get(axis, block) != block:
            raise NapkinError(f"internal: axis {axis}={n} padded to both {self.padded[axis]} "
                              f"and {block}")
        self.padded[axis] = block
        return block

    def stream(self, box) -> StreamPlan:
        spec = box.spec
        ax = spec.axis
        if ax in self.gaxes:
            raise NapkinError(f"stream {ax}: the axis is also grouped; not supported")
        loop = self.loop_of[id(spec)]
        # a split's stream runs over its part, at most the axis (one part overhangs it)
        extent = min(self.extent(loop), self.grid[self.parts[ax]].size) if ax in self.parts \
            else self.extent(loop)
        chunk = self.k.size_of(loop.size, f"stream {ax}", extent)
        if isinstance(spec.chunk, sympy.Symbol):
            self.env[spec.chunk] = chunk
        plan = StreamPlan(ax, chunk, self.extent(loop), spec.rule)
        if ax in self.parts:  # split-K: the part of the whole axis this program folds
            d = self.parts[ax]
            part = self.grid[d]
            per = -(-part.tile // chunk) if part.tiles == 1 else part.tile // chunk
            if part.tiles > 1 and part.tile % chunk:
                raise NapkinError(f"split {ax}: parts of {part.tile} do not hold whole chunks "
                                  f"of {chunk} (choose a part tile that is a multiple of the "
                                  f"chunk)")
            plan = StreamPlan(ax, chunk, part.size, spec.rule, (d, per))
            self.notes.append(f"stream {ax}: split in {part.tiles} parts of {part.tile}, one "
                              f"per program, each writing its partial state")
        plan.skip = self.skip(spec, plan)
        if plan.skip is None:
            plan.skip_queries = self.skip_queries(spec, plan)
        plan.guards = chunk_guards(spec)
        if plan.guards:
            self.notes.append(f"stream {ax}: data mask{'s' * (len(plan.guards) > 1)} "
                              f"{', '.join(gd.box for gd in plan.guards)}: a chunk "
                              f"{'they keep' if len(plan.guards) > 1 else 'it keeps'} "
                              f"nothing of can be skipped (Triton: lax.cond per chunk)")
        return plan

    def inner_group(self, box) -> InnerGroupPlan:
        spec = box.spec
        loop = self.loop_of[id(spec)]
        extent = self.extent(loop)
        tile = self.k.size_of(loop.size, f"group {spec.axis}", extent)
        if not isinstance(spec.size, sympy.Symbol) and isinstance(extent, int) and tile > extent:
            # an integer group size is the body's own type: its tile would be stored past the
            # end of an output the loop writes whole (the meaning relabels the one piece to
            # the axis's length; the kernel does not)
            raise NapkinError(f"group {spec.axis}: its integer size {tile} is more than the "
                              f"axis's {extent} entries, and a loop inside the kernel would "
                              f"store past its end; give a size of at most {extent}, or a tile "
                              f"symbol")
        if isinstance(spec.size, sympy.Symbol):
            self.env[spec.size] = tile
        self.notes.append(f"group {spec.axis}: a loop inside the kernel, tiles of {tile}")
        return InnerGroupPlan(spec.axis, tile, self.extent(loop))

    def _band(self, spec, ax: str, streamed: str):
        """The causal / window masks of a stream's update over ``ax``, as the stream's
        ``streamed`` side ("k": the keys; "q": the queries, the keys a grid axis): (the other
        axis, the kinds, low, high) with kept keys of a query q in [q + low, q + high) (low
        None: from 0); None without such masks, or where the update does not absorb what they
        mask (the reason is noted)."""
        other = "q" if streamed == "k" else "k"
        masks = [b.spec for b in spec.update.boxes
                 if getattr(getattr(b, "spec", None), "kind", None) == "mask"
                 and b.spec.kind_ in ("causal", "window") and getattr(b.spec, streamed) == ax
                 and (streamed == "k" or b.spec.k in self.gaxes)]
        if not masks:
            return None
        axis = getattr(masks[0], other)
        masks = [m for m in masks if getattr(m, other) == axis]
        why = absorbing(spec.update, ax, streamed)
        if why:
            self.notes.append(f"stream {ax}: no tile skipping ({why})")
            return None
        lows = [m.offset - m.width + 1 for m in masks if m.kind_ == "window"]
        return (axis, tuple(dict.fromkeys(m.kind_ for m in masks)), max(lows) if lows else None,
                min(m.offset + 1 for m in masks))

    def skip_queries(self, spec, stream: StreamPlan) -> SkipPlan | None:
        """For a stream over the causal / window masks' query axis, in programs per tile of
        their key axis: the kept queries of key c are (c − high, c − low], so a tile of keys
        [c0, c1] needs the query chunks of [c0 − high + 1, c1 − low + 1) only — the others'
        entries are all masked, and what the update makes of them the reductions absorb."""
        band = self._band(spec, stream.axis, "q")
        if band is None:
            return None
        ka, kinds, low, high = band
        self.notes.append(f"stream {stream.axis}: tile skipping from the {stream.axis}/{ka} "
                          f"masks (the query chunks that keep a key of this {ka} tile)")
        return SkipPlan(ka, kinds, low, high, None, self.grid[self.gaxes[ka]])

    def skip(self, spec, stream: StreamPlan) -> SkipPlan | None:
        ax, s, n = stream.axis, stream.chunk, stream.size
        band = self._band(spec, ax, "k")
        if band is None:
            return None
        qa, kinds, low, high = band
        if qa in self.gaxes:
            self.notes.append(f"stream {ax}: tile skipping from the {qa}/{ax} masks")
            tile = self.grid[self.gaxes[qa]]
            if low is None:  # causal: the last query tiles see the most keys; launch them
                tile.reverse = True  # first, so the short ones fill the last wave
                self.notes.append(f"group {qa}: the heaviest tiles first")
            return SkipPlan(qa, kinds, low, high, None, tile)
        nq = self.sizes.get(qa)
        if nq is None:
            return None
        rng = [(max(0, i + low) if low is not None else 0, min(n, i + high)) for i in (0, nq - 1)]
        if any(a >= b for a, b in rng):
            return None
        self.notes.append(f"stream {ax}: static tile skipping from the {qa}/{ax} masks")
        return SkipPlan(qa, kinds, low, high, (rng[0][0] // s, -(-rng[1][1] // s)), None)


def _cuts(g, v, cut=frozenset()) -> list:
    """Where a body reads value ``v`` of its graph ``g``: for each box that reads it (or the
    body's output it is), the axes the loops around that read have cut it to — a stream's
    chunks of its axis, an inner group's tiles — as a frozenset.  A stream's input without
    its axis is loaded once, at the stream (``cut`` as it is there)."""
    out = [cut] if v in g.graph["outputs"] else []
    t = g.nodes[v]["ob"].type
    for n in set(g.successors(v)):
        node = g.nodes[n]
        spec = node["box"].spec
        for port, u in enumerate(node["ins"]):
            if u != v:
                continue
            if spec.kind in ("stream", "group") and t.has(spec.axis):
                body = view(spec.update if spec.kind == "stream" else spec.body)
                k = port + (spec.n_state if spec.kind == "stream" else 0)
                out += _cuts(body, body.graph["inputs"][k], cut | {spec.axis})
            elif spec.kind == "group":
                body = view(spec.body)
                out += _cuts(body, body.graph["inputs"][port], cut)
            else:
                out.append(cut)
    return out


def _unique(names):
    out, seen = [], set()
    for n in names:
        m, i = n, 1
        while m in seen:
            i += 1
            m = f"{n}_{i}"
        seen.add(m)
        out.append(m)
    return out
