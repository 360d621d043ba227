"""Lowering a streamed program to one Pallas kernel (Triton backend).

One generic lowering, no per-algorithm kernels:

* **Groups → grid and BlockSpecs.**  The nested :class:`~napkin.streamed.Group`
  boxes at the top of the program (the GMEM → on-chip boundary) become the
  ``pallas_call`` grid, one dimension per grouped axis in nesting order.  Every
  input and output gets a BlockSpec whose block is the array with each grouped
  axis cut to its group size; an input lacking a grouped axis (broadcast) gets
  an index map that ignores that grid dimension.  The innermost group body is
  the kernel body.
* **Streams → fori_loop.**  A :class:`~napkin.streamed.Stream` box in the body
  becomes an in-kernel ``lax.fori_loop`` over chunks.  Its streamed inputs keep
  the whole streamed axis in their block (rounded up to a power of two) and
  each iteration loads one chunk with ``pl.ds(start, chunk)``.  The
  accumulator's init / update / finalize diagrams run box by box through
  :func:`napkin.semantics.box_function` with an :class:`EvalContext` whose
  ``offsets`` hold the global start of every grouped axis
  (``pl.program_id(i) * g``) and of the chunk, and whose ``env`` binds every
  size symbol to its static value.
* **Boxes → code, through the semantics.**  The context's array namespace is a
  :class:`~napkin.lower.emit.Recorder`: evaluating a box *writes* its JAX code.
  So the kernel is Python source (``LoweredKernel.source``) produced by the
  same box mapping that defines the reference semantics, and the callable
  kernel is that very source, executed.

Ragged sizes
------------
Only static shapes reach a kernel, so raggedness is known when it is written.

* A grouped axis that the group size does not divide: the last tile overhangs
  the array.  Loads of such tiles are masked (``plt.load(mask=, other=0)``) and
  stores are masked (``plt.store(mask=)``: jax ≤ 0.11 does not mask partial
  blocks itself).  Grouped axes are woven — no box reduces them — so the
  padded rows never reach a valid row.
* A streamed axis that the chunk does not divide: the full chunks run in the
  loop unmasked; the ragged last chunk runs a second copy of the update
  ("tail") whose loads are masked with ``other=0`` (interpret mode pads with
  NaN, and 0·NaN = NaN) and in which every box that *reduces* the streamed axis
  sees its inputs with the positions past the end replaced by the reduction's
  neutral element (0 for sums and contractions, −∞ for max / logsumexp /
  softmax), via ``jnp.where`` before the reduction.  reduce(where(valid, x, e))
  equals reduce over the valid prefix, which is what the reference semantics
  (``Stream.evaluate`` slicing a short last piece) computes; boxes woven over
  the axis act position by position, so their garbage at invalid positions is
  discarded by the select.  No per-accumulator padding value is needed.

Tile skipping
-------------
When the stream's update holds causal / window :class:`~napkin.primitives.Mask`
boxes with the streamed axis as key axis and a grouped (or whole) axis as
query axis, the loop bounds shrink to the chunks that hold a kept key for some
valid row of the tile: for rows [r0, r1] the kept keys are
[max(0, r0 + off − w + 1), min(n, r1 + off + 1)).  Skipping is exact only where
a masked entry is *absorbed* by the accumulator: the mask's fill (−1e30) may
flow only into max / logsumexp, or through a row shift and ``exp`` (which turn
it into exactly 0) into sums and contractions — the softmax-contraction
(FlashAttention), logsumexp and max accumulators.  This is checked on the
update diagram; otherwise the loop visits every chunk.

A row whose keys are *all* masked means zeros, in the diagram semantics (softmax
of a row whose maximum is still the fill is 0: napkin.primitives.MASKED) and in
the plain-jnp references; the softmax-contraction accumulator's finalize guards
o/z by its running max, so the kernel returns zeros too — finite, never NaN
(0/0 of an empty loop is discarded by the guard's ``where``).  A tile that holds
such a row still visits every chunk, which is correct if not the fastest.  Rows with at least one kept
key are unaffected by skipped chunks: their contribution is exp(−1e30 − μ) = 0
exactly, or is rescaled by exp(−1e30 − μ′) = 0 once a kept key arrives.
"""
from __future__ import annotations

import itertools
import linecache
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin.arrays import array_types, canonical_dtype
from napkin.errors import NapkinError, ShapeError
from napkin.ir import to_graph
from napkin.lower.emit import Recorder, Var, Writer, dtype_name, identifier
from napkin.primitives import JNP_DTYPES, EvalContext, align
from napkin.semantics import bind_sizes, box_function, fold_boxes

I32 = jax.ShapeDtypeStruct((), jnp.int32)
# XLA options for interpret-mode kernels: compile ~3x faster, run a little slower.
INTERPRET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                              "xla_llvm_disable_expensive_passes": True}
_counter = itertools.count()
# Triton launch parameters (warps per program, software-pipelining stages): the defaults,
# since nothing chooses them yet
LAUNCH = {"num_warps": 4, "num_stages": 2}


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _symbol(key):
    return sympy.Symbol(key, integer=True, positive=True) if isinstance(key, str) else key


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
        spec = node["box"].data
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


