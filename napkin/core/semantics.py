"""Meaning: the functor from diagrams to JAX functions.

The box mapping :func:`box_function` is the single source of truth.  It is
used twice: by :func:`functor`, a genuine DisCoPy functor into
``python.Function`` (compositional, but DisCoPy recurses once per box), and by
:func:`evaluate`, which walks the boxes iteratively so diagrams with thousands
of boxes evaluate without hitting Python's recursion limit.  The lowering to
kernels calls :func:`box_function` too, so a kernel cannot drift from the
meaning of its diagram.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import sympy
from discopy import markov, python

from napkin.core.arrays import ArrayType, array_types
from napkin.core.errors import NapkinError, ShapeError
from napkin.core.primitives import EvalContext


def box_function(box, ctx: EvalContext):
    """The JAX function of one computational box."""
    spec = getattr(box, "spec", None)
    if spec is None or not hasattr(spec, "evaluate"):
        raise NapkinError(f"box {box.name!r} has no meaning (not a napkin primitive)")
    ins, outs = tuple(array_types(box.dom)), tuple(array_types(box.cod))

    def run(*xs):
        return tuple(spec.evaluate(ctx, ins, outs, *xs))
    return run


def bind_sizes(types: list[ArrayType], arrays, env: dict | None = None, names=None) -> dict:
    """Check arrays against declared types; return the sizes of symbolic axes."""
    env = dict(env or {})
    names = names or [f"input {i}" for i in range(len(types))]
    if len(arrays) != len(types):
        raise ShapeError(f"expected {len(types)} input arrays ({', '.join(names)}), got {len(arrays)}")
    for name, t, x in zip(names, types, arrays):
        shape = tuple(jnp.shape(x))
        if len(shape) != len(t.axes):
            raise ShapeError(f"{name}: expected {len(t.axes)} axes {t} but the array has shape {shape}")
        for a, n in zip(t.axes, shape):
            size = sympy.sympify(a.size).subs(env)
            if size.is_Number:
                if int(size) != n:
                    raise ShapeError(f"{name}: axis {a.name} should have size {size}, got {n}")
            elif size.is_Symbol:
                env[size] = n
            else:  # an expression of other sizes, e.g. a derived axis: check after binding
                continue
    return env


def fold_boxes(diagram, xs, apply) -> list:
    """Walk ``diagram`` box by box (iteratively: no recursion limit), doing the
    wiring itself and calling ``apply(box, args) -> outputs`` for every other
    box.  Evaluation and the kernel writer both walk diagrams this way."""
    wires = list(xs)
    for box, offset in zip(diagram.boxes, diagram.offsets):
        n = len(box.dom)
        args = wires[offset:offset + n]
        if isinstance(box, markov.Swap):
            out = args[len(box.left):] + args[:len(box.left)]
        elif isinstance(box, markov.Copy):
            out = args * len(box.cod)
        else:
            out = list(apply(box, args))
        wires[offset:offset + n] = out
    return wires


def _run_boxes(diagram, ctx, xs):
    return tuple(fold_boxes(diagram, xs, lambda box, args: box_function(box, ctx)(*args)))


def run(diagram, ctx: EvalContext, *xs) -> tuple:
    """Evaluate with a given context (used by group/stream bubbles)."""
    return _run_boxes(diagram, ctx, xs)


def evaluate(diagram, sizes: dict | None = None, exact: bool = False):
    """The meaning of ``diagram`` as a JAX function of its input arrays.

    Symbolic axis sizes are bound from the arrays' shapes (and ``sizes``,
    ``{"q": 128}`` or ``{Symbol: 128}``); a mismatch raises ShapeError naming
    the input and the axis.  One output returns an array, several a tuple.
    ``exact``: casts between floating dtypes are the identity (the meaning over
    the reals; see :class:`~napkin.core.primitives.EvalContext`).
    """
    types = array_types(diagram.dom)
    names = [str(ob) for ob in diagram.dom.inside]
    base = {sympy.Symbol(k, integer=True, positive=True) if isinstance(k, str) else k: v
            for k, v in (sizes or {}).items()}

    def f(*xs):
        env = bind_sizes(types, xs, base, names)
        xs = [_as_declared_int(x, t, n) for x, t, n in zip(xs, types, names)]
        out = _run_boxes(diagram, EvalContext(env, exact=exact), xs)
        return out[0] if len(out) == 1 else out
    return f


_INT = {"int32": np.int32, "int8": np.int8}


def _as_declared_int(x, t, name):
    """An integer input read at its declared width (int64 from JAX with x64, or numpy, is
    read as int32, as the importer declares it): a concrete value the width cannot hold is
    refused, naming it, rather than wrapped or clamped into another index."""
    want = _INT.get(t.dtype)
    dt = getattr(x, "dtype", None)
    if want is None or dt is None or not np.issubdtype(dt, np.integer) or dt == want:
        return x
    if not isinstance(x, jax.core.Tracer):
        v = np.asarray(x)
        info = np.iinfo(want)
        if v.size and (v.min() < info.min or v.max() > info.max):
            bad = v.max() if v.max() > info.max else v.min()
            raise NapkinError(f"input {name}: {dt} value {int(bad)} does not fit {t.dtype}, "
                              f"the dtype the diagram declares (napkin reads int64 as int32: "
                              f"give values within [{info.min}, {info.max}])")
    return x.astype(want)


def functor(ctx: EvalContext | None = None) -> markov.Functor:
    """The semantics as a DisCoPy functor into python functions.

    ``functor()(diagram)(*arrays)``; for symbolic sizes used in parameters
    (e.g. a 1/sqrt(d) scale) pass a context whose env binds them.
    """
    ctx = ctx or EvalContext()

    def ar(box):
        return python.Function(lambda *xs: _untuple(box_function(box, ctx)(*xs)),
                               tuple(object for _ in box.dom.inside),
                               tuple(object for _ in box.cod.inside))
    return markov.Functor(ob=lambda ob: object, ar=ar,
                          cod=markov.Category(python.Ty, python.Function))


def _untuple(xs):
    return xs[0] if len(xs) == 1 else xs
