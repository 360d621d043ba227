"""Streamed programs are diagrams too: group and stream partitions as boxes.

A :class:`Group` box holds a sub-diagram (its *body*) typed with one woven axis
relabelled to the group size (``q`` → ``g_q``); it means: cut the inputs that
carry the axis into groups, run the body on each group (at a lower memory
level), concatenate the outputs.  Inputs without the axis are broadcast to
every group.

A :class:`Stream` box holds an accumulator — three small diagrams over a state
type — ``init: () → state``, ``update: state ⊗ inputs[chunk] → state``,
``finalize: state ⊗ fixed inputs → outputs`` (fixed = without the axis); it means: fold ``update`` over chunks of the
streamed axis, then ``finalize``.  Inputs without the axis are passed whole to
every update.

Both are ordinary :class:`~napkin.core.primitives.Spec` s, so the semantics,
cost and drawing functors — and the lowering — see them like any other box.
Ragged last groups/chunks are handled by binding the size symbol to the
actual length of each piece.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy

from napkin.core.arrays import ArrayType, Axis, array_types
from napkin.core.diagram import is_diagram
from napkin.core.errors import NapkinError
from napkin.core.memo import IdentityMemo
from napkin.core.primitives import EvalContext, Spec


def _runtime_size(axis: str, ins, xs) -> int:
    for t, x in zip(ins, xs):
        if t.has(axis):
            return int(x.shape[t.names.index(axis)])
    raise NapkinError(f"no input carries axis {axis}")


def _piece_size(ctx: EvalContext, size) -> int:
    try:
        value = ctx.number(size)
    except NapkinError:
        raise NapkinError(f"tile size {size} has no value: choose tiles "
                          f"(e.g. sizes={{'{size}': 64}}) before evaluating") from None
    if value != int(value) or value < 1:
        raise NapkinError(f"tile size {size} = {value:g} is not a positive integer")
    return int(value)


def _relabel(types, axis: str, size) -> tuple[ArrayType, ...]:
    return tuple(t.resize(axis, size) if t.has(axis) else t for t in types)


def _check_same(what: str, got, want):
    if tuple(got) != tuple(want):
        g = ", ".join(f"{t}{'{'}{','.join(str(a.size) for a in t.axes)}{'}'}" for t in got)
        w = ", ".join(f"{t}{'{'}{','.join(str(a.size) for a in t.axes)}{'}'}" for t in want)
        raise NapkinError(f"{what}: inputs are {g} but the body expects {w}")


def _pieces(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


_AT_LENGTH = IdentityMemo(2000)


def at_length(diagram, axis: str, size, length: int, ctx: EvalContext):
    """(diagram, context) for one piece of ``length`` entries of an axis the diagram
    sees at the tile ``size``: a symbolic tile is bound to the length; an integer
    tile that the piece does not fill is relabelled to the length, so that every
    box inside (a fill, a nested accumulator) sees the piece's real extent."""
    if isinstance(size, sympy.Symbol):
        return diagram, ctx.bound(size, length)
    if int(size) == length:
        return diagram, ctx
    from napkin.core.region import relabel
    return _AT_LENGTH.get((diagram,), lambda: relabel(diagram, axis, length), (axis, length)), ctx


def _slice(x, axis: int, start, length: int):
    """``length`` entries of ``x`` along ``axis`` from a (possibly traced) start."""
    import jax
    return jax.lax.dynamic_slice_in_dim(x, start, length, axis=axis)


def _stable_carry(step, state):
    """The state, promoted until one ``step`` keeps every dtype (a loop's carry must
    not change type: an f32 accumulator meeting f64 chunks becomes f64 once)."""
    import jax
    import jax.numpy as jnp
    state = tuple(jnp.asarray(s) for s in state)
    for _ in range(4):
        out = jax.eval_shape(step, state)
        if all(o.dtype == s.dtype and o.shape == s.shape for o, s in zip(out, state)):
            return state
        for o, s in zip(out, state):
            if o.shape != s.shape:
                raise NapkinError(f"an accumulator update changes its state's shape "
                                  f"{s.shape} -> {o.shape}")
        state = tuple(s.astype(jnp.promote_types(s.dtype, o.dtype)) for o, s in zip(out, state))
    return state


