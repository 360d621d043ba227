"""Search: the chain of rule applications that minimises modelled time.

The state space is a networkx DiGraph: nodes are programs, identified up to the
order of independent boxes (napkin.search.canonical: a hash-consed canonical form, with
an isomorphism check behind it, so two chains reaching the same program meet in
one node); edges are rule applications (rule, site, parameters).  Tile sizes
stay symbolic (g_q, s_x) during the structural search; every state gets its tiles from the cost
model's optimiser (napkin.cost.optimize_tiles) for the given sizes and
hardware.

Best-first: the frontier is ordered by the state's own optimised time, and a
state is expanded only while an admissible lower bound — the compulsory
traffic (read every input and write every output once at the top level) and
the FLOPs at peak throughput, which no rewrite can beat — is below the best
time found; states that do not fit yet are ordered by how far their boxes
overflow the chip.  Limits on states and seconds are reported in the result when
hit, never silently.  There is no algorithm-specific code here: every move comes
from a rule's ``candidates``, and the search reads the traits a rule declares
(:class:`rewrites.base.Rule`), never its name.

Two moves that rewrite disjoint boxes commute; the second order is skipped when
the first is checked to reach the same program (a partial-order reduction).
Over the whole memory hierarchy the search runs in two phases: the structure
over two levels, then the level refinements of the best structures.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import heapq
import itertools
import math
import os
import time
from dataclasses import dataclass, field

import networkx as nx
import sympy

from napkin.search.pieces import sourceless, top_boxes
from napkin.search.canonical import canonical_hash, same_program
from napkin.certify.certificate import fingerprint, render
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, primitive_boxes, view
from napkin.core.retile import untied
from napkin.cost import cost, optimize_tiles, value_at
from napkin.cost.model import bytes_per_value, compute_times, sym_subs
from napkin.cost.separable import grid_for
from napkin.hardware import DTYPE_BYTES, get_hardware
from napkin.core.region import Site, body_at
from rewrites import RULES

# A callable (states, best modelled seconds, elapsed seconds) the search calls about once a
# second while it runs (the CLI shows it on a terminal); None: silent.
PROGRESS = None
PATIENCE = 110  # states costed without a better program before the search stops (see search)
SIGNIFICANT = 0.005  # a better program resets the patience when it is this much faster


@dataclass(frozen=True)
class Move:
    rule: str
    site: Site
    params: tuple  # sorted (key, value) pairs, hashable
    # what it rewrites: rule, parameters and the ids of the boxes at the site (the same
    # rewrite of the same boxes in two states has one ident); not part of equality
    ident: tuple = field(default=(), compare=False, repr=False)

    @property
    def params_dict(self) -> dict:
        return dict(self.params)

    def to_json(self) -> dict:
        return {"rule": self.rule, "site": self.site.to_json(), "params": self.params_dict}

    def __str__(self):
        ps = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.rule}({ps}) at {self.site}"


@dataclass
class State:
    key: str
    program: object
    chain: tuple[Move, ...]
    _tiles: object = None         # napkin.cost.Tiles, filled on first use (see ``tiles``)
    _report: object = None        # the Evaluator that fills them
    time_s: float = math.inf
    feasible: bool = False
    min_memory: dict = field(default_factory=dict)
    error: str | None = None
    unlowerable: str | None = None  # why no kernel backend writes it yet ("" when one does;
                                    # None until asked)
    frozen: bool = False          # its top level is final: every top-level move is refused or
                                  # leads to a program no backend writes, here and (rules only
                                  # nest, premises only tighten) in all it derives below
    pruned: float = 0.0           # not costed: nothing derived from it that a backend writes
                                  # beats this time (the best when it was reached)
    cost: object = None           # napkin.cost.Cost (symbolic)
    grid: object = None           # napkin.cost.Grid or Parts (every tiling, evaluated)
    bytes: float = math.inf       # bytes moved at the main level, at the best tiles
    excess: tuple = (math.inf, math.inf)  # while it does not fit: (boxes' overflow,
                                          # kernels' smallest memory), summed
    bound_by: str = ""
    tile_values: dict = field(default_factory=dict)
    best_point: object = None     # the grid point of those tiles (Parts: a tuple)
    found_s: float = 0.0          # seconds into the search when it was reached
    parent: "State | None" = field(default=None, repr=False)  # the state it was first reached from
    via: Move | None = None       # ... by this move
    moves: list | None = field(default=None, repr=False)      # its moves, once listed
    children: dict = field(default_factory=dict, repr=False)  # move ident -> child key
    applied: dict = field(default_factory=dict, repr=False)   # top-level move ident -> program

    @property
    def tiles(self):
        """The full optimum (integer tiles, continuous optimum, canonical form, bounds),
        worked out when first asked for: the search itself needs only the grid."""
        if self._tiles is None and self._report is not None:
            self._report.report(self)
        return self._tiles

    @tiles.setter
    def tiles(self, value):
        self._tiles = value


@dataclass
class SearchResult:
    algorithm: object
    best: State
    alternatives: list[State]
    states: int
    expanded: int
    seconds: float
    limit_hit: str | None
    graph: nx.DiGraph
    lower_bound_s: float
    refused: dict = field(default_factory=dict)  # (rule, axis) -> why, at the algorithm itself
    commuted: int = 0  # moves not applied: their program is reached in the other order
    hardware: object = None  # the profile as searched (its GMEM + SMEM view for levels="two")
    pruned: int = 0  # states reached but never costed: nothing derived from them could win
    note: str = ""   # why the best is slow, when it is the one-kernel-per-box fallback
    stopped: str | None = None  # the search stopped by its patience (not a limit): why

    @property
    def first_fit_s(self) -> float:
        """Seconds into the search when the first program that fits was reached (a search
        stopped by its limits still hands back the best it found by then)."""
        return min(self.graph.nodes[n]["state"].found_s for n in self.graph.nodes
                   if self.graph.nodes[n]["state"].feasible)

    def reason_loses(self, alt: State) -> str:
        """Why an alternative is worse than the best, in words."""
        b = self.best
        if not alt.feasible:
            return f"does not fit on chip ({_mem_text(alt.min_memory)} at its smallest tiles)"
        if alt.error:
            return f"cannot be costed: {alt.error}"
        ratio = alt.time_s / b.time_s if b.time_s else math.inf
        parts = [f"{ratio:.2f}× the time"]
        if b.bytes:
            parts.append(f"{alt.bytes / b.bytes:.2f}× the bytes moved")
        parts.append(f"bound by {alt.bound_by}")
        idle = self._idle(alt) if ratio > 1 + 1e-9 and alt.bytes < b.bytes else ""
        if idle:
            parts.append(idle)
        if alt.unlowerable and not b.unlowerable:
            parts.append(f"and no kernel backend writes it yet ({alt.unlowerable})")
        elif ratio <= 1 + 1e-9:
            parts.append("no faster, and a longer chain")
        return ", ".join(parts)


    def _idle(self, alt: State) -> str:
        """Where an alternative that moves fewer bytes loses on the chip's occupancy: a
        kernel of it with fewer blocks than the chip has SMs (a single head's 4096 queries
        in tiles of 128 are 32 blocks), in words; "" when none."""
        if alt._report is None:
            alt._report = self.best._report
        launches = getattr(alt.tiles, "launch", None) or []
        try:
            sms = self.hardware.instances(self.hardware.levels[1].name)
        except (AttributeError, IndexError, ValueError):
            return ""
        short = [k for k in launches if isinstance(k.get("blocks"), (int, float))
                 and k["blocks"] < sms]
        if not short:
            return ""
        k = min(short, key=lambda k: k["blocks"])
        return (f"its kernel {k.get('kernel', '')} runs {int(k['blocks'])} blocks on {sms} SMs "
                f"(the rest of the chip idles)")


def _mem_text(mem: dict) -> str:
    return ", ".join(f"{lv} {v / 1024:.0f} KiB" for lv, v in mem.items()) or "?"


def _group_paths(program, path=()):
    """Every path to a group body, the root included."""
    yield tuple(path)
    g = view(body_at(program, path))
    for i, n in enumerate(op_order(g)):
        if g.nodes[n]["box"].spec.kind == "group":
            yield from _group_paths(program, (*path, i))


def _grouped_axes(program, path) -> set[str]:
    axes, d = set(), program
    for i in path:
        g = view(d)
        spec = g.nodes[op_order(g)[i]]["box"].spec
        axes.add(spec.axis)
        d = spec.body
    return axes


def moves(program, rules=None, refused: dict | None = None, levels=None):
    """Every applicable rule application (premises checked).  ``refused``, if
    given, collects ``{(rule, axis): reason}`` for proposals whose premises fail."""
    rules = rules or {k: v for k, v in RULES.items()
                      if v.subsumed_by is None and not v.eager and not v.rooted}
    for path in _group_paths(program):
        taken = _grouped_axes(program, path)
        g = view(body_at(program, path))
        boxes = [g.nodes[n]["box"] for n in op_order(g)]
        for name, rule in rules.items():
            try:
                proposed = list(rule.candidates(program, path))
            except Exception as e:  # noqa: BLE001 - a rule that cannot propose is a refusal
                if refused is not None:
                    refused.setdefault((name, None), _why(e))
                continue
            for site, params in proposed:
                if levels is not None and params.get("level", levels[-1]) not in levels:
                    continue  # a level this hierarchy does not have
                if rule.groups_axis:
                    if params.get("axis") in taken:
                        continue  # re-tiling a tiled axis at the same level: no new program
                    if not _canonical_nesting(program, path, site, params["axis"]):
                        continue
                try:
                    rule.check(program, site, params)
                except Exception as e:  # noqa: BLE001 - a refusal, whatever raised it
                    if refused is not None:
                        refused.setdefault((name, params.get("axis")), _why(e))
                    continue
                ps = tuple(sorted(params.items()))
                yield Move(name, site, ps, (name, ps, tuple(id(boxes[i]) for i in site.ops)))


# NAPKIN_STRICT=1 (the test suite sets it): an exception other than NapkinError while costing
# a program is raised, not taken as the program's refusal — an AttributeError in the cost
# model once silently changed every program the search chose
STRICT = os.environ.get("NAPKIN_STRICT") == "1"


def _why(e: Exception) -> str:
    """A refusal's reason: a premise's own words, or what a rule that crashed raised."""
    return str(e) if isinstance(e, NapkinError) else f"the rule failed: {type(e).__name__}: {e}"


def _single_group(body):
    """The spec of the only box of ``body`` when it is a group, else None."""
    g = view(body)
    order = op_order(g)
    if len(order) == 1 and g.nodes[order[0]]["box"].spec.kind == "group":
        return g.nodes[order[0]]["box"].spec
    return None


def _canonical_nesting(program, path, site, axis) -> bool:
    """Symmetry reduction: two whole-body groups nested directly in one another
    form one grid whatever their order (same cost, same further rewrites), so
    only the order with the outer axis first alphabetically is explored."""
    body = body_at(program, path)
    if len(site.ops) != len(op_order(view(body))):
        return True
    inner = _single_group(body)
    if inner is not None and inner.axis < axis:
        return False  # wrapping a lone group: keep outer < inner
    if path:
        outer = _single_group(body_at(program, path[:-1]))
        if outer is not None and axis < outer.axis:
            return False  # filling a lone group's body: keep outer < inner
    return True


def apply_move(program, move: Move):
    return RULES[move.rule].apply(program, move.site, move.params_dict)


def _rooted(start) -> list:
    """(program, chain) for each application of a rooted rule
    (:attr:`rewrites.base.Rule.rooted`) to the eager start: each the root of a search of
    its own (``_search``)."""
    program, chain = start
    out = []
    for name, rule in RULES.items():
        if not rule.rooted:
            continue
        for site, params in rule.candidates(program):
            try:
                new = rule.apply(program, site, dict(params))
            except NapkinError:
                continue
            out.append((new, (*chain, Move(name, site, tuple(sorted(params.items()))))))
    return out


def eager_moves(diagram, limit: int = 200) -> tuple:
    """(program, chain): the eager rules (:attr:`rewrites.base.Rule.eager`: recognition of
    hand-written forms, recomputation of a value a reduction needs a copy of) applied
    wherever they apply, the largest site first, until none does — the start of every chain
    the search makes, so it branches only on partitions."""
    program, chain = diagram, []
    eager = {k: r for k, r in RULES.items() if r.eager}
    for _ in range(limit):
        for name, rule in eager.items():  # the largest site first: a match inside another
            for site, params in sorted(rule.candidates(program),  # is the lesser reading
                                       key=lambda c: -len(c[0].ops)):
                try:
                    new = rule.apply(program, site, dict(params))
                except NapkinError:
                    continue
                chain.append(Move(name, site, tuple(sorted(params.items()))))
                program = new
                break
            else:
                continue
            break
        else:
            return program, tuple(chain)
    raise NapkinError(f"the eager rules did not settle within {limit} moves")


class Evaluator:
    """Cost of a program for fixed sizes and hardware."""

    def __init__(self, hardware, sizes: dict, dtype=None, objective: str = "time",
                 levels: str = "two"):
        hw = get_hardware(hardware)
        self.hw = hw.two_level() if levels == "two" and len(hw.levels) > 2 else hw
        # level names the rules may use: a two-level profile keeps its on-chip level
        # under the name the rules know ("smem")
        self.levels = [lv.name.split("[")[0] for lv in self.hw.levels]
        self.sizes, self.dtype, self.objective = dict(sizes), dtype, objective

    def writability(self, state: State) -> str:
        """Why no kernel backend writes the state's program ("" when one does); cheap next
        to costing it, so the search asks first."""
        if state.unlowerable is None:
            from napkin.lower.backends import get_backend  # (jax: imported once, when used)
            from napkin.lower.plan import unlowerable
            state.unlowerable = unlowerable(state.program, self.sizes, get_backend().rules)
        return state.unlowerable

    def __call__(self, state: State) -> None:
        """Integer-optimal tiles and their time (the cheap part: one numpy grid)."""
        try:
            self.writability(state)
            # priced with each kernel's tiles its own (the chain the search reports ends
            # with the move that names them so: rewrites.untie)
            priced = untied(state.program)[0]
            c = cost(priced, self.hw, self.dtype)
            grid = grid_for(c, self.sizes, self.objective)
            best, feasible = grid.best(self.objective)
            state.cost, state.grid = c, grid
            state.feasible = feasible
            if feasible:  # (a program that does not fit has no time, nor traffic to price)
                at = grid.summary(best, memory=False)
                state.time_s, state.bytes = at["time_s"], at["transfers_bytes"]
                state.bound_by = at["bound_by"]
            state.tile_values = grid.values(best)
            state.best_point = best
            state.min_memory = grid.shortfall(launch=self.objective == "time")
            if not feasible:  # how far from fitting: every box's own arrays beyond the
                # smallest capacity (each layer of a stack counts: the kernels' peaks alone
                # are one per shape, blind to one layer fixed), then every kernel's need
                launches = grid.launches if self.objective == "time" else None
                state.excess = (self.overflow(priced, {**self.sizes, **state.tile_values})
                                + (launches.excess if launches is not None else 0.0),
                                sum(m for least in grid.mem_least.values() for m in least))
            if grid.n >= SLIM_POINTS:  # kept: the best point and what the search reads
                grid.slim()
        except Exception as e:  # noqa: BLE001 - a program that cannot be costed is not chosen
            if STRICT and not isinstance(e, NapkinError):
                raise  # a defect of the cost model, not a program's: seen, not skipped
            state.error = _why(e)
            if state.unlowerable is None:
                state.unlowerable = ""

    def overflow(self, program, values: dict) -> float:
        """Bytes by which each primitive box's arrays (at these sizes and tiles) exceed
        the smallest on-chip capacity, summed over every box at every depth."""
        caps = [lv.capacity_bytes for lv in self.hw.levels[1:] if lv.capacity_bytes]
        cap = min(caps) if caps else math.inf
        total = 0.0
        for box in primitive_boxes(program):
            need = sum(_numel(ob.type, values) * self._bytes_per_value(ob)
                       for ob in (*box.dom.inside, *box.cod.inside))
            total += max(0.0, need - cap)
        return total

    def nbytes(self, ob) -> float:
        """Bytes of the array ``ob`` at these sizes and dtype."""
        return _numel(ob.type, self.sizes) * self._bytes_per_value(ob)

    def _bytes_per_value(self, ob) -> int:
        return DTYPE_BYTES.get(self.dtype if isinstance(self.dtype, str) else ob.type.dtype, 4)

    def report(self, state: State) -> None:
        """The full optimum (continuous optimum, canonical form, bound ratio)."""
        if state._tiles is None and getattr(state, "cost", None) is not None:
            state._tiles = optimize_tiles(state.cost, sizes=self.sizes, objective=self.objective,
                                         grid=state.grid)

    def lower_bound(self, diagram) -> float:
        """Compulsory traffic and compute at peak: no streamed program beats this.  Every
        matrix product counts at the tensor cores' rate, batched or not (a program the
        rules derive may take the batch axis out of the kernel's body)."""
        flops: dict = {}
        for box in primitive_boxes(diagram):
            ins = tuple(ob.type for ob in box.dom.inside)
            outs = tuple(ob.type for ob in box.cod.inside)
            unit = box.spec.unit(ins, outs)
            if unit == "tensor":
                unit += ":" + max((self.dtype if isinstance(self.dtype, str) else ob.type.dtype
                                   for ob in box.dom.inside), key=bytes_per_value)
            flops[unit] = flops.get(unit, 0) + box.spec.flops(ins, outs)
        compute = max([value_at(e, self.sizes) for e in compute_times(flops, self.hw).values()]
                      or [0.0])
        return max(self._bytes([*diagram.dom.inside, *diagram.cod.inside]) /
                   self.hw.levels[1].bandwidth_bytes_per_s, compute)

    def written_bound(self, program, frozen: bool = False) -> float:
        """What every program derived from ``program`` that a backend writes moves through
        HBM, in seconds: the program's inputs and outputs once, and twice each value one
        kernel hands another that no rewrite can keep on chip — a top-level group's output
        another top-level box reads, a top-level group's input along its axis that another
        box computes.  Rewrites only nest boxes: were the two kernels ever one, the group
        would be inside a kernel whose other boxes read its outputs (or compute its
        input), which no backend writes (:class:`napkin.lower.plan.Refusal`, final).

        ``frozen``: no rewrite at the top level leads to a program a backend writes
        (:attr:`State.frozen`), so every top-level box stays a kernel of its own and
        every value between two of them goes through HBM.  A value handed on that is also
        a program output is written once (counted with the outputs) and read once more."""
        g = view(program)
        handed = set()
        for n in op_order(g):
            node = g.nodes[n]
            spec = node["box"].spec
            if frozen:
                handed.update(v for v in node["outs"] if list(g.successors(v)))
                continue
            if spec.kind != "group":
                continue
            handed.update(v for v in node["outs"] if list(g.successors(v)))
            handed.update(v for v in node["ins"] if list(g.predecessors(v))
                          and g.nodes[v]["ob"].type.has(spec.axis))
        outputs = set(g.graph["outputs"])
        io = [*program.dom.inside, *program.cod.inside]
        moved = self._bytes(io) + sum((1 if v in outputs else 2) * self._bytes([g.nodes[v]["ob"]])
                                      for v in handed)
        return moved / self.hw.levels[1].bandwidth_bytes_per_s

    def _bytes(self, obs) -> float:
        return sum(self._least_numel(ob.type.numel) * self._bytes_per_value(ob) for ob in obs)

    def _least_numel(self, numel) -> float:
        """Entries of an array at these sizes; one whose size a tile sets (a split's partial
        states, one per part) at its least, the tile at its largest (a lower bound)."""
        expr = sym_subs(sympy.sympify(numel), self.sizes)
        if not expr.free_symbols:
            return float(expr)
        return float(max(expr.xreplace({s: sympy.oo for s in expr.free_symbols}), 0))


