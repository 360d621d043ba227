"""Where an imported function's arguments and results meet its diagram's inputs and outputs.

Two things can stand between them.  An argument read twice (self-attention from one x) is
passed as two inputs (``sources``: per input, the argument it is).  A dimension fn merges
or splits (``jnp.repeat`` of K over heads, a head split (s, h·d) -> (s, h, d)) is, in the
diagram, the axes it is the product of, outer first: Q[h, q, d] with h = (g, h_1) is the
input Q[g, h_1, q, d], and an output over h is handed back merged.  Both are reshapes of the
caller's arrays (row-major, as fn's own reshape), done here, outside any kernel, so
``jax.grad`` and ``jax.vmap`` go through them as through any reshape.
"""
from __future__ import annotations

import math

from napkin.core.errors import ShapeError


class Boundary:
    """``argnames``: fn's arguments; ``sources``: per diagram input, the argument it is;
    ``splits``: per diagram input None (passed as it is) or, per dimension of the argument,
    the sizes of the axes it is in the diagram — () for a unit dimension (no axis), (None,)
    for one axis, (s₀, s₁, …) for a dimension that is their product (at most one None: the
    size that is the dimension's over the others'); ``merges``: per output None or, per
    dimension of fn's result, how many of the diagram output's axes it is the product of."""

    def __init__(self, argnames, sources, splits, merges, parts=None):
        self.argnames, self.sources = list(argnames), list(sources)
        self.splits, self.merges = list(splits), list(merges)
        self.parts = dict(parts or {})  # {merged axis: its parts' names}, for messages

    @property
    def trivial(self) -> bool:
        return self.sources == list(range(len(self.argnames))) and \
            not any(self.splits) and not any(self.merges)

    def inputs(self, args) -> list:
        """The diagram's inputs from fn's arguments (leading batch axes kept)."""
        return [args[i] if spec is None else self._split(args[i], spec, self.argnames[i])
                for i, spec in zip(self.sources, self.splits)]

    def outputs(self, out):
        """fn's results from the diagram's outputs (a tuple, or one array)."""
        many = isinstance(out, (tuple, list))
        ys = list(out) if many else [out]
        ys = [y if spec is None else _merge(y, spec) for y, spec in zip(ys, self.merges)]
        return tuple(ys) if many else ys[0]

    def _split(self, x, spec, name):
        import numpy as np
        shape = tuple(np.shape(x))
        lead = len(shape) - len(spec)
        if lead < 0:
            raise ShapeError(f"argument {name} takes {len(spec)} dimensions (and any leading "
                             f"batch axes), got shape {shape}")
        new = list(shape[:lead])
        for n, sizes in zip(shape[lead:], spec):
            if not sizes:
                if n != 1:
                    raise ShapeError(f"argument {name}: a dimension fn reads as size 1 has "
                                     f"size {n} (shape {shape})")
                continue
            known = math.prod(s for s in sizes if s is not None)
            if n % known or (None not in sizes and n != known):
                raise ShapeError(f"argument {name}: a dimension of size {n} (shape {shape}) "
                                 f"is, in fn, a product of axes with sizes "
                                 f"{tuple('?' if s is None else s for s in sizes)}: its size "
                                 f"must be {'a multiple of ' if None in sizes else ''}{known}")
            new.extend(n // known if s is None else s for s in sizes)
        return x.reshape(tuple(new))


def _merge(y, spec):
    shape = tuple(y.shape)
    lead = len(shape) - sum(spec)
    new, k = list(shape[:lead]), lead
    for n in spec:
        new.append(math.prod(shape[k:k + n]))
        k += n
    return y.reshape(tuple(new))


def boundary(naming, traced, argnames, sources, outs) -> Boundary | None:
    """The boundary of an import (None where fn's arguments are the diagram's inputs, as
    they are)."""
    from napkin.frontend.jaxpr.vocabulary import fail
    splits, parts = [], {}
    for v, i in zip(traced.invars, sources):
        dims = naming.dims(v)
        if not any(isinstance(d, tuple) for d in dims):
            splits.append(None)
            continue
        spec = []
        for j, d in enumerate(dims):
            if d is None:
                spec.append(())
            elif isinstance(d, str):
                spec.append((None,))
            else:
                sizes = tuple(naming.new_axes.get(a) for a in d)
                if sizes.count(None) > 1:
                    fail(f"argument {argnames[i]}'s dimension {j} is, in fn, the product of "
                         f"axes {' × '.join(d)}, more than one of them an argument's: napkin "
                         f"cannot tell their sizes apart; pass {argnames[i]} with them as "
                         f"dimensions of their own")
                spec.append(sizes)
                merged = traced.per[i][j] if i < len(traced.per) else None
                if merged:
                    parts[merged] = d
        splits.append(tuple(spec))
    merges = []
    for o in outs:
        dims = naming.dims(o) if hasattr(o, "shape") else ()
        merges.append(tuple(len(d) if isinstance(d, tuple) else 1 for d in dims if d)
                      if any(isinstance(d, tuple) for d in dims) else None)
    b = Boundary(argnames[:len(traced.per)], sources, splits, merges, parts)
    return None if b.trivial else b