@dataclass(frozen=True)
class Group(Spec):
    """Group partition of ``axis`` with group size ``size`` at memory ``level``.

    ``stack``: None, or the name of a new axis along which each group's outputs are
    stacked, one entry per group, where a plain group concatenates them along ``axis``:
    its body's outputs lack the grouped axis (a stream's partial states, one per part of
    the axis, that a merge then folds: split-K)."""
    axis: str
    size: Any
    body: Any           # a napkin Diagram, typed at the group size
    level: str = "smem"
    stack: str | None = None
    kind: ClassVar[str] = "group"
    n_in: ClassVar[None] = None

    @property
    def bodies(self) -> tuple:
        """The diagrams this box holds."""
        return (self.body,)

    def infer(self, ins):
        _check_same(f"group {self.axis}", _relabel(ins, self.axis, self.size),
                    array_types(self.body.dom))
        full = next(t.axis(self.axis) for t in ins if t.has(self.axis))
        outs = array_types(self.body.cod)
        if self.stack is not None:
            parts = self.parts(full.size)
            for t in outs:
                if t.has(self.axis) or t.has(self.stack):
                    raise NapkinError(f"group {self.axis} stacked along {self.stack}: output "
                                      f"{t} has {self.axis if t.has(self.axis) else self.stack} "
                                      f"(each group's outputs gain the stacked axis)")
            return tuple(t.with_axis(Axis(self.stack, parts)) for t in outs)
        for t in outs:
            if not t.has(self.axis):
                raise NapkinError(f"group {self.axis}: output {t} lacks the grouped axis "
                                  f"(a group partition needs every output woven over it)")
        return tuple(t.resize(self.axis, full.size) for t in outs)

    def parts(self, full):
        """How many groups an axis of ``full`` entries makes (the stacked axis's size)."""
        return sympy.ceiling(sympy.sympify(full) / sympy.sympify(self.size))

    def evaluate(self, ctx, ins, outs, *xs):
        from napkin.core.semantics import run
        xp, n = ctx.xp, _runtime_size(self.axis, ins, xs)
        g = _piece_size(ctx, self.size)

        def piece(start, length, args):
            body, sub = at_length(self.body, self.axis, self.size, length, ctx)
            return run(body, sub.shifted(self.axis, start), *args)

        def cut(start, stop):
            return [xp.take(x, t.names.index(self.axis), start, stop) if t.has(self.axis) else x
                    for t, x in zip(ins, xs)]
        if xp.symbolic:  # exact entries: one piece at a time
            results = [piece(a, b - a, cut(a, b)) for a, b in _pieces(n, g)]
        else:
            n_full, tail = divmod(n, g)
            results = [self._mapped(ctx, ins, outs, xs, n_full, g, piece)] if n_full else []
            if tail:
                results.append(piece(n_full * g, tail, cut(n_full * g, n)))
        if self.stack is not None:  # one entry per group along the new, leading axis
            mapped = n_full and not xp.symbolic
            return tuple(xp.concatenate([r[i] if mapped and k == 0 else xp.stack([r[i]])
                                         for k, r in enumerate(results)], axis=0)
                         for i in range(len(outs)))
        if len(results) == 1:
            return tuple(results[0])
        return tuple(xp.concatenate([r[i] for r in results], axis=t.names.index(self.axis))
                     for i, t in enumerate(outs))

    def _mapped(self, ctx, ins, outs, xs, n_full, g, piece):
        """The ``n_full`` whole groups as one vmap over the group index (traced once,
        whatever the number of groups), concatenated along the axis."""
        import jax
        import jax.numpy as jnp
        batched = [t.has(self.axis) for t in ins]
        split = []
        for t, x, b in zip(ins, xs, batched):
            if b:
                i = t.names.index(self.axis)
                x = jax.lax.slice_in_dim(x, 0, n_full * g, axis=i)
                x = jnp.moveaxis(jnp.reshape(x, x.shape[:i] + (n_full, g) + x.shape[i + 1:]), i, 0)
            split.append(x)

        def one(k, *args):
            return tuple(piece(k * g, g, args))
        ys = jax.vmap(one, in_axes=(0, *[0 if b else None for b in batched]))(
            jnp.arange(n_full), *split)
        if self.stack is not None:
            return list(ys)
        merged = []
        for y, t in zip(ys, outs):
            i = t.names.index(self.axis)
            y = jnp.moveaxis(y, 0, i)
            merged.append(jnp.reshape(y, y.shape[:i] + (n_full * g,) + y.shape[i + 2:]))
        return merged

    def flops(self, ins, outs):
        from napkin.core.flops import flops
        full = next(t.axis(self.axis) for t in ins if t.has(self.axis)).size
        return flops(self.body) * (self.parts(full) if self.stack else full / self.size)

    def woven(self, axis):
        raise NapkinError(f"weave a diagram before partitioning it (cannot weave {axis} "
                          f"into an existing group over {self.axis})")

    def relabelled(self, axis, size):
        from napkin.core.region import relabel
        if axis == self.axis:
            return self  # the body already sees the group size
        return dataclasses.replace(self, body=relabel(self.body, axis, size))

    def unwoven(self, axis):
        from napkin.frontend.weave import unweave
        return dataclasses.replace(self, body=unweave(self.body, axis))

    def label(self):
        stacked = f", stacked along {self.stack}" if self.stack else ""
        return f"group {self.axis} ({self.size}{stacked}) @ {self.level}"