def search(diagram, hardware="h100", sizes=None, dtype=None, *, max_states: int = 2000,
           max_seconds: float = 60.0, objective: str = "time", keep: int = 5,
           levels: str = "two", commute: bool = True, prune: bool = True,
           patience: int | None = PATIENCE) -> SearchResult:
    """Best-first search for the fastest streamed program of ``diagram``.

    ``levels``: "two" (GMEM + SMEM, the paper's setting) or "all" (the
    profile's whole hierarchy).  "all" searches in two phases: the structure
    (which regions become kernels, groups and streams) over two levels, then the
    level refinements of the best structures — groups moved down to registers,
    axes re-tiled inside existing kernels — over the whole hierarchy.  Searching
    every level assignment of every structure at once grows the space about
    thirtyfold for attention (1798 states against 68) and finds the same optimum.

    ``prune``: leave uncosted the states from which nothing a backend writes can beat the
    best found (off: every state reached is costed and bounded as it is popped, by its
    written bound alone, as before the frozen top level; for checking the pruning).

    ``patience``: stop once this many states have been costed since the best last
    improved by more than 0.5 % (a program a backend writes that fits found;
    ``SearchResult.stopped`` says so);
    None searches until the frontier is empty or a limit is hit.  Most of an exhaustive
    search's time goes to proving that a best found early stays best: differential
    attention's was reached at 40 states of 2000.

    ``commute``: apply two moves that rewrite disjoint boxes in one order only (a
    partial-order reduction, checked move by move); off, every order is applied and
    the duplicates meet in one state by their canonical form."""
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int)
                                 or patience < 1):
        raise NapkinError(f"patience must be a positive integer or None, got {patience!r}")
    question = _question(diagram, hardware, sizes, dtype, max_states, max_seconds, objective,
                         keep, levels, commute, prune, patience)
    if question is not None and question in _ANSWERS:
        _ANSWERS.move_to_end(question)
        return _ANSWERS[question]
    with _collector_paused():
        answer = _search(diagram, hardware, sizes, dtype, max_states, max_seconds, objective,
                         keep, levels, commute, prune, patience)
    if question is not None:
        _ANSWERS[question] = answer
        while len(_ANSWERS) > ANSWERS_KEPT:
            _ANSWERS.popitem(last=False)
    return answer


