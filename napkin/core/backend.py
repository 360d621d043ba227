"""Array backends for the one semantics: JAX numbers, or sympy expressions.

Primitives are written once against this small namespace (``ctx.xp``).  With
:data:`JAX` they compute; with :data:`SYMPY` they build exact expressions over
numpy object arrays, which is how rule proofs check an accumulator law on
symbolic entries with the very same definitions the kernels use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import sympy

# The large negative used by masks (a finite number, so a fully masked row
# stays finite; clipped to the dtype's range at evaluation).
MASK_FILL = -1e30
# A row whose largest score is below this kept no entry: it is fully masked, and
# softmax (hence attention) gives it zeros rather than the uniform average the
# fill alone would give.
MASKED = MASK_FILL / 2


_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _promoting(f):
    """``f`` on operands where 8-bit floats meet wider ones: JAX refuses to promote
    them implicitly, napkin's types do (napkin.core.primitives.promote), so the 8-bit
    operands go up to float32 first."""
    def g(*xs):
        dts = {jnp.result_type(x) for x in xs if hasattr(x, "dtype")}
        if len(dts) > 1 and dts & set(_FP8):
            xs = [x.astype(jnp.float32) if hasattr(x, "dtype") and x.dtype in _FP8 else x
                  for x in xs]
        return f(*xs)
    return g


class JaxBackend:
    name = "jax"
    symbolic = False

    exp, log, tanh, negative = jnp.exp, jnp.log, jnp.tanh, jnp.negative
    sigmoid, square, sqrt, rsqrt = jax.nn.sigmoid, jnp.square, jnp.sqrt, jax.lax.rsqrt
    reciprocal, relu, silu, abs = jnp.reciprocal, jax.nn.relu, jax.nn.silu, jnp.abs
    add, subtract = staticmethod(_promoting(jnp.add)), staticmethod(_promoting(jnp.subtract))
    multiply, divide = staticmethod(_promoting(jnp.multiply)), staticmethod(_promoting(jnp.divide))
    maximum, minimum = staticmethod(_promoting(jnp.maximum)), staticmethod(_promoting(jnp.minimum))
    power = staticmethod(_promoting(jnp.power))
    sum, mean = jnp.sum, jnp.mean

    @staticmethod
    def max(x, axis=None):
        """The maximum; NaN where a NaN is among the entries, at every size (XLA's CPU
        reduction drops NaN once it vectorises, from about 64 entries: the meaning would
        then depend on the size)."""
        m = jnp.max(x, axis)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            m = jnp.where(jnp.any(jnp.isnan(x), axis), jnp.asarray(jnp.nan, m.dtype), m)
        return m
    transpose, reshape, arange = jnp.transpose, jnp.reshape, jnp.arange
    where = staticmethod(_promoting(jnp.where))
    concatenate, stack = jnp.concatenate, jnp.stack
    # comparisons: boolean results
    less, less_equal = staticmethod(_promoting(jnp.less)), staticmethod(_promoting(jnp.less_equal))
    greater = staticmethod(_promoting(jnp.greater))
    greater_equal = staticmethod(_promoting(jnp.greater_equal))
    equal, not_equal = staticmethod(_promoting(jnp.equal)), staticmethod(_promoting(jnp.not_equal))

    erf = staticmethod(jax.lax.erf)

    @staticmethod
    def gelu(x):
        """x·Φ(x) = x·(1 + erf(x/√2))/2 (the exact form)."""
        return jax.nn.gelu(x, approximate=False)

    @staticmethod
    def gelu_tanh(x):
        """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (the tanh form)."""
        return jax.nn.gelu(x, approximate=True)

    @staticmethod
    @_promoting
    def einsum(spec, *xs):
        """Σ over the summed letters of the operands' product.  Where an operand lacks a
        summed letter, the product is formed before the sum (jnp.einsum would sum the other
        operand over it first: X·Σ Y, which differs from Σ X·Y under IEEE once X is ±∞
        and Σ Y is 0, and makes a stream's chunks disagree with the whole)."""
        lhs, out = spec.split("->")
        letters = lhs.split(",")
        summed = {c for ls in letters for c in ls} - set(out)
        if len(xs) < 2 or all(c in ls for c in summed for ls in letters):
            return jnp.einsum(spec, *xs, precision=jax.lax.Precision.HIGHEST)
        full = list(dict.fromkeys(out + "".join(letters)))
        prod = None
        for ls, x in zip(letters, xs):
            x = jnp.einsum(f"{ls}->{''.join(c for c in full if c in ls)}", x)
            x = jnp.reshape(x, [x.shape["".join(c for c in full if c in ls).index(c)]
                                if c in ls else 1 for c in full])
            prod = x if prod is None else prod * x
        return jnp.sum(prod, axis=tuple(i for i, c in enumerate(full) if c in summed)) \
            if summed else prod

    @staticmethod
    def logsumexp(x, axis):
        return jax.scipy.special.logsumexp(x, axis=axis)

    @staticmethod
    def softmax(x, axis):
        return jax.nn.softmax(x, axis=axis)

    @staticmethod
    def const(value, like):
        return jnp.asarray(value, dtype=jnp.result_type(like))

    @staticmethod
    def full(shape, value, dtype):
        return jnp.full(shape, value, dtype=dtype)

    @staticmethod
    def astype(x, dtype):
        return x.astype(dtype)

    @staticmethod
    def mask_fill(fill, like):
        dt = jnp.result_type(like)
        if jnp.issubdtype(dt, jnp.floating):
            fill = max(fill, float(jnp.finfo(dt).min) / 2)
        return jnp.asarray(fill, dt)

    @staticmethod
    def guard(x, m):
        """0 where the row statistic m kept no entry (m <= MASKED: the
        mask's fill, or −∞), else x; a NaN statistic keeps x, so NaN propagates."""
        return jnp.where(m <= MASKED, jnp.zeros_like(x), x)

    @staticmethod
    def finite_or_zero(x):
        return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros_like(x))

    @staticmethod
    def take(x, axis, start, stop):
        # dynamic: one compilation per piece length, not per piece start
        return jax.lax.dynamic_slice_in_dim(x, start, stop - start, axis=axis)


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


JAX = JaxBackend  # the classes are the namespaces (no instance: functions stay unbound)
SYMPY = SympyBackend
