"""Looped pseudocode of a streamed program: every buffer, load, store and op explicit.

The paper's "hardware-aware derivation" starts by expanding a streamed program into loops in
which every variable has a size, a precision and a memory level, so that memory can be
pre-allocated and the exact transfers of one group are known.  This module does that,
generically, from the program's own boxes: one ``for`` loop per group (a grid over the cores of
the group's level) or stream (a sequential fold), the accumulator's init / update / finalize
boxes written out as statements, fused intermediates inlined into the expression that reads
them.

    text = pseudocode(program, "h100", sizes={"q": 4096, ...}, tiles={"g_q": 128, ...})
    block = expand(program, "h100", dtype="bf16")        # the structured form
    listed_transfers(block)   # {level: values}; equals cost(program, ...).transfers
    block.memory              # {level: peak values}; equals cost(program, ...).memory

**The pseudocode is the cost model, written out.**  :class:`_Expand` walks the program exactly
as :mod:`napkin.cost.model` does (it reuses the cost walk's helpers and repeats its ``body``
and ``stream`` step for step, emitting a statement wherever the model moves data or holds a
buffer), so the loads and stores it lists, times the trip counts of their loops, are
``cost(...).transfers``, and the peak of the buffers it declares (with the model's liveness:
a value read by one elementwise box is fused into it, an elementwise box may overwrite an
input that dies there, the accumulator state is updated in place) is ``cost(...).memory``.
``pseudocode`` re-derives both from the listing and prints the comparison with
:func:`napkin.cost.cost`; ``tests/test_pseudocode.py`` checks it for several algorithms.

Conventions of the listing:

* ``X: bf16[g_q, d] @smem`` declares a buffer (dtype as the cost model prices it: the
  ``dtype`` argument, or each array's own).  Axis names broadcast (``S - mu`` subtracts a
  per-row ``mu[q]`` from every column of ``S[q, x]``).
* ``load A[q0:q0+g_q, :] -> A_blk`` / ``store O_blk -> O[q0:q0+g_q, :]`` move one tile; the
  trailing comment gives its values per execution.  A move across several levels (GMEM to
  SMEM on a four-level profile) counts at every level it crosses, as in the model.
* ``mu'`` is the next value of state ``mu`` within one stream step; the model keeps it in
  ``mu``'s buffer (the state is updated in place), so it declares nothing.
* Inputs without the grouped axis are re-loaded by every group (the broadcast cost); chunks
  of a stream are loaded once per step; outputs are stored once, where produced.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy

from napkin.cost.model import (
    ELEMENTWISE, ZERO, _merge_into, _nonneg, _Peak, _top_values, _Walk, as_max, bytes_per_value,
    cost as cost_of, prune,
)
from napkin.errors import NapkinError
from napkin.hardware import Hardware, get_hardware
from napkin.ir import ops as op_order, to_graph

__all__ = ["Block", "Line", "Transfer", "Var", "expand", "listed_memory", "listed_transfers",
           "pseudocode"]

_SUFFIX = {"smem": "_blk", "registers": "_reg", "l2": "_l2"}
_INFIX = {"add": ("+", 1), "sub": ("-", 1), "mul": ("*", 2), "div": ("/", 2)}
_ATOM = 9
_FUNCTION_NAMES = {"exp", "log", "max", "min", "sum", "add", "sub", "mul", "div", "einsum",
                   "full", "load", "store", "tanh", "sqrt", "rsqrt", "softmax", "mean"}


# --------------------------------------------------------------------------- structure
@dataclass
class Var:
    """A buffer: array ``array`` held at ``level`` with the given axes (sizes may be tiles)."""
    name: str
    array: str
    axes: tuple            # ((axis name, size), ...)
    dtype: str
    level: str
    values: sympy.Expr
    bytes: sympy.Expr
    role: str              # "array" (top level), "tile", "chunk", "state", "temp", "next"
    base: dict             # axis -> number of enclosing loops over it when created

    @property
    def type_text(self) -> str:
        return f"{self.dtype}[{', '.join(_size(s) for _, s in self.axes)}]"

    @property
    def decl(self) -> str:
        return f"{self.name}: {self.type_text} @{self.level}"


@dataclass
class Transfer:
    """One load or store: ``values`` (``bytes``) per execution, counted at ``levels``."""
    kind: str              # "load" | "store"
    array: str
    values: sympy.Expr
    bytes: sympy.Expr
    levels: tuple          # every level the move crosses into / out of
    src: str
    dst: str


@dataclass
class Line:
    text: str
    comment: str = ""
    transfer: Transfer | None = None
    var: Var | None = None      # the buffer this line declares, if any
    sized: bool = True          # show the declared buffer's size in the comment


@dataclass
class Block:
    """A loop (group / stream), a kernel, a section (init / finalize) or the program."""
    kind: str                   # "program" | "group" | "stream" | "kernel" | "section"
    header: str = ""
    comment: str = ""
    trips: sympy.Expr = sympy.Integer(1)
    level: str = ""
    items: list = field(default_factory=list)
    peak: dict = field(default_factory=dict)   # level -> (values candidates, bytes candidates)
    axis: str = ""
    var: str = ""
    size: object = None
    parallel: bool = False
    memory: dict = field(default_factory=dict)        # program only: level -> peak values
    memory_bytes: dict = field(default_factory=dict)  # program only: level -> peak bytes
    levels: tuple = ()                                # program only: the profile's levels
    hardware: Hardware | None = None

    def walk(self, mult=sympy.Integer(1)):
        """(item, multiplier) for every line and block below, in order; the multiplier is the
        product of the trip counts of the loops around the item (this block's included)."""
        m = mult * self.trips
        for it in self.items:
            if isinstance(it, Block):
                yield it, m
                yield from it.walk(m)
            else:
                yield it, m


# --------------------------------------------------------------------------- text helpers
def _size(s) -> str:
    return str(s)


def _ident(name: str) -> str:
    s = re.sub(r"[^\w']+", "_", str(name)).strip("_")
    if not s:
        return "t"
    return s if not s[0].isdigit() else "t" + s


def _axes_sig(names) -> str:
    names = list(names)
    return "".join(names) if all(len(n) == 1 for n in names) else " ".join(names)


def _fmt_num(x: float) -> str:
    if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)):
        return f"{int(round(x)):,}"
    return f"{x:,.4g}"