# A search answers a question: the program (its canonical text with its labels, so the
# answer's programs carry the asker's names), the hardware as loaded, the sizes, the dtype,
# the limits and the rules.  The same question asked again in a process (a notebook cell run
# twice, the backward of a kernel fitted again, a device plan pricing several strategies on
# one block) is handed the first answer — the last few kept, each holding its search graph.
ANSWERS_KEPT = 16
_ANSWERS: collections.OrderedDict = collections.OrderedDict()


def forget_searches() -> None:
    """Drop the answers kept in this process (after changing a rule in place: a test's
    monkeypatch, a rule being developed), so the next search runs afresh."""
    _ANSWERS.clear()


def _question(diagram, hardware, sizes, dtype, *limits):
    try:
        text = render(diagram, labels=True)
        hw = get_hardware(hardware)
        hash(hw)
    except (TypeError, NapkinError):  # not a program of primitives, or an unhashable profile
        return None
    return (text, hw, tuple(sorted((k, str(v)) for k, v in (sizes or {}).items())), str(dtype),
            limits, tuple(RULES))


@contextlib.contextmanager
def _collector_paused():
    """The search allocates millions of short-lived objects while the memos hold many
    long-lived ones; Python's cyclic collector would re-traverse those again and again
    (about a third of the search's time).  Reference counting still frees everything
    that is not in a cycle; the collector runs again as soon as the search returns."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# the share of the time limit the pieces of a large program get (napkin.search.pieces)
PIECES_SHARE = 0.5


def in_pieces(start, ev, max_states: int, seconds: float, patience: int | None = None):
    """napkin.search.pieces.searched_in_pieces with this engine's search, completion and moves:
    (program, chain), or None for a small program.  ``patience`` stops a piece's search too
    (a piece that has its answer leaves its time to the pieces after it)."""
    from napkin.search.pieces import searched_in_pieces
    return searched_in_pieces(
        start, ev, max_states, seconds, apply=apply_move, complete=each_box_partitioned,
        search=lambda sub, states, secs, since: _best_first(
            [sub, *_apart((sub, ()), ev)], ev, states, secs, since, algorithm=sub,
            patience=patience).best)


# the share of the time limit the search of one index of a mapped diagram gets
MAPPED_SHARE = 0.25
ROOTED_SHARE = 0.25  # of max_seconds, for the search from each rooted rule's application


def per_index(start, ev, max_states: int, seconds: float, patience: int | None = None):
    """napkin.search.mapped.searched_per_index with this engine's search: (program, chain),
    or None for a diagram mapped over no axis of more than one index."""
    from napkin.search.mapped import searched_per_index

    def search(sizes):
        one = Evaluator(ev.hw, sizes, ev.dtype, ev.objective, "two")
        return _best_first([start], one, max_states, seconds, time.perf_counter(),
                           algorithm=start[0], patience=patience).states()
    return searched_per_index(start, ev.sizes, search, RULES,
                              lambda rule, site, params: Move(rule, site,
                                                              tuple(sorted(params.items()))))


def _search(diagram, hardware, sizes, dtype, max_states, max_seconds, objective, keep, levels,
            commute, prune, patience):
    t0 = time.perf_counter()
    start = eager_moves(diagram)
    two = Evaluator(hardware, sizes or {}, dtype, objective, "two")
    # a program of many boxes: its pieces searched first, their chains replayed on it (a
    # runnable program early); the search then starts from that program and the algorithm
    pieced = in_pieces(start, two, max_states, PIECES_SHARE * max_seconds, patience)
    # (every top-level box of the pieced program is a kernel: the search refines those;
    # from the algorithm itself, a program that large has more first moves than it can try)
    # every box a kernel of its own, values between them in HBM, always runs: a root of
    # every search, so no answer is slower (the group moves take the largest region, and a
    # search's patience can end among one-kernel programs that spill); from the algorithm
    # as written too, where the eager recomputations would cost such a program a pass more
    # (built only where an eager move changed it: the same program twice is one root)
    apart = _apart(start, two) + ([_each_box((diagram, ()), two)] if start[1] else [])
    roots = [start, *apart] if pieced is None else [pieced, *apart]

    limits = dict(commute=commute, prune=prune, patience=patience, algorithm=diagram)

    def searched(ev, roots_, **kw):
        run = _best_first(roots_, ev, max_states, max_seconds, t0, **limits, **kw)
        if kw:  # (a refinement: its seeds hold the mapped program already)
            return run
        # a rooted rule's choices (a sum split in two): each searched from on its own, as
        # one more root beside the others ends where the patience lets them (ALiBi's
        # dslopes kept its 2.9 ms program beside a 0.39 ms one reached from the split)
        for root in _rooted(start):
            run.absorb(_best_first([root], ev, max_states, ROOTED_SHARE * max_seconds,
                                   time.perf_counter(), **limits))
        # a diagram mapped over axes (MHA's heads): one index's program, a block per index,
        # searched from on its own where it beats the search's answer (a root beside the
        # others changes what the patience lets the search reach: GQA decoding's answer
        # fell from 0.065 to 0.153 ms)
        # (not for a program of a few launches' time: there is little a second search wins)
        if run.best.feasible and few_launches(run.best, ev.hw):
            return run
        mapped = per_index(start, ev, max_states, MAPPED_SHARE * max_seconds, patience)
        if mapped is not None:
            probe = _best_first([mapped], ev, 1, max_seconds, t0, **limits)
            if probe.best.feasible and \
                    probe.best.time_s < (1 - SIGNIFICANT) * run.best.time_s:
                probe = _best_first([mapped], ev, max_states, MAPPED_SHARE * max_seconds,
                                    time.perf_counter(), **limits)
            run.absorb(probe)
        return run
    if levels == "all":
        coarse = searched(two, roots)
        ev = Evaluator(hardware, sizes or {}, dtype, objective, "all")
        ranked = sorted((s for s in coarse.states() if s.feasible), key=lambda s: s.time_s)
        seeds = [(s.program, s.chain) for s in ranked[:keep]] or [start]
        fine = searched(ev, seeds, refine=True)
        fine.states_seen += coarse.states_seen
        fine.expanded += coarse.expanded
        fine.commuted += coarse.commuted
        fine.pruned += coarse.pruned
        fine.refused = coarse.refused
        fine.limit = fine.limit or coarse.limit
        fine.stopped = fine.stopped or coarse.stopped
        return fine.result(diagram, ev, keep, t0, apart)
    return searched(two, roots).result(diagram, two, keep, t0, apart)


@dataclass
class _Run:
    """One best-first pass: its state graph, counters, best state and limit."""
    graph: nx.DiGraph
    best: State
    bound: float
    expanded: int = 0
    commuted: int = 0    # moves not applied: the same program is reached in another order
    pruned: int = 0      # states reached but not costed: nothing derived from them can win
    states_seen: int = 0
    limit: str | None = None
    stopped: str | None = None  # why the search stopped short of an empty frontier (patience)
    since_best: int = 0  # states costed since the best last improved
    refused: dict = field(default_factory=dict)
    buckets: dict = field(default_factory=dict)  # canonical hash -> node keys

    def states(self):
        return [self.graph.nodes[n]["state"] for n in self.graph.nodes]

    def find(self, program) -> tuple[str, str | None]:
        """(canonical hash, key of the state holding this program or None)."""
        h = canonical_hash(program)
        for k in self.buckets.get(h, ()):
            known = self.graph.nodes[k]["state"].program
            if fingerprint(known) == fingerprint(program) or same_program(known, program):
                return h, k
        return h, None

    def absorb(self, other: "_Run") -> None:
        """``other``'s states (a program in both keeps this run's), counts and best."""
        self.graph = nx.compose(other.graph, self.graph)
        for h, keys in other.buckets.items():
            mine = self.buckets.setdefault(h, [])
            mine.extend(k for k in keys if k not in mine)
        self.best = _better(self.best, other.best)
        self.expanded += other.expanded
        self.commuted += other.commuted
        self.pruned += other.pruned
        self.states_seen += other.states_seen

    def new_key(self, h: str) -> str:
        """A node key for a program not in the graph (a hash collision gets a suffix)."""
        keys = self.buckets.setdefault(h, [])
        keys.append(h if not keys else f"{h}.{len(keys)}")
        return keys[-1]

    def result(self, diagram, ev, keep, t0, apart=()) -> SearchResult:
        """The search's answer; ``apart``: the (program, chain) roots with every box a kernel
        of its own — the best being one of them while nothing fused fits is said in a note."""
        states, best = self.states(), self.best
        note = ""
        apart_keys = {self.find(program)[1] for program, _ in apart} - {None}
        if best.key in apart_keys and not any(s.feasible for s in states
                                              if s.key not in apart_keys):
            note = slow_note(diagram, self, ev)
        if not best.feasible:
            fallback = kernel_per_box(diagram, ev)
            note = slow_note(diagram, self, ev)
            if fallback is None:
                if self.limit:
                    raise NapkinError(f"search stopped before any program fit on chip: "
                                      f"{self.limit}; raise the limit (max_states / "
                                      f"max_seconds)")
                raise NapkinError(_too_small(states, ev))
            fallback.found_s = time.perf_counter() - t0
            self.graph.add_node(fallback.key, state=fallback)
            best = self.best = fallback
            states = self.states()
        # Alternatives: the best program of each distinct cost, best first (programs
        # that only re-nest the same tiling cost the same and add nothing to read); those
        # that fit nowhere are told apart by the memory their smallest tiles need.
        ranked, seen = [], {(round(best.time_s, 15), round(best.bytes, 3), None)}

        def smallest(s):
            return None if s.feasible else tuple(sorted((lv, round(m)) for lv, m
                                                        in s.min_memory.items()))
        # (programs a backend writes first, as the best is chosen: _better)
        # (a split of a slower program is that program made faster: no structure of its own)
        for s in sorted((s for s in states if s.key != best.key and not s.pruned
                         and not (s.chain and RULES[s.chain[-1].rule].last)),
                        key=lambda s: (bool(s.unlowerable), s.time_s, smallest(s) or (),
                                       len(s.chain))):
            sig = (round(s.time_s, 15) if math.isfinite(s.time_s) else math.inf,
                   round(s.bytes, 3) if math.isfinite(s.bytes) else math.inf, smallest(s))
            if sig not in seen:
                seen.add(sig)
                ranked.append(s)
            if len(ranked) == keep:
                break
        best._report = ev
        for s in {id(s): s for s in (best, best.parent, *ranked) if s is not None}.values():
            _untie(s)
        return SearchResult(diagram, best, ranked, self.states_seen, self.expanded,
                            time.perf_counter() - t0, self.limit, self.graph, self.bound,
                            self.refused, self.commuted, ev.hw, self.pruned, note, self.stopped)


def _untie(state) -> None:
    """Name ``state``'s program as it was priced (each kernel's tiles its own), its chain
    ending with the move that does (rewrites.untie), once."""
    if state.chain and state.chain[-1].rule == "untie_tiles":
        return
    program, renames = untied(state.program)
    if renames:
        state.program = program
        state.chain = (*state.chain, Move("untie_tiles", Site((), ()), ()))


# A split of a stream's parts over more blocks (split-K) is tried on a program whose kernel
# launches fewer blocks than this share of the SMs: decoding, a few query tiles against a
# long key axis (1 to 32 blocks on 132 SMs).  Between it and a full wave the model can find
# a split faster too (single-head attention at q = x = 4096: 64 query tiles, 1.6x), as
# FlashAttention-2's split heuristic would; napkin leaves that prefill unsplit.
SPLIT_BELOW = 0.5
# ... and only on a program that runs longer than this many kernel launches: a split adds a
# launch and a round trip of the partial states, which a program of a few microseconds
# cannot win back (and the many small problems a search meets need not price it)
SPLIT_LAUNCHES = 10

# a state's grid of at least this many points drops its arrays once evaluated (Grid.slim):
# a transformer block's grid holds millions of points, ~150 MB a state
SLIM_POINTS = 1 << 16


def few_launches(state, hw) -> bool:
    """Whether ``state``'s program runs shorter than :data:`SPLIT_LAUNCHES` launches: too
    short for a split or a second search to win much."""
    return state.time_s < SPLIT_LAUNCHES * getattr(hw, "launch_s", 0.0)


def leaves_sms_idle(state, hw, best_s: float = math.inf) -> bool:
    """Whether some kernel of ``state``'s program, at its best tiles, launches fewer blocks
    than :data:`SPLIT_BELOW` of the SMs (the blocks a split would add could run), in a
    program longer than :data:`SPLIT_LAUNCHES` launches, that a split could make faster than
    ``best_s`` (the best time found): filling the SMs divides its time by at most
    SMs ÷ blocks."""
    from napkin.cost.launch import Launches, modelled
    sms = getattr(hw, "sms", None)
    grid = state.grid
    if not sms or not state.feasible or grid is None or not modelled(grid.c.hardware) \
            or state.best_point is None or few_launches(state, hw):
        return False
    fewest = min((k.at(0)["blocks"] for k in Launches.point(grid, state.best_point)),
                 default=sms)
    return fewest < SPLIT_BELOW * sms and state.time_s * fewest / sms < best_s


def _refinements() -> dict:
    """The rules of the second phase of a search over the whole hierarchy: those that
    only move a program's arrays between levels, or tile inside a kernel that exists."""
    return {k: r for k, r in RULES.items() if r.subsumed_by is None
            and (r.relabels_levels or r.tiles_inside_kernels)}


