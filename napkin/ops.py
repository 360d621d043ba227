"""The primitive operations, as functions to call inside ``@algorithm``.

Every function records one box (see napkin.primitives for meanings) and
returns the traced output array.  Axes are named by :class:`Axis` or by name.
"""
from __future__ import annotations

from napkin.arrays import Axis
from napkin.errors import NapkinError
from napkin.primitives import Cast, Contract, Fill, Map, Mask, Reduce, Softmax, Zip
from napkin.trace import Value, current


def _name(axis) -> str:
    if isinstance(axis, Axis):
        return axis.name
    if isinstance(axis, str):
        return axis
    raise NapkinError(f"expected an axis or an axis name, got {axis!r}")


def _one(spec, args, name=None, out=None):
    return current().apply(spec, list(args), name, [out] if out else None)[0]


def contract(*xs: Value, out, name: str | None = None, as_: str | None = None) -> Value:
    """einsum: the output keeps the axes ``out`` (a list of axes, or a
    space-separated string of names); every other axis is summed."""
    names = out.split() if isinstance(out, str) else [_name(a) for a in out]
    return _one(Contract(tuple(names)), xs, name, as_)


def _unary(fn):
    def f(x: Value, name: str | None = None, as_: str | None = None) -> Value:
        return _one(Map(fn), [x], name, as_)
    f.__name__, f.__doc__ = fn, f"Elementwise {fn}."
    return f


exp, log, tanh, neg = _unary("exp"), _unary("log"), _unary("tanh"), _unary("neg")
sigmoid, square, sqrt, rsqrt = _unary("sigmoid"), _unary("square"), _unary("sqrt"), _unary("rsqrt")
recip, relu, silu, abs_ = _unary("recip"), _unary("relu"), _unary("silu"), _unary("abs")
finite_or_zero = _unary("finite_or_zero")


def scale(x: Value, c, name=None, as_=None) -> Value:
    """x·c for a constant c (a number, or a sympy expression in axis sizes)."""
    return _one(Map("scale", c), [x], name, as_)


def add_const(x: Value, c, name=None, as_=None) -> Value:
    return _one(Map("add_const", c), [x], name, as_)


def power(x: Value, c, name=None, as_=None) -> Value:
    return _one(Map("pow", c), [x], name, as_)


def softcap(x: Value, c, name=None, as_=None) -> Value:
    """c·tanh(x/c): Gemma-style logit soft-capping."""
    return _one(Map("softcap", c), [x], name, as_)


def _binary(fn):
    def f(a, b, name: str | None = None, as_: str | None = None) -> Value:
        if not isinstance(a, Value) or not isinstance(b, Value):
            c = b if isinstance(a, Value) else a
            x = a if isinstance(a, Value) else b
            if isinstance(c, (int, float)):  # x + 2.0 etc.: fold into a unary map
                return _const(fn, x, c, swapped=not isinstance(a, Value), name=name, as_=as_)
            raise NapkinError(f"{fn}: expected arrays or numbers, got {a!r} and {b!r}")
        return _one(Zip(fn), [a, b], name, as_)
    f.__name__, f.__doc__ = fn, f"Elementwise {fn}; an input lacking an axis is broadcast."
    return f


def _const(fn, x, c, swapped, name, as_):
    if fn == "add":
        return add_const(x, c, name, as_)
    if fn == "mul":
        return scale(x, c, name, as_)
    if fn == "sub" and not swapped:
        return add_const(x, -c, name, as_)
    if fn == "div" and not swapped:
        return scale(x, 1 / c, name, as_)
    raise NapkinError(f"{fn} with a constant on this side is not a primitive; build it from others")


add, sub, mul, div = _binary("add"), _binary("sub"), _binary("mul"), _binary("div")
guard = _binary("guard")  # guard(x, m): 0 where the row maximum m kept no entry, else x (NaN stays)
maximum, minimum = _binary("max"), _binary("min")


def _reduce(fn):
    def f(x: Value, axis, name: str | None = None, as_: str | None = None) -> Value:
        return _one(Reduce(fn, _name(axis)), [x], name, as_)
    f.__name__, f.__doc__ = fn, f"{fn} over one axis (the axis disappears)."
    return f


sum_, max_, mean, logsumexp = _reduce("sum"), _reduce("max"), _reduce("mean"), _reduce("logsumexp")


def softmax(x: Value, axis, name=None, as_=None) -> Value:
    return _one(Softmax(_name(axis)), [x], name, as_)


def causal_mask(x: Value, q, k, offset: int = 0, name=None, as_=None) -> Value:
    """Keep entries with key index <= query index + offset; fill the rest."""
    return _one(Mask("causal", _name(q), _name(k), offset=offset), [x], name, as_)


def window_mask(x: Value, q, k, width: int, name=None, as_=None) -> Value:
    """Sliding window: keep q - width < k <= q."""
    return _one(Mask("window", _name(q), _name(k), width=width), [x], name, as_)


def padding_mask(x: Value, valid: Value, name=None, as_=None) -> Value:
    """Keep entries where ``valid`` (axes a subset of x's) is non-zero."""
    return _one(Mask("padding"), [x, valid], name, as_)


def cast(x: Value, dtype: str, name=None, as_=None) -> Value:
    return _one(Cast(dtype), [x], name, as_)


def fill(type, value: float, name=None, as_=None) -> Value:
    """A constant array of the given ArrayType (accumulators start from one)."""
    return _one(Fill(float(value), type), [], name, as_)


def apply(spec, *xs: Value, name=None, out_names=None) -> list[Value]:
    """Record any primitive spec (rules replay boxes with it)."""
    return current().apply(spec, list(xs), name, out_names)
