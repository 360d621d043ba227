"""Array backends for the one semantics: JAX numbers, or sympy expressions.

Primitives are written once against this small namespace (``ctx.xp``).  With
:data:`JAX` they compute; with :data:`SYMPY` they build exact expressions over
numpy object arrays, which is how rule proofs check an accumulator law on
symbolic entries with the very same definitions the kernels use.  :data:`JAX` lives in
:mod:`napkin.core.backend_jax`, imported when something is first evaluated: building
diagrams needs no JAX.
"""
from __future__ import annotations

import numpy as np
import sympy

# The large negative used by masks (a finite number, so a fully masked row
# stays finite; clipped to the dtype's range at evaluation).
MASK_FILL = -1e30
# A row whose largest score is below this kept no entry: it is fully masked, and
# softmax (hence attention) gives it zeros rather than the uniform average the
# fill alone would give.
MASKED = MASK_FILL / 2


def _vec(f):
    return np.vectorize(f, otypes=[object])


def _select(c, a, b):
    """``a`` where ``c`` else ``b`` on one entry: a decided condition picks, an undecided
    relation (a symbolic score against a constant, a symbolic index against a position)
    is a Piecewise."""
    if isinstance(c, (bool, np.bool_)) or c in (sympy.true, sympy.false):
        return a if bool(c) else b
    return sympy.Piecewise((a, c), (b, True))


_SELECT = _vec(_select)


def _reduce(fn):
    def r(x, axis):
        return np.apply_along_axis(lambda row: fn(list(row)), axis, x) if x.ndim > 1 \
            else np.asarray(fn(list(x)), dtype=object)
    return r


class SympyBackend:
    """numpy object arrays of sympy expressions; max is sympy.Max."""
    name = "sympy"
    symbolic = True

    exp = staticmethod(_vec(sympy.exp))
    log = staticmethod(_vec(sympy.log))
    tanh = staticmethod(_vec(sympy.tanh))
    negative = staticmethod(_vec(lambda a: -a))
    sigmoid = staticmethod(_vec(lambda a: 1 / (1 + sympy.exp(-a))))
    square = staticmethod(_vec(lambda a: a ** 2))
    sqrt = staticmethod(_vec(sympy.sqrt))
    rsqrt = staticmethod(_vec(lambda a: 1 / sympy.sqrt(a)))
    reciprocal = staticmethod(_vec(lambda a: 1 / a))
    relu = staticmethod(_vec(lambda a: sympy.Max(a, 0)))
    silu = staticmethod(_vec(lambda a: a / (1 + sympy.exp(-a))))
    abs = staticmethod(_vec(sympy.Abs))
    add = staticmethod(_vec(lambda a, b: a + b))
    subtract = staticmethod(_vec(lambda a, b: a - b))
    multiply = staticmethod(_vec(lambda a, b: a * b))
    divide = staticmethod(_vec(lambda a, b: a / b))
    maximum = staticmethod(_vec(lambda a, b: sympy.Max(a, b)))
    minimum = staticmethod(_vec(lambda a, b: sympy.Min(a, b)))
    power = staticmethod(_vec(lambda a, b: a ** b))
    erf = staticmethod(_vec(sympy.erf))
    gelu = staticmethod(_vec(lambda a: a * (1 + sympy.erf(a / sympy.sqrt(2))) / 2))
    gelu_tanh = staticmethod(_vec(lambda a: a * (1 + sympy.tanh(
        sympy.sqrt(2 / sympy.pi) * (a + sympy.Rational(44715, 10 ** 6) * a ** 3))) / 2))
    less = staticmethod(_vec(lambda a, b: sympy.Lt(a, b)))
    less_equal = staticmethod(_vec(lambda a, b: sympy.Le(a, b)))
    greater = staticmethod(_vec(lambda a, b: sympy.Gt(a, b)))
    greater_equal = staticmethod(_vec(lambda a, b: sympy.Ge(a, b)))
    equal = staticmethod(_vec(lambda a, b: sympy.Eq(a, b)))
    not_equal = staticmethod(_vec(lambda a, b: sympy.Ne(a, b)))
    sum = staticmethod(_reduce(lambda xs: sympy.Add(*xs)))
    max = staticmethod(_reduce(lambda xs: sympy.Max(*xs)))
    mean = staticmethod(_reduce(lambda xs: sympy.Add(*xs) / len(xs)))
    transpose, reshape, arange = staticmethod(np.transpose), staticmethod(np.reshape), staticmethod(np.arange)
    concatenate, stack = staticmethod(np.concatenate), staticmethod(np.stack)

    @staticmethod
    def where(keep, x, fill):
        keep = np.asarray(keep)
        if keep.dtype == bool:  # decided conditions (mask indices): pick
            return np.where(keep, x, fill)
        return _SELECT(keep, x, fill)  # relations: Piecewise where undecided

    @staticmethod
    def finite_or_zero(x):
        # Symbolic entries are finite: the identity.  ±∞ is checked numerically.
        return x

    @staticmethod
    def guard(x, m):
        # Symbolic entries are finite scores: no row is fully masked, the guard is
        # the identity.  Fully masked rows are checked numerically.
        return np.broadcast_arrays(np.asarray(x, dtype=object), np.asarray(m, dtype=object))[0]

    @staticmethod
    def einsum(spec, *xs):
        out = np.einsum(spec, *[np.asarray(x, dtype=object) for x in xs], optimize=False)
        return np.asarray(out, dtype=object)

    @classmethod
    def logsumexp(cls, x, axis):
        return _reduce(lambda xs: sympy.log(sympy.Add(*[sympy.exp(a) for a in xs])))(x, axis)

    @classmethod
    def softmax(cls, x, axis):
        e = cls.exp(x)
        z = np.expand_dims(cls.sum(e, axis), axis)
        return cls.divide(e, z)

    @staticmethod
    def const(value, like):
        return sympy.sympify(value)

    @staticmethod
    def full(shape, value, dtype):
        return np.full(shape, sympy.sympify(value), dtype=object)

    @staticmethod
    def astype(x, dtype):
        # numbers (positions: integer arrays) become exact sympy numbers; expressions stay
        if isinstance(x, np.ndarray) and x.dtype != object:
            return np.vectorize(sympy.sympify, otypes=[object])(x) if x.size else \
                x.astype(object)
        return x

    @staticmethod
    def mask_fill(fill, like):
        return sympy.sympify(fill)

    @staticmethod
    def take(x, axis, start, stop):
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(start, stop)
        return x[tuple(idx)]


SYMPY = SympyBackend  # the classes are the namespaces (no instance: functions stay unbound)