def _best_first(roots, ev: "Evaluator", max_states: int, max_seconds: float, t0: float,
                refine: bool = False, algorithm=None, commute: bool = True,
                prune: bool = True, patience: int | None = None) -> _Run:
    """Best-first from ``roots`` (diagrams, or (program, chain) pairs) of ``algorithm``
    (default: the first root).  ``refine``: only the refinements (:func:`_refinements`),
    each at sites inside an existing group unless it only relabels levels."""
    roots = [r if isinstance(r, tuple) else (r, ()) for r in roots]
    run = _Run(nx.DiGraph(), None, ev.lower_bound(algorithm or roots[0][0]))
    tie = itertools.count()
    frontier = []
    first = None  # the first root's key: refusals are recorded at it (the algorithm itself)
    for prog, chain in roots:
        h, known = run.find(prog)
        if known is not None:
            continue  # two seeds, one program
        state = State(run.new_key(h), prog, tuple(chain))
        ev(state)
        state.found_s = time.perf_counter() - t0
        if state.error and "no size" in state.error:
            raise NapkinError(state.error)
        run.graph.add_node(state.key, state=state)
        run.best = _better(run.best, state)
        heapq.heappush(frontier, (*_priority(state), next(tie), state))
        first = first or state.key
    rules = _refinements() if refine else None
    rank: dict = {}  # move ident -> a fixed total order (first seen, first ranked)

    def moves_of(state: State) -> list:
        if state.moves is None and any(RULES[m.rule].last for m in state.chain):
            state.moves = []  # a chain that a final move ended
        if state.moves is None:
            refused = run.refused if state.key == first and not refine else None
            idle = leaves_sms_idle(state, ev.hw, run.best.time_s if run.best else math.inf)
            state.moves = [mv for mv in moves(state.program, rules=rules, refused=refused,
                                              levels=ev.levels)
                           if (not refine or mv.site.path or RULES[mv.rule].relabels_levels)
                           and (idle or not RULES[mv.rule].last)]
            for mv in state.moves:
                rank.setdefault(mv.ident, len(rank))
        return state.moves

    def commutes_earlier(state: State, mv: Move) -> bool:
        """Partial-order reduction (a sleep set one level deep): ``state`` is P·m_i, and
        ``mv`` rewrites boxes that P's move m_j rewrote too, with m_j before m_i in the
        fixed order.  P·m_j·m_i is then this same program and P·m_j will apply m_i —
        checked, not assumed: m_i must be among P·m_j's own moves.  Each skip hands the
        program to a move later in the order, so some state does apply it."""
        parent, m_i = state.parent, state.via
        if not commute or parent is None or rank[mv.ident] >= rank[m_i.ident]:
            return False
        key_j = parent.children.get(mv.ident)
        if key_j is None:
            return False
        other = run.graph.nodes[key_j]["state"]
        return any(m.ident == m_i.ident for m in moves_of(other))

    def applied(state: State, mv: Move):
        """``mv`` applied to ``state`` (the top-level ones kept: looking at a state's top
        level and expanding it apply them both)."""
        if mv.site.path:
            return apply_move(state.program, mv)
        if mv.ident not in state.applied:
            state.applied[mv.ident] = apply_move(state.program, mv)
        return state.applied[mv.ident]

    def top_frozen(state: State, depth: int) -> bool:
        """Whether no top-level move of ``state`` leads anywhere that can win: each is
        refused, or leads to a program that cannot (:func:`cannot_win`, looking ``depth``
        more top levels down).  A top-level move made after moves further in reaches a
        program derived from the one it makes here, so a program that wins then keeps
        this state's top level (:attr:`State.frozen`)."""
        for mv in moves_of(state):
            if mv.site.path:
                continue
            try:
                prog = applied(state, mv)
            except Exception:  # noqa: BLE001 - a move that fails is a refusal
                continue
            _, known = run.find(prog)
            other = run.graph.nodes[known]["state"] if known is not None else State("", prog, ())
            ev.writability(other)
            if not cannot_win(other, depth):
                return False
        return True

    def cannot_win(state: State, depth: int = 2) -> bool:
        """Once a program a backend writes is best: whether nothing derived from ``state``
        that a backend writes can beat it (it and its derivations are unwritable, or what
        they must move through HBM already takes longer)."""
        if not (run.best.feasible and not run.best.unlowerable):
            return False
        if _final(state):
            return True
        limit = run.best.time_s * (1 - 1e-12)
        if ev.written_bound(state.program, state.frozen) >= limit:
            return True
        # were its top level frozen, the values between its kernels would stay in HBM: look
        # at its top-level moves only when that alone would rule it out
        if not state.frozen and depth > 0 and ev.written_bound(state.program, True) >= limit \
                and top_frozen(state, depth - 1):
            state.frozen = True
            return True
        return False

    partly = ""  # set when the clock stops an expansion halfway
    # a dive first: expand the best new child of the state just expanded until a program a
    # backend writes fits — an early incumbent, so that pruning and patience start at once
    # (best-first from the root spends hundreds of states on programs that fit nowhere)
    dive, expanded = None, set()
    shown = time.perf_counter()
    while (frontier or dive is not None) and not partly:
        if PROGRESS is not None and time.perf_counter() - shown >= 1.0:
            shown = time.perf_counter()
            PROGRESS(run.graph.number_of_nodes(), run.best.time_s, shown - t0)
        if run.graph.number_of_nodes() >= max_states:
            run.limit = f"state limit {max_states} reached ({len(frontier)} states unexpanded)"
            break
        if time.perf_counter() - t0 > max_seconds:
            run.limit = f"time limit {max_seconds:g} s reached ({len(frontier)} states unexpanded)"
            break
        if patience is not None and run.since_best >= patience and run.best.feasible \
                and not run.best.unlowerable:
            run.stopped = (f"patience: no better program in the {run.since_best} states "
                           f"costed since the best ({len(frontier)} states unexpanded)")
            break
        if dive is not None:
            state, dive = dive, None
        else:
            *_, state = heapq.heappop(frontier)
        if state.key in expanded:
            continue  # (reached first by the dive)
        if run.best.feasible and run.bound >= run.best.time_s * (1 - 1e-12):
            break  # nothing can beat the best: it meets the lower bound
        if _final(state):
            continue  # no backend writes it nor anything derived from it: no answer there
        if cannot_win(state) if prune else (
                run.best.feasible and not run.best.unlowerable
                and ev.written_bound(state.program) >= run.best.time_s * (1 - 1e-12)):
            state.applied.clear()
            continue  # nothing derived from it that a backend writes can beat the best
        run.expanded += 1
        expanded.add(state.key)
        diving = not (run.best.feasible and not run.best.unlowerable)
        listed = moves_of(state)
        # the top-level moves first: whether one of them leads to a program a backend
        # writes decides whether the children below inherit a frozen top level
        top_open = False
        for mv in sorted(listed, key=lambda m: bool(m.site.path)):
            if mv.site.path and not top_open and not state.frozen:
                state.frozen = True  # (the top-level moves are done: none opened it)
                if prune and cannot_win(state):
                    break  # every program below keeps these kernels, and they are too slow
            if time.perf_counter() - t0 > max_seconds:
                partly = (f"time limit {max_seconds:g} s reached ({len(frontier)} states "
                          f"unexpanded, one partly expanded)")
                run.limit = partly
                break
            if commutes_earlier(state, mv):
                run.commuted += 1
                top_open = top_open or not mv.site.path  # (its program is not looked at)
                continue
            try:
                child_prog = applied(state, mv)
            except Exception as e:  # noqa: BLE001 - one failing move is a refusal, not an abort
                run.refused.setdefault((mv.rule, dict(mv.params).get("axis")), _why(e))
                continue
            h, known = run.find(child_prog)
            if known is not None:
                state.children[mv.ident] = known
                run.graph.add_edge(state.key, known, move=mv)
                top_open = top_open or not (mv.site.path or _final(run.graph.nodes[known]["state"]))
                continue
            key = state.children[mv.ident] = run.new_key(h)
            child = State(key, child_prog, (*state.chain, mv), parent=state, via=mv,
                          frozen=state.frozen and bool(mv.site.path))
            ev.writability(child)
            top_open = top_open or not (mv.site.path or _final(child))
            child.found_s = time.perf_counter() - t0
            run.graph.add_node(key, state=child)
            run.graph.add_edge(state.key, key, move=mv)
            if prune and cannot_win(child):  # decided before costing it: most children of a search
                child.pruned = run.best.time_s
                child.applied.clear()
                run.pruned += 1
                continue
            ev(child)
            was, run.best = run.best, _better(run.best, child)
            gain = run.best is not was and not (
                was.feasible and not was.unlowerable and run.best.feasible
                and run.best.time_s > was.time_s * (1 - SIGNIFICANT))
            run.since_best = 0 if gain else run.since_best + 1
            heapq.heappush(frontier, (*_priority(child), next(tie), child))
            if diving and (dive is None or _priority(child) < _priority(dive)):
                dive = child
        state.applied.clear()
        if run.best.feasible and not run.best.unlowerable:
            dive = None
    run.states_seen = run.graph.number_of_nodes()
    return run