def _fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.4g} {unit}"
    return f"{b:.4g} B"


def _num(expr, sizes):
    if sizes is None:
        return None
    e = sympy.sympify(expr)
    v = e.subs({s: sizes[s.name] for s in e.free_symbols if s.name in sizes})
    return None if v.free_symbols else float(v)


def _peak_num(cands, sizes):
    vals = [_num(c, sizes) for c in cands]
    return None if any(v is None for v in vals) else max(vals, default=0.0)


# --------------------------------------------------------------------------- the walk
class _Expand(_Walk):
    """The cost walk of :mod:`napkin.cost.model`, emitting pseudocode as it prices.

    ``body`` and ``stream`` repeat ``_Walk.body`` / ``_Walk.stream`` line for line (same
    holds, same moves, same peaks); what they add is the listing: a :class:`Var` for every
    buffer held, a :class:`Transfer` for every move, a statement for every box.
    """

    def __init__(self, hw, dtype, intermediates=True):
        super().__init__(hw, dtype, intermediates)
        self.loops = defaultdict(list)      # axis -> [(loop variable, tile size)]
        self.used: set = set()
        self.stack: list = []
        self.loopvars: set = set()

    # -- emission ------------------------------------------------------------------------
    def emit(self, item):
        self.stack[-1].items.append(item)

    def unique(self, name: str) -> str:
        base, k = _ident(name), 2
        out = base
        while out in self.used:
            out = f"{base}_{k}"
            k += 1
        self.used.add(out)
        return out

    def new_var(self, ob, L: int, role: str, name: str | None = None) -> Var:
        level = self.names[L]
        suffix = "" if L == 0 else _SUFFIX.get(level, "_" + level)
        if name is None:
            plain = _ident(ob.name)
            # a loaded tile is named after its array (Q -> Q_blk); a computed value keeps
            # its own name unless that is taken (O computed on chip -> O_blk)
            if plain in _FUNCTION_NAMES:  # a value called "exp" reads like a call
                plain = f"{plain}_{_axes_sig(ob.type.names).replace(' ', '_')}"
            name = plain if role == "temp" else plain + suffix
        vals, byts = self.size(ob)
        return Var(self.unique(name), ob.name, tuple((a.name, a.size) for a in ob.type.axes),
                   self.dt(ob), level, vals, byts, role,
                   {a: len(self.loops[a]) for a in ob.type.names})

    def view(self, var: Var) -> str:
        """``var`` as seen from the current loops: sliced along axes tiled since it was made."""
        parts, partial = [], False
        for a, _ in var.axes:
            extra = self.loops[a][var.base.get(a, 0):]
            if extra:
                start = "+".join(v for v, _ in extra)
                parts.append(f"{start}:{start}+{_size(extra[-1][1])}")
                partial = True
            else:
                parts.append(":")
        return f"{var.name}[{', '.join(parts)}]" if partial else var.name

    def transfer(self, ob, reps, frm: int, to: int, src: Var, dst: Var):
        """A move, priced by the cost walk (``_Walk.move``) and listed."""
        if frm == to:
            return
        self.move(ob, reps, frm, to)
        vals, byts = self.size(ob)
        lo, hi = sorted((frm, to))
        levels = tuple(self.names[k] for k in range(lo + 1, hi + 1))
        kind = "load" if to > frm else "store"
        s, d = (self.view(src), dst.name) if kind == "load" else (src.name, self.view(dst))
        via = f" via {', '.join(levels[:-1])}" if len(levels) > 1 and kind == "load" else ""
        self.emit(Line(f"{kind} {s} -> {d}", via.strip(),
                       transfer=Transfer(kind, ob.name, vals, byts, levels, s, d)))

    def declare(self, var: Var, comment: str = "", sized: bool = True):
        self.emit(Line(var.decl, comment, var=var, sized=sized))

    def loop_var(self, axis: str) -> str:
        k = 0
        while f"{axis}{k}" in self.loopvars:
            k += 1
        self.loopvars.add(f"{axis}{k}")
        return f"{axis}{k}"

    def open_loop(self, kind, axis, size, full, N, level, comment, parallel) -> Block:
        var = self.loop_var(axis)
        start = "0"
        blk = Block(kind, f"for {var} in range({start}, {_size(full)}, {_size(size)}):",
                    comment, sympy.sympify(N), level, axis=axis, var=var, size=size,
                    parallel=parallel)
        self.emit(blk)
        self.stack.append(blk)
        self.loops[axis].append((var, size))
        return blk

    def close_loop(self, blk):
        self.loops[blk.axis].pop()
        self.stack.pop()

    def open(self, blk):
        self.emit(blk)
        self.stack.append(blk)
        return blk

    def snapshot(self, pk: dict) -> dict:
        return {self.names[k]: (list(p.vals), list(p.byts)) for k, p in pk.items()}

    def where(self, Lc, L) -> str:
        lv = self.names[Lc]
        n = self.hw.levels[Lc].count
        if Lc == L:
            return "one more axis of the enclosing grid"
        unit = {"smem": "SMs", "registers": "register files (one per SM sub-partition)",
                "l2": "L2 slices"}.get(lv, f"{lv} instances")
        if L == 0:
            n = self.hw.instances(lv)
        if n == 1:
            return f"one at a time (one {lv})"
        parent = {"smem": "SM", "l2": "L2"}.get(self.names[L], self.names[L])
        per = f" per {parent}" if L >= 1 and self.hw.instances(self.names[L]) > 1 else ""
        return f"grid, parallel over {n} {unit}{per}"

    # -- expressions ---------------------------------------------------------------------
    def expression(self, box, args) -> tuple[str, int]:
        """Text and precedence of one box applied to argument texts (with precedences)."""
        spec = box.data
        k = spec.kind
        txt = [a for a, _ in args]

        def paren(a, p, need):
            return f"({a})" if p < need else a
        if k == "contract":
            sig = ",".join(_axes_sig(ob.type.names) for ob in box.dom.inside)
            sig += "->" + _axes_sig(box.cod.inside[0].type.names)
            return f"einsum('{sig}', {', '.join(txt)})", _ATOM
        if k == "zip" and spec.fn in _INFIX:
            op, p = _INFIX[spec.fn]
            (a, pa), (b, pb) = args
            right_need = p + 1 if spec.fn in ("sub", "div") else p
            return f"{paren(a, pa, p)} {op} {paren(b, pb, right_need)}", p
        if k == "zip":
            return f"{spec.fn}({', '.join(txt)})", _ATOM
        if k == "map":
            if spec.param is None:
                return (txt[0], args[0][1]) if spec.fn == "id" else (f"{spec.fn}({txt[0]})", _ATOM)
            p = spec.param
            ptxt = f"{float(p):g}" if p.is_Number else str(p)
            return f"{spec.fn}({txt[0]}, {ptxt})", _ATOM
        if k in ("reduce", "softmax", "mask"):
            return f"{spec.label()}({', '.join(txt)})", _ATOM
        if k == "cast":
            return f"{spec.dtype}({txt[0]})", _ATOM
        if k == "fill":
            return f"full({spec.value:g})", _ATOM
        return f"{_ident(spec.label())}({', '.join(txt)})", _ATOM

    # -- top level -----------------------------------------------------------------------
    def top(self, D, R=1, in_refs=None, out_refs=None):
        g = to_graph(D)
        ins, outs = g.graph["inputs"], g.graph["outputs"]
        ref = {}
        if in_refs is None:  # the program itself: every value of it lives in GMEM
            for v in ins:
                ref[v] = self.new_var(g.nodes[v]["ob"], 0, "array")
                self.declare(ref[v], "input", sized=False)
            out_refs = []
            for v in outs:
                if v not in ref:
                    ref[v] = self.new_var(g.nodes[v]["ob"], 0, "array")
                    self.declare(ref[v], "output", sized=False)
                out_refs.append(ref[v])
        else:
            ref.update(zip(ins, in_refs))
        for v, r in zip(outs, out_refs):
            ref.setdefault(v, r)
        for n in op_order(g):
            for v in g.nodes[n]["outs"]:
                if v not in ref:
                    ref[v] = self.new_var(g.nodes[v]["ob"], 0, "array")
                    self.stack[0].items.insert(self._n_decl(), Line(ref[v].decl, "intermediate",
                                                                    var=ref[v], sized=False))
        peaks: dict = {}
        for n in op_order(g):
            node = g.nodes[n]
            box = node["box"]
            spec = box.data
            irefs = [ref[v] for v in node["ins"]]
            orefs = [ref[v] for v in node["outs"]]
            if spec.kind == "group":
                Lc = self.level_index(spec.level)
                full, N = self._count(spec.axis, box, spec.size)
                self.tile("group", spec.axis, spec.size, full, max(Lc, 1))
                if Lc == 0:
                    blk = self.open_loop("group", spec.axis, spec.size, full, N, self.names[0],
                                         f"group {spec.axis} @{self.names[0]}, sequential "
                                         f"launches", False)
                    _merge_into(peaks, self.top(spec.body, R * N, irefs, orefs))
                else:
                    blk = self.open_loop("group", spec.axis, spec.size, full, N,
                                         self.names[Lc], f"group {spec.axis}: "
                                         f"{self.where(Lc, 0)}", True)
                    pk = self.body(spec.body, Lc, R * N, irefs, [0] * len(box.dom), orefs,
                                   [0] * len(box.cod))
                    blk.peak = self.snapshot(pk)
                    _merge_into(peaks, pk)
                self.close_loop(blk)
            else:
                L = self.implicit_level
                blk = self.open(Block("kernel", f"kernel {box.name}:",
                                      f"a box outside every group: one kernel, whole arrays "
                                      f"@{self.names[L]}", level=self.names[L]))
                pk = self.body(box, L, R, irefs, [0] * len(box.dom), orefs, [0] * len(box.cod))
                blk.peak = self.snapshot(pk)
                _merge_into(peaks, pk)
                self.stack.pop()
        return peaks

    def _n_decl(self) -> int:
        items = self.stack[0].items
        i = 0
        while i < len(items) and isinstance(items[i], Line) and items[i].var is not None:
            i += 1
        return i

    # -- bodies (mirrors _Walk.body) -----------------------------------------------------
    def body(self, D, L, R, in_refs, in_home, out_refs, out_home, reusable=()):
        g = to_graph(D)
        order = op_order(g)
        pos = {n: i for i, n in enumerate(order)}
        ins, outs = g.graph["inputs"], g.graph["outputs"]
        out_home_of, out_ref_of = {}, {}
        for v, h, r in zip(outs, out_home, out_refs):
            if v not in out_home_of or h < out_home_of[v]:
                out_home_of[v], out_ref_of[v] = h, r
        home = dict(zip(ins, in_home))
        ref = dict(zip(ins, in_refs))
        expr: dict = {}                      # fused values: (text, precedence)
        notes: dict = {}                     # fused values: names of the boxes inside
        reuse = {ins[i] for i in reusable}
        ob = lambda v: g.nodes[v]["ob"]  # noqa: E731
        cons = {v: sorted(pos[c] for c in g.successors(v)) for v in g.nodes
                if g.nodes[v]["kind"] == "value"}
        nsteps = len(order)

        def last(v):
            end = max(cons[v], default=-1)
            if v in out_home_of and out_home_of[v] < L and v not in ins:
                end = max(end, pos[next(iter(g.predecessors(v)))])
            return end

        items: list = []
        owned: set = set()
        child = defaultdict(list)
        deeper: dict = {}

        def hold(v, start, end):
            vals, byts = self.size(ob(v))
            items.append((start, end, vals, byts))
            owned.add(v)

        def ensure(v, i):
            if home[v] < L:
                var = self.new_var(ob(v), L, "tile")
                self.declare(var)
                self.transfer(ob(v), R, home[v], L, ref[v], var)
                home[v] = L
                ref[v] = var
                hold(v, i, last(v))

        def fused(v):
            if v in out_home_of or len(cons[v]) != 1:
                return False
            (c,) = {c for c in g.successors(v)}
            return g.nodes[c]["box"].data.kind in ELEMENTWISE

        pending = []   # stores of landed outputs, listed after the box that makes them

        def land(v, i):
            h_out = out_home_of.get(v)
            home[v] = L
            if cons[v]:
                var = self.new_var(ob(v), L, "temp")
                self.declare(var, "held for a later box")
                ref[v] = var
                hold(v, i, last(v))
                if h_out is not None and h_out < L:
                    pending.append((ob(v), R, L, h_out, var, out_ref_of[v]))
                return L, var
            if h_out is None:  # nobody reads it: the child keeps it at L
                var = self.new_var(ob(v), L, "temp")
                ref[v] = var
                return L, var
            ref[v] = out_ref_of[v]
            return h_out, out_ref_of[v]

        def flush():
            for args in pending:
                self.transfer(*args)
            pending.clear()

        def arg(v):
            if v in expr:
                return expr[v]
            return self.view(ref[v]), _ATOM

        for i, n in enumerate(order):
            node = g.nodes[n]
            box, spec = node["box"], node["box"].data
            if spec.kind == "group":
                Lc = max(L, self.level_index(spec.level))
                full, N = self._count(spec.axis, box, spec.size)
                self.tile("group", spec.axis, spec.size, full, Lc)
                if Lc > L >= 1:
                    for v in node["ins"]:
                        ensure(v, i)
                landed = [land(v, i) for v in node["outs"]]
                blk = self.open_loop("group", spec.axis, spec.size, full, N, self.names[Lc],
                                     f"group {spec.axis}: {self.where(Lc, L)}", True)
                pk = self.body(spec.body, Lc, R * N, [ref[v] for v in node["ins"]],
                               [home[v] for v in node["ins"]], [r for _, r in landed],
                               [h for h, _ in landed])
                if Lc > L:
                    blk.peak = self.snapshot(pk)
                self.close_loop(blk)
                flush()
                if Lc == L and L in pk:
                    child[i].append(pk.pop(L))
                _merge_into(deeper, pk)
            elif spec.kind == "stream":
                pk_here, pk_deep = self.stream(box, spec, g, node, i, L, R, home, ref, ensure,
                                               land, flush)
                child[i].append(pk_here)
                _merge_into(deeper, pk_deep)
            else:
                for v in node["ins"]:
                    ensure(v, i)
                self.count_flops(box, R)
                text, prec = self.expression(box, [arg(v) for v in node["ins"]])
                inner = [notes[v] for v in node["ins"] if notes.get(v)]
                own = box.name if pretty_name(box.name) != pretty_name(spec.label()) else ""
                note = ", ".join(inner + ([own] if own else []))
                reused = set()
                targets, decls, stores = [], [], []
                for v in node["outs"]:
                    home[v] = L
                    h = out_home_of.get(v)
                    if h == L:                      # the caller's buffer (e.g. the state)
                        ref[v] = out_ref_of[v]
                        targets.append(ref[v].name)
                        continue
                    if fused(v):
                        expr[v] = (text, prec)
                        notes[v] = note
                        continue
                    counted = self.intermediates or v in out_home_of
                    start = i
                    inplace = None
                    if counted and spec.kind in ELEMENTWISE:
                        vb = self.size(ob(v))[1]
                        for w in node["ins"]:
                            if (w in owned or w in reuse) and w not in reused and last(w) == i \
                                    and w not in out_home_of and _nonneg(self.size(ob(w))[1] - vb):
                                reused.add(w)
                                start = i + 1
                                inplace = ref[w]
                                break
                    var = self.new_var(ob(v), L, "temp" if v not in out_home_of else "tile")
                    ref[v] = var
                    if counted:
                        hold(v, start, last(v))
                    bits = []
                    if inplace is not None:
                        bits.append(f"in place over {inplace.name}")
                    elif not counted:
                        bits.append("not counted (intermediates=False)")
                    decls.append((var, bits, inplace is None and counted))
                    targets.append(var.decl)
                    if h is not None and h < L:
                        stores.append((ob(v), R, L, h, var, out_ref_of[v]))
                if targets:
                    comment = "; ".join(filter(None, [note] + [", ".join(d[1]) for d in decls]))
                    if any(t.endswith("'") for t in targets):
                        comment = "; ".join(filter(None, [comment, "next state, in place"]))
                    one = len(decls) == 1 and len(targets) == 1
                    self.emit(Line(f"{', '.join(targets)} = {text}", comment,
                                   var=decls[0][0] if one else None,
                                   sized=decls[0][2] if one else False))
                    if not one:
                        for var, _, sized in decls:
                            self.emit(Line(f"# {var.decl}", "", var=var, sized=sized))
                for args in stores:
                    self.transfer(*args)
        for v in set(outs) & set(ins):
            if home[v] == L and out_home_of[v] < L:
                self.transfer(ob(v), R, L, out_home_of[v], ref[v], out_ref_of[v])

        here = _Peak()
        for i in range(max(nsteps, 1)):
            vals = sum((it[2] for it in items if it[0] <= i <= it[1]), ZERO)
            byts = sum((it[3] for it in items if it[0] <= i <= it[1]), ZERO)
            if child.get(i):
                for pk in child[i]:
                    here.merge(pk.add(vals, byts))
            else:
                here.merge(_Peak.of(vals, byts))
        out = dict(deeper)
        if L in out:
            out[L].merge(here)
        else:
            out[L] = here
        return out

    # -- streams (mirrors _Walk.stream) --------------------------------------------------
    def stream(self, box, spec, g, node, i, L, R, home, ref, ensure, land, flush):
        axis = spec.axis
        full, N = self._count(axis, box, spec.chunk)
        self.tile("stream", axis, spec.chunk, full, L)
        self.streams.append((spec.rule, axis))
        n_state = spec.n_state
        up_dom = spec.update.dom.inside
        chunk_v, chunk_b = ZERO, ZERO
        chunked = []
        for j, v in enumerate(node["ins"]):
            t = g.nodes[v]["ob"].type
            if not t.has(axis):
                ensure(v, i)
            elif home[v] < L:
                chunked.append((j, v))
                cv, cb = self.size(up_dom[n_state + j])
                chunk_v += cv
                chunk_b += cb
        state_v, state_b = ZERO, ZERO
        state_vars, next_vars = [], []
        for ob in spec.init.cod.inside:
            sv, sb = self.size(ob)
            state_v += sv
            state_b += sb
            var = self.new_var(ob, L, "state", name=ob.name)
            state_vars.append(var)
            nxt = Var(var.name + "'", var.array, var.axes, var.dtype, var.level, var.values,
                      var.bytes, "next", var.base)
            next_vars.append(nxt)
        landed = [land(v, i) for v in node["outs"]]
        fin_out = [h for h, _ in landed]
        self._stream_ctx.append((spec.rule, axis))
        try:
            sec = self.open(Block("section", "", f"init: state of {spec.rule} "
                                  f"({', '.join(v.name for v in state_vars)}), on chip for the "
                                  f"whole stream", level=self.names[L]))
            init = self.body(spec.init, L, R, [], [], state_vars, [L] * n_state)
            for line in sec.items:
                for var in state_vars:
                    if isinstance(line, Line) and line.text.startswith(var.name + " = "):
                        line.text = f"{var.decl} = {line.text[len(var.name) + 3:]}"
                        line.var = var
                        line.comment = "; ".join(filter(None, [line.comment, "state"]))
                        line.sized = True
            self.stack.pop()
            blk = self.open_loop("stream", axis, spec.chunk, full, N, self.names[L],
                                 f"stream {axis} [{spec.rule}], sequential", False)
            up_refs = list(state_vars)
            for j, v in enumerate(node["ins"]):
                ob_chunk = up_dom[n_state + j]
                if (j, v) in chunked:
                    var = self.new_var(ob_chunk, L, "chunk")
                    self.declare(var)
                    self.transfer(ob_chunk, R * N, home[v], L, ref[v], var)
                    up_refs.append(var)
                else:
                    up_refs.append(ref[v])
            up = self.body(spec.update, L, R * N, up_refs, [L] * len(up_dom), next_vars,
                           [L] * n_state)
            moved = [(s, nx) for s, nx in zip(state_vars, next_vars)
                     if any(isinstance(it, Line) and it.text.split(" = ")[0].split(", ")
                            .count(nx.name) for it in blk.items)]
            if moved:
                self.emit(Line(f"{', '.join(s.name for s, _ in moved)} = "
                               f"{', '.join(nx.name for _, nx in moved)}",
                               "the state, updated in place"))
            self.close_loop(blk)
        finally:
            self._stream_ctx.pop()
        sec = self.open(Block("section", "", f"finalize {spec.rule}", level=self.names[L]))
        fin_refs = list(state_vars) + [ref[v] for v in node["ins"]
                                       if not g.nodes[v]["ob"].type.has(axis)]
        fin = self.body(spec.finalize, L, R, fin_refs, [L] * len(spec.finalize.dom),
                        [r for _, r in landed], fin_out, reusable=range(n_state))
        self.stack.pop()
        flush()
        here = _Peak()
        here.merge(up.pop(L).add(chunk_v, chunk_b))
        here.merge(fin.pop(L))
        init.pop(L, None)
        deeper: dict = {}
        _merge_into(deeper, up)
        _merge_into(deeper, fin)
        _merge_into(deeper, init)
        return here.add(state_v, state_b), deeper