@dataclass(frozen=True)
class Stream(Spec):
    """Stream partition of ``axis`` in chunks of ``chunk`` with an accumulator."""
    axis: str
    chunk: Any
    init: Any           # Diagram: () -> state
    update: Any         # Diagram: state @ inputs (axis at chunk size) -> state
    finalize: Any       # Diagram: state @ inputs lacking the axis -> outputs
    rule: str = "stream"
    merge: Any = None   # Diagram: state @ state -> state (x's, then y's: the state of x ⊕ y),
                        # or None where an accumulator has no merge
    kind: ClassVar[str] = "stream"
    n_in: ClassVar[None] = None

    @property
    def bodies(self) -> tuple:
        """The diagrams this box holds."""
        return (self.init, self.update, self.finalize) + \
            (() if self.merge is None else (self.merge,))

    @property
    def n_state(self) -> int:
        return len(self.init.cod)

    @property
    def finalize_only(self) -> frozenset:
        """Positions (among the box's inputs) of the inputs that only the finalize reads
        — a residual added to a GEMM's result —: a kernel loads them after the loop, so
        they take no registers while it runs."""
        from napkin.core.ir import view
        g = view(self.update)
        ins = g.graph["inputs"][self.n_state:]
        outs = set(g.graph["outputs"])
        types = array_types(self.update.dom)[self.n_state:]
        return frozenset(j for j, (v, t) in enumerate(zip(ins, types))
                         if not t.has(self.axis) and v not in outs
                         and not list(g.successors(v)))

    def infer(self, ins):
        state = array_types(self.init.cod)
        want = array_types(self.update.dom)
        fixed = [t for t in ins if not t.has(self.axis)]
        if tuple(want[:len(state)]) != tuple(state) or array_types(self.update.cod) != state \
                or array_types(self.finalize.dom) != state + fixed:
            raise NapkinError(f"stream {self.axis}: init, update and finalize disagree on the state")
        _check_same(f"stream {self.axis}", _relabel(ins, self.axis, self.chunk),
                    want[len(state):])
        if not any(t.has(self.axis) for t in ins):
            raise NapkinError(f"stream {self.axis}: no input carries the streamed axis")
        return tuple(array_types(self.finalize.cod))

    def evaluate(self, ctx, ins, outs, *xs):
        from napkin.core.semantics import run
        xp, n = ctx.xp, _runtime_size(self.axis, ins, xs)
        c = _piece_size(ctx, self.chunk)
        at = [t.names.index(self.axis) if t.has(self.axis) else None for t in ins]

        def step(start, length, state):
            update, sub = at_length(self.update, self.axis, self.chunk, length, ctx)
            if xp.symbolic:
                args = [x if i is None else xp.take(x, i, start, start + length)
                        for i, x in zip(at, xs)]
            else:
                args = [x if i is None else _slice(x, i, start, length) for i, x in zip(at, xs)]
            return tuple(run(update, sub.shifted(self.axis, start), *state, *args))
        state = tuple(run(self.init, ctx))
        n_full, tail = divmod(n, c)
        if xp.symbolic:  # exact entries: one chunk at a time
            for start, stop in _pieces(n, c):
                state = step(start, stop - start, state)
        else:
            if n_full:  # the first chunk outside the loop: it settles the state's dtypes
                state = step(0, c, state)
            if n_full > 1:  # the rest as one loop: traced once, whatever the chunk count
                import jax
                import jax.numpy as jnp
                state = _stable_carry(lambda s: step(0, c, s), state)
                state = jax.lax.fori_loop(
                    1, n_full, lambda k, s: tuple(jnp.asarray(o, v.dtype) for o, v in
                                                  zip(step(k * c, c, s), s)), state)
            if tail:
                state = step(n_full * c, tail, state)
        fixed = [x for t, x in zip(ins, xs) if not t.has(self.axis)]
        return run(self.finalize, ctx, *state, *fixed)

    def flops(self, ins, outs):
        from napkin.core.flops import flops
        full = next(t.axis(self.axis) for t in ins if t.has(self.axis)).size
        return flops(self.update) * full / self.chunk + flops(self.finalize)

    def woven(self, axis):
        raise NapkinError(f"weave a diagram before partitioning it (cannot weave {axis} "
                          f"into an existing stream over {self.axis})")

    def relabelled(self, axis, size):
        from napkin.core.region import relabel
        if axis == self.axis:
            return self
        return Stream(self.axis, self.chunk, relabel(self.init, axis, size),
                      relabel(self.update, axis, size), relabel(self.finalize, axis, size),
                      self.rule, None if self.merge is None else relabel(self.merge, axis, size))

    def unwoven(self, axis):
        from napkin.frontend.weave import unweave
        return Stream(self.axis, self.chunk, unweave(self.init, axis),
                      unweave(self.update, axis), unweave(self.finalize, axis), self.rule,
                      None if self.merge is None else unweave(self.merge, axis))

    def label(self):
        return f"stream {self.axis} ({self.chunk}) [{self.rule}]"