def kernel_per_box(diagram, ev: Evaluator) -> State | None:
    """The program that always exists, when no program the search reached fits: every
    top-level box its own kernel, grouped over each of its output's axes and streamed over
    the axis it reduces (so no whole row is on chip), values between kernels in HBM — each
    step a rule application, so its chain is a certificate like any other.  None when even
    that does not fit (a budget below one box's smallest tile)."""
    program, chain = each_box_partitioned(diagram, ev)
    if not chain:
        return None
    state = State(f"{canonical_hash(program)}.kernel-per-box", program, tuple(chain))
    ev(state)
    return state if state.feasible and not state.error else None


def _apart(start, ev) -> list:
    """The roots every search also starts from, ``start`` (a (program, chain) pair) made
    kernels: one per box, one per product with its elementwise riders, and the same with
    sibling products sharing one (:func:`each_product_partitioned`)."""
    roots = [_each_box(start, ev)]
    for siblings in (False, True):
        program, chain = each_product_partitioned(start[0], ev, siblings)
        if not sourceless(program):  # (a value made from no input left at the top)
            roots.append((program, (*start[1], *chain)))
    return roots


def _each_box(start, ev) -> tuple:
    """(program, chain): ``start`` (a (program, chain) pair) with every box a kernel."""
    program, chain = each_box_partitioned(start[0], ev)
    return program, (*start[1], *chain)


