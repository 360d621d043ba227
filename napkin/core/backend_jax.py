"""The JAX backend of the one semantics (:mod:`napkin.core.backend`): JAX numbers."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from napkin.core.backend import MASKED


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


JAX = JaxBackend  # the class is the namespace (no instance: functions stay unbound)