# ----------------------------------------------------------------------------- names
@dataclass(frozen=True)
class TileUse:
    name: str
    kind: str      # "group" | "stream"
    axis: str


@dataclass
class Names:
    """Every name a program gives meaning to."""
    axes: set          # axis names, at any depth
    sizes: set         # size symbols that are not tiles (axis sizes, parameters' symbols)
    tiles: dict        # tile name -> set of TileUse


_NAMES = IdentityMemo(5000)


def names(program) -> Names:
    """The axes, size symbols and tiles of a program, at every depth (memoised)."""
    return _NAMES.get((program,), lambda: _names(program))


def _names(program) -> Names:
    axes, symbols, tiles = set(), set(), {}

    def note_type(t: ArrayType):
        for a in t.axes:
            name, free = _axis_names(a)
            axes.add(name)
            symbols.update(free)

    def note_value(v):
        if isinstance(v, sympy.Basic):
            symbols.update(_free_names(v))
        elif isinstance(v, ArrayType):
            note_type(v)
        elif isinstance(v, (tuple, list)):
            for w in v:
                note_value(w)
        elif is_diagram(v):
            inner = names(v)  # memoised: a body shared by many programs is walked once
            axes.update(inner.axes)
            symbols.update(inner.sizes)
            for name, uses in inner.tiles.items():
                tiles.setdefault(name, set()).update(uses)

    for ob in (*program.dom.inside, *program.cod.inside):
        note_type(ob.type)
    for box in program.boxes:
        for ob in (*box.dom.inside, *box.cod.inside):
            if hasattr(ob, "type"):
                note_type(ob.type)
        spec = getattr(box, "spec", None)
        if spec is None or not dataclasses.is_dataclass(spec):
            continue
        tile = tile_of(spec)
        if tile is not None:
            tiles.setdefault(tile.name, set()).add(tile)
        for f in dataclasses.fields(spec):
            note_value(getattr(spec, f.name))
    return Names(axes, symbols - set(tiles), tiles)


@functools.lru_cache(maxsize=None)
def _free_names(expr) -> frozenset:
    return frozenset(str(s) for s in expr.free_symbols)


@functools.lru_cache(maxsize=None)
def _axis_names(axis) -> tuple:
    size = axis.size
    return axis.name, (_free_names(size) if isinstance(size, sympy.Basic) else frozenset())


def tile_of(spec) -> TileUse | None:
    kind = getattr(spec, "kind", None)
    size = spec.size if kind == "group" else spec.chunk if kind == "stream" else None
    if isinstance(size, sympy.Symbol):
        return TileUse(size.name, kind, spec.axis)
    return None


def tiles_within(boxes) -> set[TileUse]:
    """The tiles of every partition in ``boxes`` or nested inside them."""
    found = set()
    for box in boxes:
        spec = getattr(box, "spec", None)
        if spec is None:
            continue
        tile = tile_of(spec)
        if tile is not None:
            found.add(tile)
        for body in getattr(spec, "bodies", ()):
            found |= tiles_within(body.boxes)
    return found


def tile_symbol(kind: str, axis: str) -> sympy.Symbol:
    """The conventional tile-size symbol: g_q for groups, s_x for streams."""
    return sympy.Symbol(f"{kind}_{axis}", integer=True, positive=True)