def each_box_partitioned(diagram, ev: Evaluator) -> tuple:
    """(program, chain): every top-level box of ``diagram`` that is not a group or a stream
    yet made a kernel of its own — grouped over its output's axes, streamed over the largest
    axis it reduces (:func:`kernel_per_box`'s program, and the pieces' completion)."""
    def boxes(prog):
        g = view(prog)
        return [g.nodes[n]["box"] for n in op_order(g)]

    def step(prog, index, others, rule, path, params):
        """(the program, the move, the root index of the box being partitioned — the one
        top-level box not among ``others``) or Nones when the rule refuses."""
        site = Site((index, *path[1:]) if path else (), (0,) if path else (index,))
        try:
            new = RULES[rule].apply(prog, site, params)
        except Exception:  # noqa: BLE001 - a refusal, whatever raised it (as in the search)
            return None, None, None
        at = [i for i, b in enumerate(boxes(new)) if id(b) not in others]
        if not at:  # its replacement is a box another also is (rules memoise by content)
            return None, None, None
        return new, Move(rule, site, tuple(sorted(params.items()))), at[0]

    program, chain = diagram, []
    for box in boxes(diagram):
        if box.spec.kind in ("group", "stream"):
            continue
        here = boxes(program)
        at = [i for i, b in enumerate(here) if b is box]
        if not at:  # (a rewrite rebuilt it: it is no longer a top-level box of its own)
            continue
        index = at[0]
        others = {id(b) for i, b in enumerate(here) if i != index}
        outs = list(dict.fromkeys(a for ob in box.cod.inside for a in ob.type.names))
        reduced = [a for a in dict.fromkeys(n for ob in box.dom.inside for n in ob.type.names)
                   if a not in outs]
        path = []  # the groups made so far, as a site path below the root index
        for axis in outs:
            new, mv, where = step(program, index, others, "group_partition", path,
                                  {"axis": axis})
            if new is not None:
                program, index, path = new, where, [*path, 0]
                chain.append(mv)
        for axis in sorted(reduced, key=lambda a: -value_at(_axis_size(box, a), ev.sizes)):
            new, mv, where = step(program, index, others, "stream_partition", path,
                                  {"axis": axis})
            if new is not None:
                program, index = new, where
                chain.append(mv)
                break
    return program, chain


