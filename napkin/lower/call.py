"""How a kernel is called the way JAX users call one: arguments by position or by the
diagram's input names, and leading axes beyond an input's declared ones as batch axes.

A batch axis is mapped with ``jax.vmap``: Pallas batches a ``pallas_call`` by adding the
axis to its grid, so a batched call is one launch, not a loop, and ``jax.grad`` through it
maps the backward's kernels the same way.  Every batched input must carry the same leading
batch shape; an input without leading axes (a weight beside batched activations) is
broadcast to every batch entry.  Bad calls are one line: which name, which input, which
axis.
"""
from __future__ import annotations

from napkin.core.errors import ShapeError


def bind(what: str, names: list, args: tuple, kwargs: dict) -> list:
    """The arguments in input order, from positions then names (``what`` names the kernel
    in messages)."""
    if len(args) > len(names):
        raise ShapeError(f"{what} takes {len(names)} inputs ({', '.join(names)}), "
                         f"got {len(args)}")
    got = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise ShapeError(f"{what} has no input {key!r}: its inputs are {', '.join(names)}")
        if key in got:
            raise ShapeError(f"{what}: input {key} given twice (by position and by name)")
        got[key] = value
    missing = [n for n in names if n not in got]
    if missing:
        raise ShapeError(f"{what}: no value for input{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)} (inputs: {', '.join(names)})")
    return [got[n] for n in names]


def batch_axes(what: str, names: list, types: list, arrays: list) -> tuple:
    """(leading batch shape, per input: whether it carries it) — every input's extra
    leading axes, which must be the same shape wherever there are any."""
    import numpy as np
    shape, carries = None, []
    for name, t, x in zip(names, types, arrays):
        s = tuple(np.shape(x))
        extra = len(s) - len(t.axes)
        if extra < 0:
            raise ShapeError(f"{what}: {name}[{','.join(t.names)}] takes {len(t.axes)} axes "
                             f"(and any leading batch axes), got shape {s}")
        carries.append(extra > 0)
        if extra == 0:
            continue
        lead = s[:extra]
        if shape is None:
            shape, first = lead, name
        elif lead != shape:
            raise ShapeError(f"{what}: {name} has leading batch axes {lead} but {first} has "
                             f"{shape}: batched inputs must share them (an input without "
                             f"leading axes is broadcast)")
    return (shape or ()), carries


def call_batched(fn, what: str, names: list, types: list, arrays: list):
    """``fn(*arrays)`` with every leading batch axis mapped by ``jax.vmap``."""
    import jax
    shape, carries = batch_axes(what, names, types, arrays)
    for _ in shape:
        fn = jax.vmap(fn, in_axes=tuple(0 if c else None for c in carries))
    return fn(*arrays)
