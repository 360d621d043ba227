"""Arithmetic on constants: literals, sizes (sympy symbols) and what the function computes
from them.  Exact where it is cheap (sizes, square roots, reciprocals: ``x / jnp.sqrt(2.0)``
is x·(1/√2)), float64 otherwise."""
from __future__ import annotations

import math
import operator

import numpy as np
import sympy

from napkin.frontend.jaxpr.vocabulary import FLOAT, fail


def number(v):
    """A Python number for a sympy number, else ``v`` (an expression, or a Python number)."""
    if isinstance(v, sympy.Basic):
        if v.is_Integer:
            return int(v)
        if v.is_Number:
            return float(v)
        if v == sympy.oo:
            return math.inf
        if v == -sympy.oo:
            return -math.inf
    return v


def closed(v) -> bool:
    """A constant: a Python number, or a sympy expression in no size (√2, not 1/√d)."""
    if isinstance(v, sympy.Basic):
        return not v.free_symbols
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def python(v, dtype: str):
    """A closed constant as the Python number a napkin box takes in ``dtype``."""
    return float(v) if dtype in FLOAT else int(v)


def exact(v):
    """``v`` as an exact sympy number: a float is the binary fraction it holds."""
    if isinstance(v, sympy.Basic):
        return sympy.Rational(v) if isinstance(v, sympy.Float) else v
    if isinstance(v, float):
        if math.isnan(v):
            return sympy.nan
        if math.isinf(v):
            return sympy.oo if v > 0 else -sympy.oo
        return sympy.Rational(v)
    return sympy.Integer(int(v))


def reciprocal(c):
    """1/c, exact for a finite nonzero c (so c·(1/c) is 1: a softcap's c·tanh(x/c))."""
    if isinstance(c, float) and (c == 0 or not math.isfinite(c)):
        return math.copysign(math.inf, c) if c == 0 else (0.0 if math.isinf(c) else c)
    return 1 / exact(c)


_SYMBOLIC = {"exp": sympy.exp, "log": sympy.log, "tanh": sympy.tanh, "neg": lambda x: -x,
             "abs": sympy.Abs, "sqrt": sympy.sqrt, "rsqrt": lambda x: 1 / sympy.sqrt(x),
             "square": lambda x: x ** 2, "sigmoid": lambda x: 1 / (1 + sympy.exp(-x)),
             "exp2": lambda x: 2 ** x, "recip": lambda x: 1 / x}
# on a float: exact over this domain (a real result), float64 elsewhere
_EXACT_ON = {"neg": lambda x: True, "abs": lambda x: True, "square": lambda x: True,
             "sqrt": lambda x: x >= 0, "rsqrt": lambda x: x > 0, "recip": lambda x: x != 0}
_FLOAT64 = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "neg": np.negative, "abs": np.abs,
            "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "square": np.square,
            "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "exp2": np.exp2, "recip": lambda x: 1 / x,
            "erf": np.vectorize(math.erf), "erfc": np.vectorize(math.erfc),
            "is_finite": np.isfinite}


def fold(fn, v):
    """The map ``fn`` of the constant ``v``."""
    v = number(v)
    if isinstance(v, sympy.Basic) and (v.free_symbols or fn in _SYMBOLIC):
        if fn not in _SYMBOLIC:
            fail(f"cannot compute {fn} of the size expression {v}")
        return number(sympy.simplify(_SYMBOLIC[fn](v)))
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
            and fn in _EXACT_ON and _EXACT_ON[fn](v):
        return number(_SYMBOLIC[fn](exact(v)))
    with np.errstate(all="ignore"):
        r = _FLOAT64[fn](np.float64(v)).item()
    return r


_PYTHON2 = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
            "div": operator.truediv, "pow": operator.pow, "max": max, "min": min,
            "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
            "eq": operator.eq, "ne": operator.ne}
_RELATIONS = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq,
              "ne": sympy.Ne}


def fold2(fn, a, b):
    """The binary ``fn`` of the constants ``a`` and ``b``."""
    a, b = number(a), number(b)
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        a, b = exact(a), exact(b)
        arithmetic = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
                      "div": operator.truediv, "pow": operator.pow}
        if fn in arithmetic:
            return number(sympy.simplify(arithmetic[fn](a, b)))
        if fn in ("max", "min"):
            return number((sympy.Max if fn == "max" else sympy.Min)(a, b))
        if fn in _RELATIONS:
            r = _RELATIONS[fn](a, b)
            if r in (sympy.true, sympy.false):
                return bool(r)
        fail(f"cannot compute {fn} of the size expressions {a} and {b}")
    if fn == "div" and isinstance(a, int) and isinstance(b, int):
        if b == 0:
            fail(f"an integer division by zero ({a} / 0)")
        return int(a / b)  # integer division truncates, as in lax.div
    if fn == "pow" and isinstance(a, int) and isinstance(b, int) and b >= 0:
        return a ** b
    if (fn == "div" and b == 0) or fn == "pow":  # IEEE: ±inf, NaN (not Python's errors)
        with np.errstate(all="ignore"):
            return _PYTHON2[fn](np.float64(a), np.float64(b)).item()
    return _PYTHON2[fn](a, b)


def convert(v, dtype: str):
    """The constant ``v`` converted to ``dtype`` (JAX's convert_element_type)."""
    v = number(v)
    if isinstance(v, sympy.Basic) and v.free_symbols:
        if dtype in FLOAT or v.is_integer:
            return v  # a size expression: exact in a float dtype, or integer-valued
        fail(f"cannot convert the size expression {v} to {dtype} (it is not an integer)")
    if dtype == "bool":
        return bool(v)
    if dtype in FLOAT:
        return v if isinstance(v, sympy.Basic) else float(v)
    return int(v)