def pretty_name(s: str) -> str:
    return re.sub(r"\s+", "", str(s))




# --------------------------------------------------------------------------- public API
def expand(program, hardware, dtype=None, *, intermediates: bool = True) -> Block:
    """The program as a tree of :class:`Block` s and :class:`Line` s (symbolic sizes).

    ``hardware``, ``dtype`` and ``intermediates`` mean what they mean to
    :func:`napkin.cost.cost`; the listing prices exactly as that call does.
    """
    hw = get_hardware(hardware)
    if isinstance(dtype, str):
        bytes_per_value(dtype)
    w = _Expand(hw, dtype, intermediates)
    root = Block("program", level=w.names[0], levels=w.names, hardware=hw)
    w.stack.append(root)
    peaks = w.top(program)
    for i, lv in enumerate(w.names):
        if i == 0:
            tv = _top_values(program)
            vals = sympy.expand(sum((o.type.numel for o in tv), ZERO))
            byts = sympy.expand(sum((w.size(o)[1] for o in tv), ZERO))
            root.peak[lv] = ([vals], [byts])
        else:
            pk = peaks.get(i, _Peak())
            root.peak[lv] = (prune(pk.vals or [ZERO]), prune(pk.byts or [ZERO]))
        root.memory[lv] = as_max(root.peak[lv][0])
        root.memory_bytes[lv] = as_max(root.peak[lv][1])
    return root


