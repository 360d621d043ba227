"""The primitive operations, as functions to call inside ``@algorithm``.

Every function records one box (see napkin.core.primitives for meanings) and
returns the traced output array.  Axes are named by :class:`Axis` or by name.
"""
from __future__ import annotations

import sys

from napkin.core.arrays import Axis
from napkin.core.errors import NapkinError
from napkin.core.primitives import (COMPARE, INTEGER, Cast, Compare, Contract, Fill, Map, Mask,
                               Positions, Reduce, SinkSoftmax, Softmax, TakeAlong, Where, Zip,
                               stray_axis)
from napkin.frontend.trace import Value, current


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
finite_or_zero, erf = _unary("finite_or_zero"), _unary("erf")


def gelu(x: Value, approximate: bool = False, name=None, as_=None) -> Value:
    """x·Φ(x), Φ the standard normal CDF: x·(1 + erf(x/√2))/2 (``approximate=False``, the
    exact form), or 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (``approximate=True``) —
    jax.nn.gelu's two forms."""
    if not isinstance(approximate, bool):
        raise NapkinError(f"gelu: approximate must be True or False, got {approximate!r}")
    return _one(Map("gelu_tanh" if approximate else "gelu"), [x], name, as_)


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
    if fn == "sub":  # c − x
        return add_const(neg(x), c, name, as_)
    if fn == "div":  # c / x
        return scale(recip(x), c, name, as_)
    if fn in ("max", "min"):  # commutative: either side
        return _one(Map(f"{fn}_const", c), [x], name, as_)
    raise NapkinError(f"{fn} with a constant is not a primitive; build it from others")


add, sub, mul, div = _binary("add"), _binary("sub"), _binary("mul"), _binary("div")
guard = _binary("guard")  # guard(x, m): 0 where the row maximum m kept no entry, else x (NaN stays)
maximum, minimum = _binary("max"), _binary("min")


def _reduce(fn):
    def f(x: Value, axis, name: str | None = None, as_: str | None = None) -> Value:
        return _one(Reduce(fn, _name(axis)), [x], name, as_)
    f.__name__, f.__doc__ = fn, f"{fn} over one axis (the axis disappears)."
    return f


sum_, max_, mean, logsumexp = _reduce("sum"), _reduce("max"), _reduce("mean"), _reduce("logsumexp")


def softmax(x: Value, axis, name=None, as_=None, *, sink: Value | None = None) -> Value:
    """Softmax over ``axis``.  ``sink``: an attention sink, one extra logit per row (an
    array without ``axis``, its axes some of x's others, e.g. sink[h] per head) that takes
    probability mass and has no value: exp(x − m) / (Σ exp(x − m) + exp(s − m))."""
    if sink is None:
        return _one(Softmax(_name(axis)), [x], name, as_)
    a = _name(axis)
    if not isinstance(sink, Value):
        raise NapkinError(f"softmax: the sink must be a traced array, got {sink!r}")
    stray = stray_axis(sink.type, x.type, a)  # (the spec checks too: this names the wires)
    if stray == a:
        raise NapkinError(f"softmax: the sink {sink.ob} has the softmax axis {a}; a sink is one "
                          f"logit per row (its axes a subset of {x.ob}'s others)")
    if stray:
        raise NapkinError(f"softmax: the sink {sink.ob} has axis {stray}, which the scores "
                          f"{x.ob} lack")
    return _one(SinkSoftmax(a), [x, sink], name, as_)


def causal_mask(x: Value, q, k, offset: int = 0, name=None, as_=None) -> Value:
    """Keep entries with key index <= query index + offset; fill the rest."""
    return _one(Mask("causal", _name(q), _name(k), offset=offset), [x], name, as_)


def window_mask(x: Value, q, k, width: int, name=None, as_=None) -> Value:
    """Sliding window: keep q - width < k <= q."""
    return _one(Mask("window", _name(q), _name(k), width=width), [x], name, as_)


def padding_mask(x: Value, valid: Value, name=None, as_=None) -> Value:
    """Keep entries where ``valid`` (axes a subset of x's) is non-zero."""
    return _one(Mask("padding"), [x, valid], name, as_)


