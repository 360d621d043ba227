"""Looped pseudocode of a streamed program: every buffer, load, store and op explicit.

The paper's "hardware-aware derivation" starts by expanding a streamed program into loops in
which every variable has a size, a precision and a memory level, so that memory can be
pre-allocated and the exact transfers of one group are known.  This module prints the
program's schedule (:mod:`napkin.schedule`) that way: one ``for`` loop per group (a grid over
the cores of the group's level) or stream (a sequential fold), the accumulator's init /
update / finalize boxes written out as statements, fused intermediates inlined into the
expression that reads them.

    text = pseudocode(program, "h100", sizes={"q": 4096, ...}, tiles={"g_q": 128, ...})
    schedule = expand(program, "h100", dtype="bf16")      # the structured form
    listed_transfers(schedule)   # {level: values}; what napkin.cost folds too
    listed_memory(schedule, sizes)

**The pseudocode is the cost model, written out**: both read one schedule, so the loads and
stores listed, times the trip counts of their loops, are ``cost(...).transfers``, and the
peak of the buffers declared (with the schedule's liveness: a value read by one elementwise
box is fused into it, an elementwise box may overwrite an input that dies there, the
accumulator state is updated in place) is ``cost(...).memory`` — by construction, not by a
second walk kept equal.

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

import re
from collections import defaultdict
from collections.abc import Mapping

import sympy

from napkin.cost.model import CostError, value_at
from napkin.core.errors import NapkinError
from napkin.hardware import get_hardware
from napkin.schedule import Assign, Buffer, Loop, Move, Schedule, Step, as_max, build

__all__ = ["expand", "listed_memory", "listed_transfers", "pseudocode"]

ZERO = sympy.Integer(0)
_SUFFIX = {"smem": "_blk", "registers": "_reg", "l2": "_l2"}
_ATOM = 9
_FUNCTION_NAMES = {"exp", "log", "max", "min", "sum", "add", "sub", "mul", "div", "einsum",
                   "full", "load", "store", "tanh", "sqrt", "rsqrt", "softmax", "mean"}


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


def _value_or_none(expr, sizes):
    """The value at ``sizes``, or None where a size is missing (the text shows the
    expression instead)."""
    try:
        return None if sizes is None else value_at(expr, sizes)
    except CostError:
        return None


def _peak_num(cands, sizes):
    vals = [_value_or_none(c, sizes) for c in cands]
    return None if any(v is None for v in vals) else max(vals, default=0.0)



def pretty_name(s: str) -> str:
    return re.sub(r"\s+", "", str(s))


# --------------------------------------------------------------------------- expressions
def _expression(box, args) -> tuple[str, int]:
    """Text and precedence of one box applied to argument texts (with precedences)."""
    spec = box.spec
    k = spec.kind
    txt = [a for a, _ in args]

    def paren(a, p, need):
        return f"({a})" if p < need else a
    if k == "contract":
        sig = ",".join(_axes_sig(ob.type.names) for ob in box.dom.inside)
        sig += "->" + _axes_sig(box.cod.inside[0].type.names)
        return f"einsum('{sig}', {', '.join(txt)})", _ATOM
    if spec.infix is not None:
        op, p = spec.infix
        (a, pa), (b, pb) = args
        right_need = p if spec.commutative else p + 1  # a - (b - c), a / (b * c)
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



# --------------------------------------------------------------------------- structured form
def expand(program, hardware, dtype=None, *, intermediates: bool = True) -> Schedule:
    """The program's schedule (:func:`napkin.schedule.build`): what the listing prints."""
    return build(program, hardware, dtype, intermediates=intermediates)


def _moves(loop: Loop, mult=sympy.Integer(1)):
    """Every move below ``loop`` with the number of times it runs per execution of ``loop``."""
    for it, m in loop.walk(mult):
        if isinstance(it, Move):
            yield it, m


def listed_transfers(schedule: Schedule, bytes: bool = False) -> dict:
    """{level: Σ values (or bytes) of the listed loads and stores × trip counts}."""
    out = {lv: ZERO for lv in schedule.levels[1:]}
    for t, m in _moves(schedule.root):
        for lv in t.levels:
            out[lv] += (t.bytes if bytes else t.values) * m
    return {lv: sympy.expand(e) for lv, e in out.items()}


def listed_memory(schedule: Schedule, sizes: Mapping, bytes: bool = False) -> dict:
    """{level: peak values (bytes) of the declared buffers}, evaluated at ``sizes``."""
    k = 1 if bytes else 0
    return {lv: _peak_num(c[k], sizes) for lv, c in schedule.memory.items()}