def transfers_of(block: Block) -> list[tuple[Transfer, sympy.Expr]]:
    """Every listed transfer with the number of times it runs (product of trip counts)."""
    return [(it.transfer, m) for it, m in block.walk() if isinstance(it, Line) and it.transfer]


def listed_transfers(block: Block, bytes: bool = False) -> dict:
    """{level: Σ values (or bytes) of the listed loads and stores × trip counts}."""
    out = {lv: ZERO for lv in block.levels[1:]}
    for t, m in transfers_of(block):
        for lv in t.levels:
            out[lv] += (t.bytes if bytes else t.values) * m
    return {lv: sympy.expand(e) for lv, e in out.items()}


def listed_memory(block: Block, sizes: Mapping, bytes: bool = False) -> dict:
    """{level: peak values (bytes) of the declared buffers}, evaluated at ``sizes``."""
    k = 1 if bytes else 0
    return {lv: _peak_num(c[k], sizes) for lv, c in block.peak.items()}


def _tile_values(tiles) -> dict:
    if tiles is None:
        return {}
    if hasattr(tiles, "values") and not isinstance(tiles, Mapping):
        tiles = tiles.values
    return {str(k): v for k, v in dict(tiles).items()}


def pseudocode(program, hardware, sizes: Mapping | None = None, tiles=None, dtype="bf16",
               fmt: str = "text", *, title: str | None = None, check: bool = True,
               intermediates: bool = True) -> str:
    """Looped pseudocode of ``program`` on ``hardware``, with per-loop and total transfers and
    memory (numbers when ``sizes`` and ``tiles`` give every size), checked against
    :func:`napkin.cost.cost` when ``check``.

    ``fmt``: "text" (a commented listing) or "markdown" (a heading, the listing in a code
    fence and a table of totals).  ``tiles``: {"g_q": 128, ...} or a ``Tiles``.
    """
    if fmt not in ("text", "markdown"):
        raise NapkinError(f"pseudocode format must be 'text' or 'markdown', got {fmt!r}")
    hw = get_hardware(hardware)
    root = expand(program, hw, dtype, intermediates=intermediates)
    env = None
    if sizes is not None or tiles is not None:
        env = {str(k): v for k, v in dict(sizes or {}).items()}
        env.update(_tile_values(tiles))
    code = _render(root, env, hw, dtype)
    totals = _totals(root, env, hw, dtype, program, check, intermediates)
    head = title or "streamed program"
    used = _symbols(root)
    sz = ", ".join(f"{k}={v}" for k, v in sorted((env or {}).items()) if k in used)
    dt = dtype if isinstance(dtype, str) else ("own dtypes" if dtype is None else
                                               ", ".join(f"{k}:{v}" for k, v in dtype.items()))
    sub = f"{hw.name} ({' > '.join(root.levels)}), {dt}" + (f"; {sz}" if sz else "")
    if fmt == "markdown":
        rows = ["| level | transfers (values) | bytes | peak memory (values) | bytes | "
                "cost model |", "|---|---|---|---|---|---|"]
        for r in totals["rows"]:
            rows.append("| " + " | ".join(r) + " |")
        return "\n".join([f"### {head}", "", sub, "", "```python", code, "```", "",
                          *rows, "", *[f"- {n}" for n in totals["notes"]]]) + "\n"
    lines = [f"# {head} on {sub}", code, "", "# totals (all iterations):"]
    for r in totals["rows"]:
        lines.append(f"#   {r[0]:<10} transfers {r[1]} values ({r[2]}); peak {r[3]} values "
                     f"({r[4]}); {r[5]}")
    lines += [f"# {n}" for n in totals["notes"]]
    return "\n".join(lines) + "\n"


