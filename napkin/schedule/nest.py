"""The loop nest: what a streamed program does, as data.

A :class:`Schedule` is a tree of :class:`Loop` s — the program, a kernel (a box outside every
group), a group (a grid, or one more axis of the enclosing grid), a stream (a sequential fold)
and the sections of a stream (init, finalize) — whose items, in program order, are

* :class:`Buffer` — a buffer declared here (shape, dtype, level, role);
* :class:`Move` — a load into, or a store out of, a level (values and bytes per execution;
  every level it crosses);
* :class:`Step` — one primitive box executed (its arguments: buffers, or the steps whose
  results are fused into it; its flops by unit per execution);
* :class:`Assign` — the stream state taking its next value (in place);
* nested :class:`Loop` s.

A kernel (a top-level box) is built once and shared by every program that holds it (the
search meets the same kernel in state after state); a program holds it through a ``use``
loop whose ``aliases`` name this program's GMEM arrays for the kernel's placeholders.

Everything is per execution of the enclosing loop; a loop runs ``trips`` times for each
execution of its parent.  A loop that allocates (a body) also records its liveness:
``holds`` (buffer, first step, last step) at its level, and ``children`` (step, loop) whose
memory adds in at that step.  :meth:`Loop.peaks` folds that into the peak memory per level;
the cost model (``napkin.cost``) folds moves, steps and peaks into transfers, FLOPs, memory
and time, and the pseudocode (``napkin.views.pseudocode``) renders the same tree as text.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import sympy

ZERO = sympy.Integer(0)
ONE = sympy.Integer(1)


# --------------------------------------------------------------------------- peaks
def nonneg(expr) -> bool:
    """True when ``expr`` is provably >= 0 (every term has a non-negative coefficient;
    all symbols are positive sizes)."""
    e = sympy.expand(expr)
    if e.is_number:
        return bool(e >= 0)
    return all(c >= 0 for c in e.as_coefficients_dict().values())


@functools.lru_cache(maxsize=65536)
def _expanded(expr):
    return sympy.expand(expr)


@functools.lru_cache(maxsize=262144)
def _dominates(k, c) -> bool:
    """k >= c for every size, for expanded ``k`` and ``c``: every coefficient of k - c
    is non-negative (term by term; memoised: kernels' peaks meet again in every state)."""
    diff = dict(k.as_coefficients_dict())
    for term, coef in c.as_coefficients_dict().items():
        diff[term] = diff.get(term, 0) - coef
    return all(v >= 0 for v in diff.values())


def prune(cands: list) -> list:
    """Drop candidates that another candidate provably dominates; keep distinct ones."""
    cands = [_expanded(c) for c in cands]
    keep: list = []
    for c in cands:
        if any(_dominates(k, c) for k in keep):
            continue
        keep = [k for k in keep if not _dominates(c, k)]
        keep.append(c)
    return keep or [ZERO]


def as_max(cands: list):
    cands = prune(cands)
    # evaluate=False: the candidates are already pruned, and Max's own
    # simplification (pairwise zero-finding) is the slowest thing in the model
    return cands[0] if len(cands) == 1 else sympy.Max(*cands, evaluate=False)


@dataclass
class Peak:
    """Candidate peaks (values, bytes) at one level: the peak is the max of the list."""
    vals: list = field(default_factory=list)
    byts: list = field(default_factory=list)

    def add(self, v, b) -> Peak:
        return Peak([x + v for x in self.vals or [ZERO]], [x + b for x in self.byts or [ZERO]])

    def merge(self, other: Peak) -> None:
        self.vals = prune(self.vals + other.vals)
        self.byts = prune(self.byts + other.byts)

    def copy(self) -> Peak:
        return Peak(list(self.vals), list(self.byts))


def merge_peaks(dst: dict, src: dict) -> None:
    for lv, pk in src.items():
        if lv in dst:
            dst[lv].merge(pk)
        else:
            dst[lv] = pk.copy()


# --------------------------------------------------------------------------- items
@dataclass(eq=False)
class Buffer:
    """An array held at one level: a whole array (GMEM), a tile, a chunk, state or a temp."""
    array: str                 # the wire it holds
    name: str                  # what a listing calls it (made unique when rendered)
    axes: tuple                # ((axis, size), ...), sizes symbolic
    dtype: str
    level: str
    values: sympy.Expr
    bytes: sympy.Expr
    role: str                  # "array" | "tile" | "chunk" | "state" | "temp" | "next"
    base: dict                 # axis -> enclosing loops over it when made (for views)
    note: str = ""             # input, output, intermediate, held for a later box, state
    counted: bool = True       # held in the peak (intermediates=False leaves temps out)
    in_place_of: Buffer | None = None
    declared: bool = True      # declared where it appears (False: the caller's, or a view)
    stages: int = 1            # copies in flight (a streamed chunk under software pipelining)


@dataclass(eq=False)
class Move:
    """One load (into ``dst``) or store (out of ``src``), per execution."""
    kind: str                  # "load" | "store"
    array: str
    values: sympy.Expr
    bytes: sympy.Expr
    levels: tuple              # every level it crosses into / out of
    src: Buffer
    dst: Buffer


@dataclass(eq=False)
class Step:
    """One primitive box, per execution: reads ``args`` (a Buffer, or a fused Step whose
    value is computed inline), writes ``outs`` (Buffers; None where fused)."""
    box: object
    args: tuple
    outs: list
    flops: dict                # unit -> FLOPs per execution
    fused: bool = False        # its only output is read by one elementwise box only

    @property
    def spec(self):
        return self.box.spec


@dataclass(eq=False)
class Assign:
    """The stream state takes its next value (``mu, z = mu', z'``), in place."""
    pairs: tuple               # ((state Buffer, next Buffer), ...)


@dataclass(eq=False)
class Loop:
    """A loop or section of the nest (see the module doc)."""
    kind: str                  # "program" | "kernel" | "group" | "stream" | "section" | "use"
    level: str
    axis: str = ""
    size: object = None        # the tile (group size or chunk)
    full: object = None        # the extent of the axis it tiles
    trips: sympy.Expr = ONE
    parallel: bool = False
    where: str = ""            # how the iterations are spread (a grid over SMs, ...)
    note: str = ""             # a section's or kernel's caption
    name: str = ""             # a kernel's box
    items: list = field(default_factory=list)
    # a "use" holds one kernel shared between programs (built once, never mutated): the GMEM
    # arrays it reads and writes are this program's, by these aliases of its placeholders
    aliases: dict = field(default_factory=dict)
    # liveness (bodies only): the level index buffers are held at, how many steps the body
    # has, what it holds when, and the nested loops whose memory adds in at a step
    at: int = -1
    steps: int = 0
    # (values, bytes, first, last, staged): staged = a tile moved in from a level above for
    # a contraction to read (a GPU stages those in shared memory; the rest, values computed
    # here and tiles only elementwise boxes read, it keeps in registers)
    holds: list = field(default_factory=list)
    children: list = field(default_factory=list)   # (step, Loop)
    merge_only: bool = False   # the program and GMEM-level groups: kernels side by side
    # a stream's memory besides its update body: its state, one chunk, init and finalize
    state: tuple = (ZERO, ZERO)
    chunk: tuple = (ZERO, ZERO)
    staged: tuple = (ZERO, ZERO)   # of the chunk, what contractions read
    scratch: sympy.Expr = ZERO     # bytes of shared memory a chunk's layout conversion takes
    # bytes of the chunks only elementwise boxes read on their way into a product: a
    # compiler's software pipeline (Triton at 2 or more stages) copies each to shared memory,
    # one buffer apiece (a product's own operand takes one a stage: ``staged``)
    pipelined: sympy.Expr = ZERO
    # a stream's overlap: which of its step's work may run during the next step, in words
    # ("" where none: napkin.schedule.overlap)
    overlap: str = ""
    init: Loop | None = None
    finalize: Loop | None = None

    def walk(self, mult=ONE):
        """(item, multiplier) for every item below, in order; the multiplier is the
        product of the trip counts of the loops around the item (this one's included)."""
        m = mult * self.trips
        for it in self.items:
            yield it, m
            if isinstance(it, Loop):
                yield from it.walk(m)

    def peaks(self, part: str = "all") -> dict:
        """{level index: Peak}: the most memory live at once per instance of each level,
        for one execution of this loop (its nested loops folded in).

        ``part``: "all" (everything held), "staged" (tiles and chunks moved in from above
        for a contraction to read: what a GPU stages in shared memory) or "held" (the rest:
        values made here, the streams' state, tiles only elementwise boxes read — what a
        GPU keeps in registers)."""
        if self.merge_only:
            out: dict = {}
            for _, child in self.children:
                merge_peaks(out, child.peaks(part))
            return out
        # a hold's last field: True staged, False held, "registers" a transient a kernel
        # keeps in registers only (a multiply-and-sum's broadcast product), "smem" one it
        # keeps in shared memory only (a computed operand stored for a product)
        keep = {"all": (True, False), "staged": (True, "smem"),
                "held": (False, "registers")}[part]
        at_step: dict = {}
        deeper: dict = {}
        for step, child in self.children:
            if child.kind == "stream":
                here, deep = child.stream_peaks(part)
                at_step.setdefault(step, []).append(here)
                merge_peaks(deeper, deep)
                continue
            pk = child.peaks(part)
            if child.at == self.at and self.at in pk:
                at_step.setdefault(step, []).append(pk.pop(self.at))
            merge_peaks(deeper, pk)
        here = Peak()
        for i in range(max(self.steps, 1)):
            live = [h for h in self.holds if h[2] <= i <= h[3] and h[4] in keep]
            vals = sum((h[0] for h in live), ZERO)
            byts = sum((h[1] for h in live), ZERO)
            if i in at_step:
                for pk in at_step[i]:
                    here.merge(pk.add(vals, byts))
            else:
                here.merge(Peak([vals], [byts]))
        out = dict(deeper)
        if self.at in out:
            out[self.at].merge(here)
        else:
            out[self.at] = here
        return out

    def stream_peaks(self, part: str = "all") -> tuple[Peak, dict]:
        """A stream's memory at its level (state + max(update + one chunk, finalize)) and
        the deeper levels of its bodies (``part`` as in :meth:`peaks`)."""
        up, fin, init = self.peaks(part), self.finalize.peaks(part), self.init.peaks(part)
        chunk = {"all": self.chunk, "staged": (self.staged[0], self.staged[1] + self.scratch),
                 "held": tuple(a - b for a, b in zip(self.chunk, self.staged))}[part]
        state = self.state if part != "staged" else (ZERO, ZERO)
        here = Peak()
        here.merge(up.pop(self.at, Peak()).add(*chunk))
        here.merge(fin.pop(self.at, Peak()))
        init.pop(self.at, None)
        deeper: dict = {}
        for body in (up, fin, init):
            merge_peaks(deeper, body)
        return here.add(*state), deeper


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class TileInfo:
    """A tile-size symbol of the program: a group size g_a or a stream chunk s_x."""
    symbol: sympy.Symbol
    kind: str                 # "group" | "stream"
    axis: str
    full: sympy.Expr          # the size of the axis it tiles (may hold other symbols)
    level: str                # memory level where the tiles live
    multiples: tuple = ()     # ((reason, multiple), ...): divisibility the hardware asks for
    shared: tuple = ()        # ((reason, multiple, cofactor), ...): asked of tile × cofactor

    @property
    def multiple(self) -> int:
        """What the tile alone must divide by, whatever the sizes."""
        return math.lcm(1, *(m for _, m in self.multiples))

    def least(self, sizes) -> int:
        """The tile's divisibility at ``sizes``: a demand shared with other axes (a dot's
        merged rows) asks the tile for what their sizes leave; a cofactor the sizes do not
        fix (another tile) leaves the tile the whole multiple."""
        out = self.multiple
        for _, m, cofactor in self.shared:
            v = cofactor.xreplace({f: sympy.Integer(int(sizes[f.name]))
                                   for f in cofactor.free_symbols if f.name in sizes})
            out = math.lcm(out, m // math.gcd(m, int(v)) if v.is_Integer and v > 0 else m)
        return out

    def to_json(self):
        return {"kind": self.kind, "axis": self.axis, "full": str(self.full), "level": self.level,
                "multiple": self.multiple, "multiples": {r: m for r, m in self.multiples},
                "shared": [[r, m, str(c)] for r, m, c in self.shared]}


@dataclass(frozen=True)
class ContractionRecord:
    """One contraction of the program, for the lower bounds: its whole iteration space
    (product of every axis, all groups and chunks together), the product of the sizes it
    reduces per execution, and the stream it sits in (rule, axis) if any."""
    name: str
    iterations: sympy.Expr
    reduced: tuple
    reduced_size: sympy.Expr
    stream_rule: str | None
    stream_axis: str | None
    matmul_like: bool = False   # two inputs, each with an output axis of its own, and a sum


@dataclass
class Schedule:
    """A streamed program on a hardware profile, as one loop nest (see the module doc)."""
    program: object
    hardware: object
    dtype: object
    intermediates: bool
    levels: tuple              # level names, top first
    root: Loop
    tiles: dict                # Symbol -> TileInfo
    contractions: list
    streams: list              # (rule, axis) of every stream
    top_values: tuple          # every array of the top-level diagram (it all lives in GMEM)
    stages: int = 1            # chunk buffers in flight per stream (software pipelining)

    def walk(self):
        return self.root.walk()

    @functools.cached_property
    def memory(self) -> dict:
        """{level name: (values candidates, bytes candidates)}: the peak is their max."""
        peaks = self.root.peaks()
        out = {}
        for i, lv in enumerate(self.levels):
            if i == 0:
                vals = sympy.expand(sum((b.values for b in self.top_values), ZERO))
                byts = sympy.expand(sum((b.bytes for b in self.top_values), ZERO))
                out[lv] = ([vals], [byts])
            else:
                pk = peaks.get(i, Peak())
                out[lv] = (prune(pk.vals or [ZERO]), prune(pk.byts or [ZERO]))
        return out