def _tile_values(tiles) -> dict:
    if tiles is None:
        return {}
    if hasattr(tiles, "values") and not isinstance(tiles, Mapping):
        tiles = tiles.values
    return {str(k): v for k, v in dict(tiles).items()}


def pseudocode(program, hardware, sizes: Mapping | None = None, tiles=None, dtype="bf16",
               fmt: str = "text", *, title: str | None = None,
               intermediates: bool = True) -> str:
    """Looped pseudocode of ``program`` on ``hardware``, with per-loop and total transfers and
    memory (numbers when ``sizes`` and ``tiles`` give every size).

    ``fmt``: "text" (a commented listing) or "markdown" (a heading, the listing in a code
    fence and a table of totals).  ``tiles``: {"g_q": 128, ...} or a ``Tiles``.
    """
    if fmt not in ("text", "markdown"):
        raise NapkinError(f"pseudocode format must be 'text' or 'markdown', got {fmt!r}")
    hw = get_hardware(hardware)
    schedule = expand(program, hw, dtype, intermediates=intermediates)
    env = None
    if sizes is not None or tiles is not None:
        env = {str(k): v for k, v in dict(sizes or {}).items()}
        env.update(_tile_values(tiles))
    code = _render(schedule, env)
    rows = _totals(schedule, env)
    head = title or "streamed program"
    used = _symbols(schedule)
    sz = ", ".join(f"{k}={v}" for k, v in sorted((env or {}).items()) if k in used)
    dt = dtype if isinstance(dtype, str) else ("own dtypes" if dtype is None else
                                               ", ".join(f"{k}:{v}" for k, v in dtype.items()))
    sub = f"{hw.name} ({' > '.join(schedule.levels)}), {dt}" + (f"; {sz}" if sz else "")
    if fmt == "markdown":
        table = ["| level | transfers (values) | bytes | peak memory (values) | bytes |",
                 "|---|---|---|---|---|"]
        table += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([f"### {head}", "", sub, "", "```python", code, "```", "",
                          *table, "", f"- {NOTES}"]) + "\n"
    lines = [f"# {head} on {sub}", code, "", "# totals (all iterations):"]
    for r in rows:
        lines.append(f"#   {r[0]:<10} transfers {r[1]} values ({r[2]}); peak {r[3]} values "
                     f"({r[4]})")
    lines.append(f"# {NOTES}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- rendering
INDENT = "    "
COMMENT_COL = 58


def _line(indent: int, text: str, comment: str = "") -> str:
    s = INDENT * indent + text
    if comment:
        s = s.ljust(max(COMMENT_COL, len(s) + 2)) + "# " + comment
    return s


class _Listing:
    """One pass over a schedule, writing each item as a line of the listing."""

    def __init__(self, schedule: Schedule, env):
        self.s, self.env, self.out = schedule, env, []
        self.used: set = set()
        self.names: dict = {}                 # id(Buffer) -> its unique name
        self.loops = defaultdict(list)        # axis -> [(loop variable, tile)], outer first
        self.loopvars: set = set()
        self.aliases: list = []               # the kernels' placeholders -> this program's
        self.level = 0                        # level index of the body being listed

    # -- numbers -------------------------------------------------------------------------
    def num(self, e):
        return _value_or_none(e, self.env) if self.env is not None else None

    def amount(self, e, unit=""):
        n = self.num(e)
        return f"{_fmt_num(n)}{unit}" if n is not None else f"{sympy.sympify(e)}{unit}"

    def nbytes(self, e):
        n = self.num(e)
        return _fmt_bytes(n) if n is not None else f"{sympy.sympify(e)} B"

    # -- names ---------------------------------------------------------------------------
    def buf(self, b: Buffer) -> Buffer:
        for table in reversed(self.aliases):
            b = table.get(b, b)
        return b

    def name(self, b: Buffer) -> str:
        b = self.buf(b)
        if id(b) not in self.names:
            if b.role == "next":
                self.names[id(b)] = self.name(b.in_place_of) + "'"
            else:
                self.names[id(b)] = self.unique(self.base_name(b))
        return self.names[id(b)]

    @staticmethod
    def base_name(b: Buffer) -> str:
        if b.role == "state":
            return b.array
        plain = _ident(b.array)
        if plain in _FUNCTION_NAMES:  # a value called "exp" reads like a call
            plain = f"{plain}_{_axes_sig(a for a, _ in b.axes).replace(' ', '_')}"
        if b.role in ("temp", "array"):
            return plain
        return plain + _SUFFIX.get(b.level, "_" + b.level)

    def unique(self, name: str) -> str:
        base, k = _ident(name), 2
        out = base
        while out in self.used:
            out = f"{base}_{k}"
            k += 1
        self.used.add(out)
        return out

    def decl(self, b: Buffer) -> str:
        b = self.buf(b)
        return f"{self.name(b)}: {b.dtype}[{', '.join(_size(s) for _, s in b.axes)}] @{b.level}"

    def view(self, b: Buffer) -> str:
        """``b`` as seen from the current loops: sliced along axes tiled since it was made."""
        b = self.buf(b)
        parts, partial = [], False
        for a, _ in b.axes:
            extra = self.loops[a][b.base.get(a, 0):]
            if extra:
                start = "+".join(v for v, _ in extra)
                parts.append(f"{start}:{start}+{_size(extra[-1][1])}")
                partial = True
            else:
                parts.append(":")
        return f"{self.name(b)}[{', '.join(parts)}]" if partial else self.name(b)

    def loop_var(self, axis: str) -> str:
        k = 0
        while f"{axis}{k}" in self.loopvars:
            k += 1
        self.loopvars.add(f"{axis}{k}")
        return f"{axis}{k}"

    # -- lines ---------------------------------------------------------------------------
    def line(self, depth: int, text: str, comment: str = ""):
        self.out.append(_line(depth, text, comment))

    def declare(self, depth: int, b: Buffer):
        bits = [b.note] if b.note else []
        if b.role != "array":
            bits.append(self.nbytes(b.bytes))
        self.line(depth, self.decl(b), "; ".join(bits))

    def move(self, depth: int, m: Move):
        kind = m.kind
        s, d = ((self.view(m.src), self.name(m.dst)) if kind == "load"
                else (self.name(m.src), self.view(m.dst)))
        bits = [f"{self.amount(m.values, ' values')} ({self.nbytes(m.bytes)})"]
        if len(m.levels) > 1 and kind == "load":
            bits.append(f"via {', '.join(m.levels[:-1])}")
        self.line(depth, f"{kind} {s} -> {d}", "; ".join(bits))

    def arg(self, a) -> tuple[str, int]:
        if isinstance(a, Step):
            text, prec = _expression(a.box, [self.arg(x) for x in a.args])
            return text, prec
        return self.view(a), _ATOM

    @staticmethod
    def note_of(step: Step) -> str:
        """The names of the boxes a statement stands for (its own, and those fused in)."""
        inner = [_Listing.note_of(a) for a in step.args if isinstance(a, Step)]
        own = step.box.name if pretty_name(step.box.name) != pretty_name(step.spec.label()) \
            else ""
        return ", ".join(filter(None, inner + [own]))

    def step(self, depth: int, st: Step, section: str):
        if st.fused:
            return
        text, _ = _expression(st.box, [self.arg(a) for a in st.args])
        note = self.note_of(st)
        targets, decls = [], []
        for b in st.outs:
            b = self.buf(b)
            if b.role in ("next", "state") or b.level != self.s.levels[self.level]:
                targets.append(self.name(b))  # the caller's buffer (the state, its next value)
                continue
            bits = []
            if b.in_place_of is not None:
                bits.append(f"in place over {self.name(b.in_place_of)}")
            elif not b.counted:
                bits.append("not counted (intermediates=False)")
            decls.append((b, bits, b.in_place_of is None and b.counted))
            targets.append(self.decl(b))
        comment = "; ".join(filter(None, [note] + [", ".join(d[1]) for d in decls]))
        if any(t.endswith("'") for t in targets):
            comment = "; ".join(filter(None, [comment, "next state, in place"]))
        outs = [self.buf(b) for b in st.outs]
        if section == "init" and len(outs) == 1 and outs[0].role == "state":
            self.line(depth, f"{self.decl(outs[0])} = {text}",
                      "; ".join(filter(None, [comment, "state", self.nbytes(outs[0].bytes)])))
            return
        one = len(decls) == 1 and len(targets) == 1
        if one and decls[0][2]:
            comment = "; ".join(filter(None, [comment, self.nbytes(decls[0][0].bytes)]))
        self.line(depth, f"{', '.join(targets)} = {text}", comment)
        if not one:
            for b, _, sized in decls:
                self.line(depth, f"# {self.decl(b)}", self.nbytes(b.bytes) if sized else "")

    def io_text(self, loop: Loop) -> str:
        """Loads and stores per level of ONE iteration of ``loop`` (inner loops multiplied)."""
        loads, stores = defaultdict(lambda: ZERO), defaultdict(lambda: ZERO)
        for m, k in _moves(Loop(loop.kind, loop.level, items=loop.items)):
            table = loads if m.kind == "load" else stores
            for lv in m.levels:
                table[lv] += m.bytes * k
        parts = []
        for lv in self.s.levels[1:]:
            lo, st = loads.get(lv, ZERO), stores.get(lv, ZERO)
            bits = ([f"loads {self.nbytes(lo)}"] if lo != 0 else []) + \
                   ([f"stores {self.nbytes(st)}"] if st != 0 else [])
            if bits:
                parts.append(f"{lv} {', '.join(bits)}")
        return "; ".join(parts)

    def peak_text(self, loop: Loop) -> str:
        parts = []
        for i, pk in sorted(loop.peaks().items()):
            if i == 0:
                continue
            e = as_max(pk.vals)
            if e == 0:
                continue
            b = _peak_num(pk.byts, self.env) if self.env is not None else None
            parts.append(f"peak {self.s.levels[i]}: {e} values"
                         + (f" = {_fmt_bytes(b)}" if b is not None else ""))
        return "; ".join(parts)

    # -- the walk ------------------------------------------------------------------------
    def items(self, loop: Loop, depth: int, section: str = ""):
        for it in loop.items:
            if isinstance(it, Buffer):
                self.declare(depth, it)
            elif isinstance(it, Move):
                self.move(depth, it)
            elif isinstance(it, Step):
                self.step(depth, it, section)
            elif isinstance(it, Assign):
                self.line(depth, f"{', '.join(self.name(s) for s, _ in it.pairs)} = "
                                 f"{', '.join(self.name(n) for _, n in it.pairs)}",
                          "the state, updated in place")
            else:
                self.loop(it, depth)

    def loop(self, lp: Loop, depth: int):
        if lp.kind == "use":
            self.aliases.append(lp.aliases)
            self.items(lp, depth)
            self.aliases.pop()
            return
        if lp.kind == "section":
            self.line(depth, f"# {lp.note}")
            self.items(lp, depth, "init" if lp.note.startswith("init") else "finalize")
            return
        outer = self.level
        if lp.kind == "kernel":
            self.line(depth, f"kernel {lp.name}:", lp.note)
        else:
            var = self.loop_var(lp.axis)
            what = "groups" if lp.kind == "group" else "steps"
            caption = (f"group {lp.axis} @{lp.level}, {lp.where}" if lp.merge_only else
                       f"group {lp.axis}: {lp.where}" if lp.kind == "group" else lp.where)
            self.line(depth, f"for {var} in range(0, {_size(lp.full)}, {_size(lp.size)}):",
                      f"{caption}: {self.amount(lp.trips)} {what}")
            self.loops[lp.axis].append((var, lp.size))
        per = {"group": "per group", "stream": "per step"}.get(lp.kind, "in all")
        io = self.io_text(lp)
        if io:
            self.line(depth + 1, f"# {per}: {io}")
        if lp.overlap:
            self.line(depth + 1, f"# overlap: {lp.overlap}")
        if lp.kind == "kernel" or (lp.kind == "group" and not lp.merge_only and lp.at > outer):
            pk = self.peak_text(lp)
            if pk:
                self.line(depth + 1, f"# {pk}")
        if not lp.merge_only:
            self.level = lp.at
        self.items(lp, depth + 1)
        self.level = outer
        if lp.kind != "kernel":
            self.loops[lp.axis].pop()


def _render(schedule: Schedule, env) -> str:
    listing = _Listing(schedule, env)
    listing.items(schedule.root, 0)
    return "\n".join(listing.out)


def _symbols(schedule: Schedule) -> set:
    """Names of every size symbol the listing mentions."""
    out = set()
    for it, _ in schedule.walk():
        if isinstance(it, Buffer):
            for _, sz in it.axes:
                out |= {s.name for s in sympy.sympify(sz).free_symbols}
        elif isinstance(it, Loop):
            out |= {s.name for s in sympy.sympify(it.trips).free_symbols}
    return out


def _totals(schedule: Schedule, env) -> list:
    """One row per level: transfers (values, bytes) and peak memory (values, bytes)."""
    listed, listed_b = listed_transfers(schedule), listed_transfers(schedule, bytes=True)
    rows = []
    for lv in schedule.levels:
        tr, trb = listed.get(lv, ZERO), listed_b.get(lv, ZERO)
        vals, byts = schedule.memory[lv]
        tn, tbn = _value_or_none(tr, env), _value_or_none(trb, env)
        mn, mbn = _peak_num(vals, env), _peak_num(byts, env)
        rows.append([lv, _fmt_num(tn) if tn is not None else str(tr),
                     _fmt_bytes(tbn) if tbn is not None else f"{sympy.expand(trb)} B",
                     _fmt_num(mn) if mn is not None else str(as_max(vals)),
                     _fmt_bytes(mbn) if mbn is not None else f"{as_max(byts)} B"])
    return rows


NOTES = ("transfers count every load and store above times its loops' trip counts, at every "
         "level it crosses; peak = the most buffers live at once per instance of a level; "
         "napkin.cost folds this same schedule")