def _symbols(root: Block) -> set:
    """Names of every size symbol the listing mentions."""
    out = set()
    for it, _ in root.walk():
        if isinstance(it, Line) and it.var is not None:
            for _, sz in it.var.axes:
                out |= {s.name for s in sympy.sympify(sz).free_symbols}
        elif isinstance(it, Block):
            out |= {s.name for s in sympy.sympify(it.trips).free_symbols}
    return out


# --------------------------------------------------------------------------- rendering
INDENT = "    "
COMMENT_COL = 58


def _line(indent: int, text: str, comment: str = "") -> str:
    s = INDENT * indent + text
    if comment:
        s = s.ljust(max(COMMENT_COL, len(s) + 2)) + "# " + comment
    return s


def _block_totals(blk: Block, env) -> tuple[dict, dict]:
    """Loads and stores per level for ONE iteration of ``blk`` (inner loops multiplied)."""
    loads, stores = defaultdict(lambda: ZERO), defaultdict(lambda: ZERO)
    inner = Block(blk.kind, items=blk.items)  # trips 1: one iteration
    for t, m in transfers_of(inner):
        table = loads if t.kind == "load" else stores
        for lv in t.levels:
            table[lv] += t.bytes * m
    return loads, stores


def _render(root: Block, env, hw, dtype) -> str:
    out: list[str] = []

    def num(e):
        return _num(e, env) if env is not None else None

    def amount(e, unit=""):
        n = num(e)
        return f"{_fmt_num(n)}{unit}" if n is not None else f"{sympy.sympify(e)}{unit}"

    def nbytes(e):
        n = num(e)
        return _fmt_bytes(n) if n is not None else f"{sympy.sympify(e)} B"

    def line_comment(it: Line) -> str:
        parts = [it.comment] if it.comment else []
        if it.transfer is not None:
            t = it.transfer
            parts.insert(0, f"{amount(t.values, ' values')} ({nbytes(t.bytes)})")
        elif it.var is not None and it.sized:
            parts.append(nbytes(it.var.bytes))
        return "; ".join(parts)

    def io_text(blk):
        loads, stores = _block_totals(blk, env)
        parts = []
        for lv in root.levels[1:]:
            lo, st = loads.get(lv, ZERO), stores.get(lv, ZERO)
            if lo == 0 and st == 0:
                continue
            bits = []
            if lo != 0:
                bits.append(f"loads {nbytes(lo)}")
            if st != 0:
                bits.append(f"stores {nbytes(st)}")
            parts.append(f"{lv} {', '.join(bits)}")
        return "; ".join(parts)

    def peak_text(blk):
        parts = []
        for lv, (vals, byts) in blk.peak.items():
            if lv == root.levels[0]:
                continue
            e = as_max(vals)
            if e == 0:
                continue
            b = _peak_num(byts, env) if env is not None else None
            parts.append(f"peak {lv}: {e} values" + (f" = {_fmt_bytes(b)}" if b is not None
                                                      else ""))
        return "; ".join(parts)

    def walk(blk: Block, depth: int):
        for it in blk.items:
            if isinstance(it, Line):
                out.append(_line(depth, it.text, line_comment(it)))
                continue
            if it.kind == "section":
                if it.comment:
                    out.append(_line(depth, f"# {it.comment}"))
                walk(it, depth)
                continue
            if it.kind == "kernel":
                out.append(_line(depth, it.header, it.comment))
            else:
                what = "groups" if it.kind == "group" else "steps"
                out.append(_line(depth, it.header, f"{it.comment}: {amount(it.trips)} {what}"))
            per = {"group": "per group", "stream": "per step"}.get(it.kind, "in all")
            io = io_text(it)
            if io:
                out.append(_line(depth + 1, f"# {per}: {io}"))
            pk = peak_text(it)
            if pk:
                out.append(_line(depth + 1, f"# {pk}"))
            walk(it, depth + 1)

    walk(root, 0)
    return "\n".join(out)