# ------------------------------------------------------------------ analysis of masks
def absorbing(update, axis: str) -> str | None:
    """Why masked entries of the update are *not* absorbed (None when they are).

    Tags follow the mask's output: NEG (masked positions hold the fill, about
    −1e30) and ZERO (masked positions hold exactly 0).  NEG may be scaled by a
    positive constant, shifted by a value without the streamed axis, re-masked
    or reduced by max / logsumexp over the axis; exp turns NEG into ZERO; ZERO
    may be multiplied and summed or contracted over the axis.
    """
    g = to_graph(update)
    out_values = set(g.graph["outputs"])
    work = []
    for n in g.nodes:
        spec = g.nodes[n].get("box") and g.nodes[n]["box"].data
        if g.nodes[n]["kind"] == "op" and getattr(spec, "kind", None) == "mask" \
                and spec.kind_ in ("causal", "window") and spec.k == axis:
            if spec.fill > -1e4:
                return f"mask fill {spec.fill} is not a large negative"
            work += [(v, "NEG") for v in g.nodes[n]["outs"]]
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
            new = node["box"].data.absorbs(tag, node["ins"].index(v), ins, axis)
            if new is None:
                return f"{node['box'].name} does not absorb masked entries"
            if new != "ABSORBED":
                work += [(u, new) for u in node["outs"]]
    return None


# ------------------------------------------------------------------ the kernel writer
class RefWire:
    """A kernel input not loaded yet (a wire still in HBM)."""

    def __init__(self, index: int):
        self.index = index


@dataclass
class InputPlan:
    name: str               # identifier in the source
    type: object            # body-level ArrayType
    shape: tuple            # full array shape
    dtype: object
    block: tuple            # block shape
    index: tuple            # per dim: grid index position or None
    streamed: set = field(default_factory=set)
    whole: bool = False


@dataclass
class KernelPlan:
    """One specialisation of a lowered kernel to concrete shapes."""
    source: str
    grid: tuple
    block_shapes: dict
    in_shapes: list
    out_shapes: list
    in_names: list
    out_names: list
    forward: object
    notes: list
    calls: dict = field(default_factory=dict, repr=False)

    def call(self, *operands, interpret: bool):
        if any(isinstance(x, jax.core.Tracer) for x in operands):  # inside jit / vmap / grad
            return self.forward(*operands, interpret=bool(interpret))
        return self.calls[bool(interpret)](*operands, interpret=bool(interpret))