def each_product_partitioned(diagram, ev: Evaluator, siblings: bool = False) -> tuple:
    """(program, chain): every product or reduction of ``diagram`` a kernel of its own with
    the elementwise boxes that ride with it (its prologue — a norm's scaling before its
    GEMM, a gate's silu·up before the down projection — and its epilogue — a residual
    add: :func:`napkin.search.pieces.cuts` with one reducing box a piece), grouped over its
    outputs' axes and streamed over the reduced axis that leads its inputs; what no rule
    takes whole is left to :func:`each_box_partitioned`.  The expert's decomposition of a
    layer, as a root the search refines (a kernel per box pays a pass through HBM for
    every elementwise box).  ``siblings``: two products that reduce one input to outputs
    of the same axes (a gate's and an up projection's GEMMs) share a kernel — one pass over
    the input, an accumulator each — with the elementwise boxes that read only what they
    make as its epilogue (silu(gate)·up)."""
    from napkin.search.pieces import cuts
    program, chain, failed = diagram, [], set()
    for _ in range(len(op_order(view(diagram)))):
        g = view(program)
        order = op_order(g)
        ids = lambda r: frozenset(id(g.nodes[order[i]]["box"]) for i in r)  # noqa: E731
        done = lambda r: len(r) == 1 and (  # noqa: E731 - a kernel already
            g.nodes[order[r[0]]]["box"].spec.kind in ("group", "stream"))
        runs = cuts(program, ev, most=1)
        if siblings:
            runs = _merge_siblings(g, order, runs)
        todo = [r for r in runs if not done(r) and ids(r) not in failed]
        if not todo:
            break
        made = _partition_run(program, todo[0], ev)
        if made is None:
            failed.add(ids(todo[0]))
            continue
        program, moves = made
        chain += moves
    program, rest = each_box_partitioned(program, ev)
    return program, (*chain, *rest)


def _merge_siblings(g, order, runs) -> list:
    """``runs`` with the first pair of sibling products merged (see
    :func:`each_product_partitioned`), or as they are."""
    light = lambda i: getattr(g.nodes[order[i]]["box"].spec, "elementwise", False)  # noqa: E731
    axes = lambda vs: {a for v in vs for a in g.nodes[v]["ob"].type.names}  # noqa: E731

    def product(r):
        heavy = [i for i in r if not light(i)]
        if len(heavy) != 1 or g.nodes[order[heavy[0]]]["box"].spec.kind in ("group", "stream"):
            return None
        node = g.nodes[order[heavy[0]]]
        reduced = axes(node["ins"]) - axes(node["outs"])
        inputs = {v for i in r for v in g.nodes[order[i]]["ins"]
                  if all(m not in {order[j] for j in r} for m in g.predecessors(v))}
        return frozenset(axes(node["outs"])), reduced, inputs

    facts = [product(r) for r in runs]
    for a in range(len(runs)):
        for b in range(a + 1, len(runs)):
            if facts[a] is None or facts[b] is None or facts[a][0] != facts[b][0] \
                    or not facts[a][1] or facts[a][1] != facts[b][1]:
                continue
            shared = facts[a][2] & facts[b][2]
            if not any(g.nodes[v]["ob"].type.has(x) for v in shared for x in facts[a][1]):
                continue
            merged = set(runs[a]) | set(runs[b])
            makes = {v for i in merged for v in g.nodes[order[i]]["outs"]}
            for k, r in enumerate(runs):  # the epilogue: light boxes of others reading it
                if k in (a, b):
                    continue
                for i in sorted(r):
                    ins = g.nodes[order[i]]["ins"]
                    if light(i) and ins and all(v in makes for v in ins):
                        merged.add(i)
                        makes.update(g.nodes[order[i]]["outs"])
            out = [sorted(merged) if k == a else sorted(set(r) - merged)  # in order: what
                   for k, r in enumerate(runs) if k != b]  # makes its inputs goes first
            return [r for r in out if r]
    return runs