def _totals(root: Block, env, hw, dtype, program, check, intermediates) -> dict:
    listed = listed_transfers(root)
    listed_b = listed_transfers(root, bytes=True)
    c = cost_of(program, hw, dtype, intermediates=intermediates) if check else None
    rows, notes = [], []
    ok_all = True
    for lv in root.levels:
        tr = listed.get(lv, ZERO)
        trb = listed_b.get(lv, ZERO)
        mem = root.memory[lv]
        if env is not None:
            tn, tbn = _num(tr, env), _num(trb, env)
            mn = _peak_num(root.peak[lv][0], env)
            mbn = _peak_num(root.peak[lv][1], env)
        else:
            tn = tbn = mn = mbn = None
        row = [lv,
               _fmt_num(tn) if tn is not None else str(tr),
               _fmt_bytes(tbn) if tbn is not None else f"{sympy.expand(trb)} B",
               _fmt_num(mn) if mn is not None else str(mem),
               _fmt_bytes(mbn) if mbn is not None else str(root.memory_bytes[lv]) + " B"]
        if c is not None:
            ok = True
            if lv in c.transfers:
                ok &= sympy.expand(c.transfers[lv] - tr) == 0
            if env is not None:
                try:
                    cm = max(_num(e, env) for e in c.memory_candidates[lv])
                    ok &= mn is not None and math.isclose(cm, mn, rel_tol=1e-12)
                except TypeError:
                    pass
            else:
                ok &= set(map(sympy.expand, c.memory_candidates[lv])) == \
                    set(map(sympy.expand, root.peak[lv][0]))
            ok_all &= ok
            row.append("matches napkin.cost" if ok else "DIFFERS from napkin.cost")
        else:
            row.append("-")
        rows.append(row)
    if c is not None and not ok_all:
        notes.append("the listing and napkin.cost disagree: please report (a bug in one of "
                     "them)")
    notes.append("transfers count every load and store above times its loops' trip counts, "
                 "at every level it crosses; peak = the most buffers live at once per instance "
                 "of a level")
    return {"rows": rows, "notes": notes, "ok": ok_all}