class _Writer:
    """Writes one kernel for concrete shapes (see the module doc)."""

    def __init__(self, kernel: LoweredKernel, shapes, dtypes):
        self.k = kernel
        self.st = kernel.structure
        self.w = Writer()
        self.xp = Recorder(self.w, kernel.f32_precision)
        self.notes: list[str] = []
        prog_in = array_types(kernel.program.dom)
        dummies = [np.broadcast_to(np.zeros((), bool), s) for s in shapes]
        env = bind_sizes(prog_in, dummies, kernel.tiles,
                         [str(ob) for ob in kernel.program.dom.inside])
        self.env = env
        self.sizes = {}
        for t in prog_in + array_types(kernel.program.cod):
            for a in t.axes:
                val = sympy.sympify(a.size).subs(env)
                if val.is_Number:
                    self.sizes.setdefault(a.name, int(val))
        self.in_shapes, self.in_dtypes = [tuple(s) for s in shapes], list(dtypes)
        self.groups = []
        for spec in self.st.groups:
            gsize = kernel.size_of(spec.size, f"group {spec.axis}")
            n = self.sizes[spec.axis]
            self.groups.append((spec.axis, gsize, n))
            if isinstance(spec.size, sympy.Symbol):
                self.env[spec.size] = gsize
        self.gaxes = {a: i for i, (a, _, _) in enumerate(self.groups)}
        self.grid = tuple(-(-n // g) for _, g, n in self.groups) or (1,)
        self.scopes: list[dict] = [{}]
        self.loaded: dict[int, Var] = {}

    # ---------------------------------------------------------------- helpers
    def full_size(self, t, axis):
        if axis in self.gaxes:
            return self.groups[self.gaxes[axis]][2]
        return int(sympy.sympify(t.axis(axis).size).subs(self.env))

    def ragged(self, axis):
        if axis not in self.gaxes:
            return False
        _, g, n = self.groups[self.gaxes[axis]]
        return n % g != 0

    def ok_vector(self, axis):
        for scope in reversed(self.scopes):
            if ("ok", axis) in scope:
                return scope[("ok", axis)]
        raise NapkinError(f"internal: no validity vector for {axis}")

    def mask_for(self, names, extra=None):
        """A boolean mask broadcast over ``names`` (ragged grouped axes, plus
        ``extra``: (axis, ok vector) of a ragged chunk)."""
        parts = [(a, self.ok_vector(a)) for a in names if self.ragged(a)]
        if extra is not None and extra[0] in names and extra[1] is not None:
            parts.append(extra)
        if not parts:
            return None
        key = ("mask", tuple(names), tuple(id(v) for _, v in parts))
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        mask = None
        for a, ok in parts:
            m = align(self.xp, ok, (a,), tuple(names)) if len(names) > 1 else ok
            mask = m if mask is None else mask & m
        self.w.rename(mask, "_".join(a for a, _ in parts) + "_mask")
        self.scopes[-1][key] = mask
        return mask

    # ---------------------------------------------------------------- inputs
    def plan_inputs(self):
        body = self.st.body
        g = to_graph(body)
        types = array_types(body.dom)
        names = [ob.name for ob in body.dom.inside]
        prog_names = [ob.name for ob in self.k.program.dom.inside]
        self.inputs: list[InputPlan] = []
        arg_names = _unique([identifier(nm, "x") for nm in names])
        for i, (v, t) in enumerate(zip(g.graph["inputs"], types)):
            streamed, whole = set(), v in g.graph["outputs"]
            for n in g.successors(v):
                node = g.nodes[n]
                spec = node["box"].data
                for port, u in enumerate(node["ins"]):
                    if u != v:
                        continue
                    if spec.kind == "stream" and t.has(spec.axis):
                        streamed.add(spec.axis)
                    else:
                        whole = True
            p = self.st.in_map[i]
            shape = self.in_shapes[p]
            block, index = [], []
            for d, a in enumerate(t.names):
                n = shape[d]
                if a in self.gaxes:
                    block.append(self.groups[self.gaxes[a]][1])
                    index.append(self.gaxes[a])
                    continue
                index.append(None)
                if a in streamed:
                    chunk = self.k.chunk_of(a)
                    padded = max(pow2_at_least(n), chunk)
                    if whole and padded != n:
                        raise NapkinError(
                            f"input {prog_names[p]}: axis {a}={n} is streamed and also used "
                            f"whole; the Triton backend needs it to be a power of two >= the "
                            f"chunk {chunk}")
                    block.append(padded)
                else:
                    if not is_pow2(n):
                        raise NapkinError(
                            f"input {prog_names[p]}: axis {a}={n} is loaded whole into every "
                            f"program; the Triton backend needs a power of two (pad it, or "
                            f"group or stream {a})")
                    block.append(n)
            self.inputs.append(InputPlan(arg_names[i], t, shape, self.in_dtypes[p], tuple(block), tuple(index),
                                         streamed, whole))
        for ip in self.inputs:
            ip.ref = self.w.fresh(f"{ip.name}_ref")
        self.out_args = _unique([identifier(ob.name, "out") for ob in body.cod.inside])

    def load_whole(self, wire: RefWire) -> Var:
        if wire.index in self.loaded:
            return self.loaded[wire.index]
        ip = self.inputs[wire.index]
        for d, a in enumerate(ip.type.names):
            if a in ip.streamed and ip.block[d] != ip.shape[d]:
                raise NapkinError(f"{ip.name}: axis {a} is padded to {ip.block[d]} for streaming "
                                  f"and cannot be loaded whole")
        mask = self.mask_for(ip.type.names)
        aval = jax.ShapeDtypeStruct(ip.block, ip.dtype)
        if mask is None:
            var = self.w.let(f"{ip.ref}[...]", name=ip.name, aval=aval)
        else:
            var = self.w.let(f"plt.load({ip.ref}, mask={{0}}, other={self.zero(ip.dtype)})",
                             mask, name=ip.name, aval=aval)
        var.temp = False
        # a whole load made inside a loop body stays there; cache at kernel level only
        if len(self.scopes) == 1:
            self.loaded[wire.index] = var
        return var

    @staticmethod
    def zero(dtype):
        return "0.0" if jnp.issubdtype(dtype, jnp.floating) else "0"

    def load_chunk(self, wire: RefWire, axis, start: Var, chunk: int, ok) -> Var:
        ip = self.inputs[wire.index]
        idx = []
        shape = list(ip.block)
        for d, a in enumerate(ip.type.names):
            if a == axis:
                idx.append(f"pl.ds({start}, {chunk})")
                shape[d] = chunk
            else:
                idx.append(":")
        mask = self.mask_for(ip.type.names, (axis, ok))
        aval = jax.ShapeDtypeStruct(tuple(shape), ip.dtype)
        where = ", ".join(idx)
        if mask is None:
            var = self.w.let(f"{ip.ref}[{where}]", name=ip.name, aval=aval)
        else:
            var = self.w.let(f"plt.load({ip.ref}.at[{where}], mask={{0}}, "
                             f"other={self.zero(ip.dtype)})", mask, name=ip.name, aval=aval)
        var.temp = False
        return var

    # ---------------------------------------------------------------- running diagrams
    def run(self, diagram, ctx, wires, valid=None):
        """Evaluate ``diagram`` box by box, writing code (cf. semantics._run_boxes).

        ``valid``: (axis, ok vector) inside the ragged tail of a stream: boxes
        that reduce the axis see invalid positions as their neutral element."""
        def apply(box, args):
            kind = getattr(box.data, "kind", None)
            if kind == "stream":
                return self.stream(box, ctx, args)
            if kind == "group":
                raise NapkinError(f"{box.name}: a group inside the kernel body (below the "
                                  f"grid) is not supported by the Triton lowering")
            args = [self.load_whole(a) if isinstance(a, RefWire) else a for a in args]
            if valid is not None and valid[1] is not None:
                args = self.neutralise(box, args, valid)
            out = list(box_function(box, ctx)(*args))
            for var, ob in zip(out, box.cod.inside):
                self.w.rename(var, ob.name, None if identifier(ob.name) == ob.name else box.name)
            return out
        return fold_boxes(diagram, wires, apply)

    def neutralise(self, box, args, valid):
        axis, ok = valid
        ins, outs = array_types(box.dom), array_types(box.cod)
        if not any(t.has(axis) for t in ins):
            return args
        neutral = box.data.neutral(axis)  # what the box declares pads its reduction
        if neutral is None and any(t.has(axis) for t in outs):
            return args  # woven over the axis: position by position
        if neutral is None:
            raise NapkinError(f"{box.name} reduces the streamed axis {axis}; the lowering knows "
                              f"no neutral element for it (ragged chunks need one): make {axis} "
                              f"a multiple of the chunk")
        out = []
        for t, x in zip(ins, args):
            if t.has(axis):
                key = ("valid", axis, t.names)
                keep = self.scopes[-1].get(key)
                if keep is None:
                    keep = align(self.xp, ok, (axis,), t.names) if len(t.names) > 1 else ok
                    self.w.rename(keep, f"{axis}_valid")
                    self.scopes[-1][key] = keep
                x = self.xp.where(keep, x, neutral)
            out.append(x)
        return out

    # ---------------------------------------------------------------- streams
    def stream(self, box, ctx, args):
        spec = box.data
        w, xp = self.w, self.xp
        ins = array_types(box.dom)
        ax = spec.axis
        if ax in self.gaxes:
            raise NapkinError(f"stream {ax}: the axis is also grouped; not supported")
        s = self.k.size_of(spec.chunk, f"stream {ax}")
        n = self.full_size(next(t for t in ins if t.has(ax)), ax)
        streamed = [i for i, t in enumerate(ins) if t.has(ax)]
        for i in streamed:
            if not isinstance(args[i], RefWire):
                raise NapkinError(f"stream {ax}: its input {box.dom.inside[i].name} is computed "
                                  f"inside the kernel; the lowering streams kernel inputs only")
        fixed = [self.load_whole(a) if isinstance(a, RefWire) else a
                 for i, a in enumerate(args) if i not in streamed]
        n_chunks, n_full, tail = -(-n // s), n // s, n % s
        w.line()
        w.comment(f"stream {ax}: {n} in chunks of {s}"
                  + (f" ({n_full} full + a ragged tail of {tail})" if tail else "")
                  + f", accumulator {spec.rule}")
        env = dict(ctx.env)
        if isinstance(spec.chunk, sympy.Symbol):
            env[spec.chunk] = s
        state = self.run(spec.init, EvalContext(env, ctx.offsets, xp), [])
        for var, ob in zip(state, spec.init.cod.inside):
            w.rename(var, ob.name)
        bounds = self.skip_bounds(spec, ctx, ax, s, n, n_chunks)

        def step(kind):
            fn = w.fresh(f"{ax}_{kind}")
            c = w.fresh("c")
            w.line(f"def {fn}({c}, carry):")
            w.indent()
            self.scopes.append({})
            st_in = []
            for var, ob in zip(state, spec.init.cod.inside):
                v = Var(w, w.fresh(ob.name), var.aval, temp=False)
                st_in.append(v)
            w.line(f"{', '.join(v.name for v in st_in)}{',' if len(st_in) == 1 else ''} = carry")
            start = w.let(f"{c} * {s}", name=f"{ax}0", aval=I32)
            ok = None
            if kind == "tail":
                ok = w.let(f"{{0}} + jnp.arange({s}) < {n}", start, name=f"{ax}_ok")
                self.scopes[-1][("ok", ax)] = ok
            chunk_args, it = [], iter(fixed)
            for i, a in enumerate(args):
                chunk_args.append(self.load_chunk(a, ax, start, s, ok) if i in streamed
                                  else next(it))
            offsets = dict(ctx.offsets)
            offsets[ax] = start
            sub = EvalContext(env, offsets, xp)
            new = self.run(spec.update, sub, st_in + chunk_args, valid=(ax, ok))
            outs = []
            for var, init in zip(new, state):
                if (var.shape, var.dtype, getattr(var.aval, "weak_type", False)) != \
                        (init.shape, init.dtype, False):
                    if var.shape != init.shape:
                        raise NapkinError(f"stream {ax}: the update changes the state's shape "
                                          f"{init.shape} -> {var.shape}")
                    var = w.let(f"{{0}}.astype({dtype_name(init.dtype)})", var)
                outs.append(var)
            w.line(f"return ({', '.join(v.name for v in outs)}{',' if len(outs) == 1 else ''})")
            self.scopes.pop()
            w.dedent()
            return fn

        def unpack(expr):
            names = [w.fresh(ob.name) for ob in spec.init.cod.inside]
            w.line(f"{', '.join(names)}{',' if len(names) == 1 else ''} = {expr}")
            return [Var(w, nm, v.aval, temp=False) for nm, v in zip(names, state)]

        def carry(vs):
            return f"({', '.join(v.name for v in vs)}{',' if len(vs) == 1 else ''})"

        full_fn = step("chunk") if n_full else None
        tail_fn = step("tail") if tail else None
        if bounds is None:
            if n_full == 1:
                state = unpack(f"{full_fn}(0, {carry(state)})")
            elif n_full:
                state = unpack(f"lax.fori_loop(0, {n_full}, {full_fn}, {carry(state)})")
            if tail:
                state = unpack(f"{tail_fn}({n_full}, {carry(state)})")
        elif all(isinstance(b, int) for b in bounds):  # static skipping
            lo, hi = bounds
            if min(hi, n_full) > lo:
                state = unpack(f"lax.fori_loop({lo}, {min(hi, n_full)}, {full_fn}, "
                               f"{carry(state)})")
            if tail and lo <= n_full < hi:
                state = unpack(f"{tail_fn}({n_full}, {carry(state)})")
        else:
            lo, hi = bounds
            if n_full:
                state = unpack(f"lax.fori_loop({lo}, jnp.minimum({hi}, {n_full}), {full_fn}, "
                               f"{carry(state)})")
            if tail:
                start = n_full if isinstance(lo, int) else f"jnp.maximum({lo}, {n_full})"
                state = unpack(f"lax.fori_loop({start}, {hi}, {tail_fn}, "
                               f"{carry(state)})  # the ragged tail: 0 or 1 trip")
        fin = EvalContext(env, ctx.offsets, xp)
        return self.run(spec.finalize, fin, state + fixed)

    def skip_bounds(self, spec, ctx, ax, s, n, n_chunks):
        masks = [b.data for b in spec.update.boxes
                 if getattr(getattr(b, "data", None), "kind", None) == "mask"
                 and b.data.kind_ in ("causal", "window") and b.data.k == ax]
        if not masks:
            return None
        qa = masks[0].q
        masks = [m for m in masks if m.q == qa]
        why = absorbing(spec.update, ax)
        if why:
            self.w.comment(f"no tile skipping: {why}")
            self.notes.append(f"stream {ax}: no tile skipping ({why})")
            return None
        w = self.w
        lows = [m.offset - m.width + 1 for m in masks if m.kind_ == "window"]
        lo_c = max(lows) if lows else None
        high = min(m.offset + 1 for m in masks)
        if qa not in self.gaxes:  # the query axis is whole: static bounds
            nq = self.sizes.get(qa)
            if nq is None:
                return None
            rng = [(max(0, i + lo_c) if lo_c is not None else 0, min(n, i + high))
                   for i in (0, nq - 1)]
            if any(a >= b for a, b in rng):
                return None
            self.notes.append(f"stream {ax}: static tile skipping from the {qa}/{ax} masks")
            return rng[0][0] // s, -(-rng[1][1] // s)
        _, g, nq = self.groups[self.gaxes[qa]]
        first = ctx.offsets[qa]
        last = w.let(f"jnp.minimum({{0}} + {g}, {nq}) - 1", first, name=f"{qa}_last")

        def key_range(row):
            lo = f"jnp.maximum({row} + {lo_c}, 0)" if lo_c is not None else "0"
            return lo, f"jnp.minimum({row} + {high}, {n})"
        w.comment(f"tile skipping: only the chunks of {ax} that hold a key the "
                  f"{'/'.join(dict.fromkeys(m.kind_ for m in masks))} mask keeps for a row of "
                  f"this tile;")
        w.comment("a tile with a fully masked row visits all chunks (the guard makes "
                  "that row zero)")
        a0, b0 = key_range(first)
        a1, b1 = key_range(last)
        empty = w.let(f"({a0} >= {b0}) | ({a1} >= {b1})", name=f"{qa}_masked_row",
                      aval=jax.ShapeDtypeStruct((), jnp.bool_))
        lo = 0 if lo_c is None else w.let(f"jnp.where({{0}}, 0, {a0} // {s})", empty,
                                          name=f"{ax}_lo", aval=I32)
        hi = w.let(f"jnp.where({{0}}, {n_chunks}, ({b1} + {s - 1}) // {s})", empty,
                   name=f"{ax}_hi", aval=I32)
        self.notes.append(f"stream {ax}: tile skipping from the {qa}/{ax} masks")
        return lo, hi

    # ---------------------------------------------------------------- the module
    def write(self) -> KernelPlan:
        k, st, w = self.k, self.st, self.w
        self.plan_inputs()
        body_outs = array_types(st.body.cod)
        out_names = [ob.name for ob in st.body.cod.inside]
        out_dtypes = [np.dtype(k.dtype if k.dtype is not None else JNP_DTYPES[t.dtype])
                      for t in body_outs]
        self.outputs = []
        for i, t in enumerate(body_outs):
            shape, block, index = [], [], []
            for a in t.names:
                n = self.sizes.get(a)
                if n is None:
                    n = int(sympy.sympify(t.axis(a).size).subs(self.env))
                shape.append(n)
                if a in self.gaxes:
                    block.append(self.groups[self.gaxes[a]][1])
                    index.append(self.gaxes[a])
                else:
                    if not is_pow2(n):
                        raise NapkinError(f"output {out_names[i]}: axis {a}={n} is written whole "
                                          f"by every program; the Triton backend needs a power "
                                          f"of two (group it, or pad it)")
                    block.append(n)
                    index.append(None)
            name = self.out_args[i]
            self.outputs.append(dict(name=name, ref=w.fresh(f"{name}_ref"), type=t,
                                     shape=tuple(shape), block=tuple(block), index=tuple(index),
                                     dtype=out_dtypes[i]))
        body_lines = self.write_kernel()
        return self.assemble(body_lines)

    def write_kernel(self):
        w, xp = self.w, self.xp
        refs = [ip.ref for ip in self.inputs] + [o["ref"] for o in self.outputs]
        w.line(f"def kernel({', '.join(refs)}):")
        w.indent()
        offsets = {}
        for i, (axis, g, n) in enumerate(self.groups):
            expr = f"pl.program_id({i})" + (f" * {g}" if g != 1 else "")
            off = w.let(expr, name=f"{axis}0", aval=I32,
                        comment=f"group {axis}: this program's tile starts here"
                        + (f" ({g} {axis})" if g != 1 else " (one {axis})".format(axis=axis)))
            off.temp = False
            offsets[axis] = off
            if n % g:
                ok = w.let(f"{{0}} + jnp.arange({g}) < {n}", off, name=f"{axis}_ok",
                           comment=f"the last tile overhangs {axis}={n}")
                self.scopes[0][("ok", axis)] = ok
        ctx = EvalContext(dict(self.env), offsets, xp)
        wires = [RefWire(i) for i in range(len(self.inputs))]
        outs = self.run(self.st.body, ctx, wires)
        w.line()
        for o, val in zip(self.outputs, outs):
            if isinstance(val, RefWire):
                val = self.load_whole(val)
            if tuple(val.shape) != o["block"]:
                raise NapkinError(f"output {o['name']}: the body computes {val.shape}, the block "
                                  f"is {o['block']}")
            val = xp.astype(val, o["dtype"])
            mask = self.mask_for(o["type"].names)
            if mask is None:
                w.line(f"{o['ref']}[...] = {val}")
            else:
                w.line(f"plt.store({o['ref']}, {val}, mask={mask})")
        w.dedent()
        return w.lines

    def assemble(self, kernel_lines) -> KernelPlan:
        k = self.k
        grid_args = ", ".join(f"i{i}" for i in range(len(self.grid)))

        def spec_line(block, index, comment):
            idx = ", ".join(f"i{j}" if j is not None else "0" for j in index)
            idx = f"({idx},)" if len(index) == 1 else f"({idx})"
            return f"pl.BlockSpec({tuple(block)}, lambda {grid_args}: {idx}),  # {comment}"

        def describe(name, t, shape, block):
            parts = []
            for a, n, b in zip(t.names, shape, block):
                if a in self.gaxes:
                    parts.append(f"{a}: tile of {b}")
                elif b != n:
                    parts.append(f"{a}: whole, padded to {b}, streamed")
                else:
                    parts.append(f"{a}: whole")
            return f"{name}[{','.join(t.names)}] " + "; ".join(parts)

        head = [
            f'"""Pallas kernel (Triton backend) for {k.name}, written by napkin.lower.',
            "",
            f"program: {k.describe()}",
            "inputs:  " + ", ".join(f"{ip.name}{list(ip.shape)} {np.dtype(ip.dtype).name}"
                                   for ip in self.inputs),
            "outputs: " + ", ".join(f"{o['name']}{list(o['shape'])} {o['dtype'].name}"
                                   for o in self.outputs),
            f"grid:    {self.grid}" + ("  (" + ", ".join(f"{a}: {-(-n // g)} tiles of {g}"
                                                        for a, g, n in self.groups) + ")"
                                       if self.groups else ""),
            "",
            "Run it with forward(*inputs, interpret=True) on a CPU, interpret=False on a GPU.",
            '"""',
            "import jax",
            "import jax.numpy as jnp",
            "from jax import lax",
            "from jax.experimental import pallas as pl",
            "from jax.experimental.pallas import triton as plt",
            "",
            f"GRID = {self.grid}",
            "",
            "",
        ]
        args = ", ".join(ip.name for ip in self.inputs)
        fwd = [
            "",
            "",
            f"def forward({args}, *, interpret=False):",
            f'    """{", ".join(o["name"] for o in self.outputs)} = forward({args})"""',
            "    return pl.pallas_call(",
            "        kernel,",
            "        grid=GRID,",
            "        in_specs=[",
        ]
        for ip in self.inputs:
            fwd.append("            " + spec_line(ip.block, ip.index,
                                                  describe(ip.name, ip.type, ip.shape, ip.block)))
        fwd.append("        ],")
        fwd.append("        out_specs=[")
        for o in self.outputs:
            fwd.append("            " + spec_line(o["block"], o["index"],
                                                  describe(o["name"], o["type"], o["shape"],
                                                           o["block"])))
        fwd.append("        ],")
        fwd.append("        out_shape=[")
        for o in self.outputs:
            fwd.append(f"            jax.ShapeDtypeStruct({o['shape']}, {dtype_name(o['dtype'])}),")
        fwd.append("        ],")
        fwd.append(f"        compiler_params=plt.CompilerParams(num_warps={k.num_warps}, "
                   f"num_stages={k.num_stages}),")
        fwd.append("        interpret=interpret,")
        fwd.append(f"        name={identifier('napkin_' + k.name, 'napkin_kernel')!r},")
        fwd.append(f"    )({args})")
        source = "\n".join(head + kernel_lines + fwd) + "\n"
        filename = f"<napkin-kernel-{next(_counter)}-{k.name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"__name__": f"napkin_kernel_{identifier(k.name)}"}
        exec(compile(source, filename, "exec"), namespace)
        block_shapes = {ip.name: ip.block for ip in self.inputs}
        block_shapes.update({o["name"]: o["block"] for o in self.outputs})
        forward = namespace["forward"]
        # one jit per interpret mode, so eager calls reuse the compiled kernel;
        # interpret mode compiles with XLA's cheap settings (it is for testing)
        calls = {False: jax.jit(forward, static_argnames=("interpret",)),
                 True: jax.jit(forward, static_argnames=("interpret",),
                               compiler_options=INTERPRET_COMPILER_OPTIONS)}
        return KernelPlan(source, self.grid, block_shapes, [ip.shape for ip in self.inputs],
                          [o["shape"] for o in self.outputs], [ip.name for ip in self.inputs],
                          [o["name"] for o in self.outputs], forward, self.notes, calls)


# ------------------------------------------------------------------ the user-facing object
class pow2ceil(sympy.Function):
    """The least power of two >= n (block size of a streamed axis)."""

    @classmethod
    def eval(cls, n):
        if n.is_Integer:
            return sympy.Integer(pow2_at_least(int(n)))


class LoweredKernel:
    """A streamed program lowered to a Pallas (Triton backend) kernel.

    Call it on arrays like the program's meaning (``evaluate``); it works under
    ``jax.jit`` and ``jax.vmap``.  The kernel is specialised (and its source
    written) once per set of input shapes and dtypes.

    * ``grid`` / ``block_shapes``: symbolic (sympy, in the program's sizes);
      ``plan(*shapes)`` gives the concrete ones with the source;
    * ``source(*shapes)``: the readable Pallas module that runs (shapes default
      to those of the last call).
    """

    def __init__(self, program, tiles: dict, *, interpret="auto", dtype=None,
                 num_warps: int = LAUNCH["num_warps"], num_stages: int = LAUNCH["num_stages"],
                 f32_precision: str = "highest", name: str | None = None):
        self.program = program
        self.tiles = {_symbol(k): v for k, v in (tiles or {}).items()}
        for key, v in self.tiles.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise NapkinError(f"tile {key}={v!r} must be a positive integer")
        self.interpret = interpret
        self.dtype = None if dtype is None else np.dtype(JNP_DTYPES[canonical_dtype(
            dtype if isinstance(dtype, str) else np.dtype(dtype).name)])
        self.num_warps, self.num_stages = num_warps, num_stages
        if f32_precision not in ("highest", "default"):
            raise NapkinError("f32_precision is 'highest' (exact, as the semantics) or 'default' "
                              "(TF32 on GPUs)")
        self.f32_precision = f32_precision
        self.name = name or getattr(program, "name", None) or "program"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            self.name = "program"
        self.structure = peel(program)
        self.in_types = array_types(program.dom)
        self.out_types = array_types(program.cod)
        self.in_names = [ob.name for ob in program.dom.inside]
        for spec in self.structure.groups:
            self.size_of(spec.size, f"group {spec.axis}")
        self._streams = []
        for box in self.structure.body.boxes:
            spec = getattr(box, "data", None)
            if getattr(spec, "kind", None) == "stream":
                self.size_of(spec.chunk, f"stream {spec.axis}")
                self._streams.append(spec)
            elif getattr(spec, "kind", None) == "group":
                raise NapkinError(f"{box.name}: a group below the grid (inside the kernel body) "
                                  f"is not supported by the Triton lowering")
        self._plans: dict = {}
        self._last = None

    # ------------------------------------------------------------ sizes
    def size_of(self, size, what: str) -> int:
        if isinstance(size, (int, np.integer)) or getattr(size, "is_Integer", False):
            value = int(size)
            name = f"{what} size"
        else:
            sym = _symbol(str(size)) if not isinstance(size, sympy.Symbol) else size
            if sym not in self.tiles:
                raise NapkinError(f"{what}: no tile size for {sym} (pass tiles={{'{sym}': 64}})")
            value, name = int(self.tiles[sym]), f"tile {sym}"
        if not is_pow2(value):
            raise NapkinError(f"{name}={value} must be a power of two for the Triton backend")
        return value

    def chunk_of(self, axis) -> int:
        for spec in self._streams:
            if spec.axis == axis:
                return self.size_of(spec.chunk, f"stream {axis}")
        raise NapkinError(f"internal: no stream over {axis}")

    def describe(self) -> str:
        parts = [f"group {s.axis} ({s.size}={self.size_of(s.size, '')})"
                 for s in self.structure.groups]
        parts += [f"stream {s.axis} ({s.chunk}={self.size_of(s.chunk, '')}, {s.rule})"
                  for s in self._streams]
        return " > ".join(parts) or "one program"

    @property
    def grid(self) -> tuple:
        if not self.structure.groups:
            return (sympy.Integer(1),)
        out = []
        for spec in self.structure.groups:
            full = next(t.axis(spec.axis).size for t in self.in_types if t.has(spec.axis))
            out.append(sympy.ceiling(sympy.sympify(full) / self.size_of(spec.size, "")))
        return tuple(out)

    @property
    def block_shapes(self) -> dict:
        """{array name: block shape}, symbolic in the whole axes' sizes."""
        gs = {s.axis: self.size_of(s.size, "") for s in self.structure.groups}
        streams = {s.axis: self.size_of(s.chunk, "") for s in self._streams}
        out = {}
        body = self.structure.body
        for ob, p in zip(body.dom.inside, self.structure.in_map):
            t = self.in_types[p]
            out[ob.name] = tuple(gs[a.name] if a.name in gs else
                                 sympy.Max(pow2ceil(a.size), streams[a.name]) if a.name in streams
                                 else a.size for a in t.axes)
        for ob in body.cod.inside:
            out[ob.name] = tuple(gs.get(a.name, a.size) for a in ob.type.axes)
        return out

    # ------------------------------------------------------------ specialisation
    def _dtypes(self):
        """The kernel's input dtypes: the override, or the program's types."""
        if self.dtype is not None:
            return [self.dtype] * len(self.in_types)
        return [np.dtype(JNP_DTYPES[t.dtype]) for t in self.in_types]

    def plan(self, *shapes) -> KernelPlan:
        """The kernel for inputs of these shapes (tuples, arrays or ShapeDtypeStructs)."""
        if len(shapes) != len(self.in_types):
            raise ShapeError(f"{self.name} takes {len(self.in_types)} inputs "
                             f"({', '.join(self.in_names)}), got {len(shapes)}")
        shapes = [tuple(int(n) for n in (s.shape if hasattr(s, "shape") else s)) for s in shapes]
        dts = self._dtypes()
        key = (tuple(shapes), tuple(str(d) for d in dts))
        if key not in self._plans:
            self._plans[key] = _Writer(self, shapes, dts).write()
        self._last = key
        return self._plans[key]

    def source(self, *shapes) -> str:
        if shapes:
            return self.plan(*shapes).source
        if self._last is None:
            raise NapkinError("source(): give the input shapes (the kernel is written per shape)")
        return self._plans[self._last].source

    def resolve_interpret(self, interpret=None) -> bool:
        mode = self.interpret if interpret is None else interpret
        if mode == "auto":
            return jax.devices()[0].platform != "gpu"
        return bool(mode)

    def __call__(self, *arrays, interpret=None):
        if len(arrays) != len(self.in_types):
            raise ShapeError(f"{self.name} takes {len(self.in_types)} inputs "
                             f"({', '.join(self.in_names)}), got {len(arrays)}")
        plan = self.plan(*[jnp.shape(a) for a in arrays])
        dts = self._dtypes()
        arrays = [jnp.asarray(a, dtype=dt) if jnp.result_type(a) != dt else a
                  for a, dt in zip(arrays, dts)]
        operands = [arrays[p] for p in self.structure.in_map]
        outs = plan.call(*operands, interpret=self.resolve_interpret(interpret))
        result = [outs[m] for m in self.structure.out_map]
        return result[0] if len(result) == 1 else tuple(result)

    def __repr__(self):
        return f"LoweredKernel({self.name}: {self.describe()})"


def lower(program, tiles: dict, *, interpret="auto", dtype=None, **options) -> LoweredKernel:
    """Lower a streamed program to a Pallas Triton-backend kernel.

    ``tiles``: the size of every group / chunk symbol (``{"g_q": 64, "s_x": 64}``),
    powers of two.  ``interpret``: "auto" (interpret unless the default device
    is a GPU), True or False.  ``dtype``: the dtype of the kernel's inputs and
    outputs ("bf16", …); None keeps the program's declared dtypes (arrays of
    another dtype are cast outside the kernel).  Options: ``num_warps``,
    ``num_stages``, ``f32_precision`` ("highest" — exact float32 dots as in the
    semantics — or "default", TF32 on GPUs), ``name``.
    """
    return LoweredKernel(program, tiles, interpret=interpret, dtype=dtype, **options)


# ------------------------------------------------------------------ CUDA export on any machine
def _abstract_structs(kernel: LoweredKernel, shapes):
    dts = kernel._dtypes()
    out = []
    for s, dt in zip(shapes, dts):
        if isinstance(s, jax.ShapeDtypeStruct):
            out.append(jax.ShapeDtypeStruct(s.shape, dt))
        else:
            out.append(jax.ShapeDtypeStruct(tuple(jnp.shape(s)) if hasattr(s, "shape")
                                            else tuple(s), dt))
    return out


def export_cuda(kernel: LoweredKernel, shapes, device_kind: str = "NVIDIA H100") -> str:
    """Lower the kernel for CUDA on any machine (no GPU needed) and return the
    MLIR text, which holds the ``__gpu$xla.gpu.triton`` custom call (grid,
    num_warps, num_stages and the Triton IR).  Catches Triton-only errors that
    interpret mode hides."""
    structs = _abstract_structs(kernel, shapes)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=132, platform="gpu"))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
              jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]

    def f(*xs):
        return kernel(*xs, interpret=False)
    with jax.sharding.use_abstract_mesh(mesh):
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*structs)
    text = exp.mlir_module()
    if "__gpu$xla.gpu.triton" not in text:
        raise NapkinError("the CUDA export holds no Triton kernel")
    return text