def _partition_run(program, run, ev):
    """(program, moves): the top-level ops ``run`` of ``program`` one kernel — grouped over
    each axis of the region's outputs, streamed over the reduced axis that leads its inputs
    — or None where a rule refuses (the run is left to a kernel per box)."""
    from napkin.core.region import body_at, region
    g = view(program)
    reg = region(g, list(run))
    outs = list(dict.fromkeys(a for v in reg.outputs for a in g.nodes[v]["ob"].type.names))
    ins = dict.fromkeys(a for v in reg.inputs for a in g.nodes[v]["ob"].type.names)
    # the stream takes the reduced axis that leads the region's inputs (an output
    # projection's heads before their dimension: a chunk of one head per step is a plain
    # GEMM, a chunk of the dimension across all heads a transposed one)
    reduced = [a for a in ins if a not in outs]
    moves, path, site = [], (), Site((), tuple(sorted(run)))
    try:
        for axis in outs:
            mv = Move("group_partition", site, (("axis", axis),))
            before = {id(b) for b in top_boxes(program)}
            program = RULES["group_partition"].apply(program, site, {"axis": axis})
            moves.append(mv)
            if not path:  # the kernel: the one top-level box the move made
                made = [i for i, b in enumerate(top_boxes(program)) if id(b) not in before]
                if len(made) != 1:
                    return None
                path = (made[0],)
            else:
                path = (*path, 0)
            site = Site(path, tuple(range(len(op_order(view(body_at(program, path)))))))
        if not moves:
            return None
        for axis in reduced[:1]:
            # the largest region first: the whole body, else all the reductions that read
            # one input (siblings' accumulators in one stream)
            cands = sorted(((c, p) for c, p in RULES["stream_partition"].candidates(
                program, path) if p.get("axis") == axis), key=lambda cp: -len(cp[0].ops))
            for cand, params in cands:
                try:
                    new = RULES["stream_partition"].apply(program, cand, params)
                except Exception:  # noqa: BLE001 - a refusal (as in the search)
                    continue
                program = new
                moves.append(Move("stream_partition", cand, tuple(sorted(params.items()))))
                break
    except Exception:  # noqa: BLE001 - a refusal, whatever raised it (as in the search)
        return None
    return program, moves


def _axis_size(box, axis: str):
    return next(ob.type.axis(axis).size for ob in box.dom.inside if ob.type.has(axis))


def slow_note(diagram, run: _Run, ev: Evaluator) -> str:
    """Why the search fell back to a kernel per box, in words: what fits nowhere, and the
    premises that refused the rules which would have fused it (at the algorithm itself)."""
    reduced = {a for b in primitive_boxes(diagram) for ob in b.dom.inside for a in ob.type.names
               if not any(o.type.has(a) for o in b.cod.inside)}
    refused = [f"{rule} over {axis}: {why}" for (rule, axis), why in run.refused.items()
               if rule == "stream_partition" and axis in reduced][:2]
    fits = _too_small(run.states(), ev).split(": ", 1)[-1] if any(
        s.min_memory for s in run.states()) else ""
    parts = ["no fused program fits on chip, so every box runs as a kernel of its own, the "
             "values between them in HBM (runnable, not fast)"]
    if fits:
        parts.append(f"the best fused one: {fits}")
    if run.limit:
        parts.append(f"the search stopped: {run.limit}")
    if refused:
        parts.append("what kept it apart: " + "; ".join(refused))
    parts.append("what would fuse it: a streamability rule for this form, or a recognition "
                 "of it as a primitive the rules know (`napkin rules`: recognize)")
    return "; ".join(parts)


def _final(state: State) -> bool:
    """No backend writes the state's program nor anything derived from it."""
    return getattr(state.unlowerable, "final", False)


def _better(best: State | None, s: State) -> State:
    """The better of two states: one that fits, then one a kernel backend can write (a
    faster program nothing lowers is no answer to run), then the faster, then the shorter
    chain."""
    if best is None:
        return s
    if not s.feasible:
        return best
    if not best.feasible:
        return s
    key = lambda t: (bool(t.unlowerable), t.time_s, len(t.chain))  # noqa: E731
    return s if key(s) < key(best) else best


def _numel(t, values: dict) -> float:
    n = 1.0
    for a in t.axes:
        size = a.size
        n *= size if isinstance(size, int) else values.get(str(size)) or value_at(size, values)
    return n


def _priority(state: State) -> tuple:
    """Frontier order: feasible states by time; states that do not fit yet by how
    much memory their smallest tiling needs (the rewrites that shrink the worst
    kernel first), then by chain length.  Only the order: the stopping rule uses
    the admissible bound alone."""
    return (state.time_s, state.excess if not state.feasible else (0.0, 0.0), len(state.chain))


def _too_small(states, ev) -> str:
    """The error for a budget nothing fits: the smallest budget that would."""
    need = {}
    for s in states:
        for lv, m in s.min_memory.items():
            need[lv] = min(need.get(lv, math.inf), m)
    if not need:
        errs = {s.error for s in states if s.error}
        return "no program could be costed: " + "; ".join(sorted(errs))
    from napkin.cost.launch import modelled, smem_limit
    from napkin.schedule.resources import block_level
    hw = ev.hw
    block = hw.levels[block_level([lv.name for lv in hw.levels])].name

    def budget(lv):  # what the search held the level to: a block's limit under the launch model
        if ev.objective == "time" and modelled(hw) and lv == block:
            return smem_limit(hw)
        return hw.level(lv).capacity_bytes
    over = {lv: n for lv, n in need.items() if n > (budget(lv) or math.inf)}
    lv = min(over or need, key=lambda k: need[k])
    cap = budget(lv)
    return (f"no streamed program fits: the smallest needs {need[lv]:.0f} bytes of {lv} "
            f"but the budget is {cap} bytes (a budget of at least {math.ceil(need[lv])} bytes "
            f"would fit)")


def enumerate_chains(diagram, depth: int):
    """Every program reachable in at most ``depth`` rule applications (for
    cross-checking the search on small instances), without the final moves (a split,
    which the search offers only where the SMs sit idle: :func:`leaves_sms_idle`)."""
    seen = {fingerprint(diagram): (diagram, ())}
    layer = [(diagram, ())]
    for _ in range(depth):
        nxt = []
        for prog, chain in layer:
            for mv in moves(prog):
                if RULES[mv.rule].last:
                    continue
                child = apply_move(prog, mv)
                key = fingerprint(child)
                if key not in seen:
                    seen[key] = (child, (*chain, mv))
                    nxt.append(seen[key])
        layer = nxt
    return list(seen.values())