def _compare(fn):
    def f(a, b, name: str | None = None, as_: str | None = None) -> Value:
        if isinstance(a, Value) and isinstance(b, Value):
            return _one(Compare(fn), [a, b], name, as_)
        if isinstance(a, Value) and _is_number(b):
            return _one(Compare(fn, b), [a], name, as_)
        if isinstance(b, Value) and _is_number(a):  # c < x is x > c
            return _one(Compare(Compare(fn).flipped(), a), [b], name, as_)
        raise NapkinError(f"{COMPARE[fn][0]}: expected arrays or numbers, got {a!r} and {b!r}")
    f.__name__ = COMPARE[fn][0]
    f.__doc__ = (f"a {COMPARE[fn][1]} b entry by entry (a bool array); either side may be a "
                 f"Python number; an input lacking an axis is broadcast.")
    return f


def _is_number(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool)


less, less_equal, greater = _compare("lt"), _compare("le"), _compare("gt")
greater_equal, equal, not_equal = _compare("ge"), _compare("eq"), _compare("ne")


def where(cond: Value, a, b, name=None, as_=None) -> Value:
    """a where ``cond`` (a bool array) holds, else b; a or b may be a Python number; inputs
    lacking an axis are broadcast; the result's dtype is promoted from a and b."""
    if not isinstance(cond, Value):
        raise NapkinError(f"where: the condition must be a traced bool array, got {cond!r}")
    args, consts = [cond], []
    for v in (a, b):
        if isinstance(v, Value):
            args.append(v)
            consts.append(None)
        elif _is_number(v):
            consts.append(v)
        else:
            raise NapkinError(f"where: expected an array or a number, got {v!r}")
    return _one(Where(*consts), args, name, as_)


def positions(axis, dtype: str = "f32", name=None, as_=None) -> Value:
    """The global index of each position along ``axis`` (an :class:`~napkin.core.arrays.Axis`,
    which carries its size): a box with no inputs whose output [axis] holds 0, 1, …,
    |axis| − 1 — inside a group or a stream chunk, the tile's own global indices."""
    if not isinstance(axis, Axis):
        raise NapkinError(f"positions: {axis!r} is not an Axis with a size (a bare name has no "
                          f"extent); pass the axis itself, e.g. q, = nk.axes('q')")
    return _one(Positions(axis.name, axis.size, dtype), [], name, as_)


def take_along_axis(x: Value, index: Value, axis, name=None, as_=None) -> Value:
    """out[…] = x[…, index[…], …]: x without ``axis``, at the positions an integer ``index``
    names (its axes are x's others, or some of them: broadcast).  An index outside
    [0, |axis|) picks 0 (the meaning is Σ over the axis of x where the position equals the
    index, which streams with the sum accumulator)."""
    a = _name(axis)
    for v, what in ((x, "array"), (index, "index")):
        if not isinstance(v, Value):
            raise NapkinError(f"take_along_axis: the {what} must be a traced array, got {v!r}")
    if not x.type.has(a):
        raise NapkinError(f"take_along_axis: the array {x.ob} has no axis {a}")
    if index.type.dtype not in INTEGER:
        raise NapkinError(f"take_along_axis: the index {index.ob} has dtype {index.type.dtype}; "
                          f"an index is an integer array (declare it Array(..., dtype='int32'))")
    stray = stray_axis(index.type, x.type, a)
    if stray == a:
        raise NapkinError(f"take_along_axis: the index {index.ob} has axis {a}, the axis it "
                          f"takes along (its axes are {x.ob}'s others, or some of them)")
    if stray:
        raise NapkinError(f"take_along_axis: the index {index.ob} has axis {stray}, which "
                          f"the array {x.ob} lacks")
    return _one(TakeAlong(a), [x, index], name, as_)


def cast(x: Value, dtype: str, name=None, as_=None) -> Value:
    return _one(Cast(dtype), [x], name, as_)


def fill(type, value: float, name=None, as_=None) -> Value:
    """A constant array of the given ArrayType (accumulators start from one)."""
    return _one(Fill(float(value), type), [], name, as_)


def apply(spec, *xs: Value, name=None, out_names=None) -> list[Value]:
    """Record any primitive spec (rules replay boxes with it)."""
    return current().apply(spec, list(xs), name, out_names)


Value.arithmetic = sys.modules[__name__]  # x + y on traced arrays records ops.add
