"""gelu (both forms), silu and sigmoid, read from an elementwise cone of one input by a
proof: the cone's meaning, built symbolically with napkin's sympy backend, minus the
primitive's own definition (the same backend) simplifies to 0.

What counts as the same constant: a cone's float constant is read as one of the constants
the primitives are defined with (1/√2, √2, √(2/π), 0.044715, or their negatives) when, held
in the cone's dtype, it *is* that constant held in that dtype — ``jax.nn.gelu`` writes
``np.sqrt(2 / np.pi).astype(dtype)``, and napkin's gelu evaluated in that dtype rounds the
same; every other constant is the exact binary fraction it holds.  The identity must hold on
all of ℝ with every intermediate real: each divisor is proved nonzero, each square root's or
log's argument nonnegative / positive (x·x/x is not x at 0).  Without a proof the cone stays
the plain ops it is."""
from __future__ import annotations

import functools

import numpy as np
import sympy

from napkin.core.backend import SYMPY
from napkin.frontend.jaxpr.constants import closed, exact
from napkin.frontend.jaxpr.vocabulary import FLOAT, rounded
from napkin.core.primitives import BINARY as ZIP_FNS, PARAM_UNARY, UNARY as MAP_FNS

_X = sympy.Symbol("x", real=True)
_CANDIDATES = ("gelu", "gelu_tanh", "silu", "sigmoid")
_CONSTANTS = tuple(s * k for k in (1 / sympy.sqrt(2), sympy.sqrt(2), sympy.sqrt(2 / sympy.pi),
                                   sympy.Rational(44715, 10 ** 6)) for s in (1, -1))
# every candidate has one of these: a cone without is none of them
_MARKS = {"erf", "erfc", "tanh", "exp", "sigmoid"}
_ROOTS = {("zip", "mul"), ("zip", "div"), ("map", "scale"), ("map", "recip")}
_MAX_REGION = 24


def _backend(f, *xs):
    """``f`` of napkin's sympy backend on scalar expressions."""
    return np.asarray(f(*[np.asarray(x, dtype=object) for x in xs]), dtype=object).item()


_DEFINITIONS = {name: _backend(getattr(SYMPY, MAP_FNS[name]), _X) for name in _CANDIDATES}


def _constant(v, dtype):
    """The exact value of the constant ``v`` of a node in ``dtype`` (see the module)."""
    if dtype in FLOAT:
        held = rounded(v, dtype)
        for k in _CONSTANTS:
            if rounded(k, dtype) == held:
                return k
    return exact(v)


def _real(n, args):
    """The meaning of node ``n`` on the symbolic ``args``, or None where napkin cannot show
    it real on all of ℝ (or the node is outside the cone's vocabulary)."""
    fn = n.p.get("fn")
    if n.op == "zip":
        if fn == "div" and args[1].is_zero is not False:
            return None
        return _backend(getattr(SYMPY, ZIP_FNS[fn]), *args) if fn in ZIP_FNS else None
    (x,) = args
    if fn in ("erf", "erfc"):
        return (sympy.erf if fn == "erf" else sympy.erfc)(x)
    domain = {"sqrt": x.is_nonnegative, "rsqrt": x.is_positive, "log": x.is_positive,
              "recip": x.is_zero is False}
    if domain.get(fn, True) is not True:
        return None
    if fn in PARAM_UNARY:
        c = _constant(n.p["param"], n.dtype)
        if (fn == "pow" and not _power_real(x, c)) or (fn == "softcap" and c.is_zero is not False):
            return None
        return _backend(lambda y: PARAM_UNARY[fn](SYMPY, y, SYMPY.const(c, y)), x)
    if fn in MAP_FNS and fn not in ("id", "finite_or_zero"):
        return _backend(getattr(SYMPY, MAP_FNS[fn]), x)
    return None


def _power_real(x, c) -> bool:
    """xᶜ is real for every real x the expression x takes."""
    if c.is_integer:
        return bool(c >= 0) or x.is_zero is False
    return x.is_positive is True or (x.is_nonnegative is True and bool(c >= 0))


def _differ(a, b) -> bool:
    """a and b take different values somewhere (evaluated to 30 digits): no identity."""
    for t in (sympy.Rational(37, 100), sympy.Rational(-13, 10), sympy.Rational(29, 10)):
        va, vb = complex(a.evalf(30, subs={_X: t})), complex(b.evalf(30, subs={_X: t}))
        if abs(va - vb) > 1e-12 * (1 + abs(vb)):
            return True
    return False


def _proved_equal(a, b) -> bool:
    """a = b on ℝ, by sympy: a − b expands (erfc written as 1 − erf) or, with tanh and
    sigmoid written through exp, cancels to 0."""
    try:
        d = (a - b).rewrite(sympy.erf)
        if sympy.expand(d) == 0:
            return True
        return sympy.cancel(sympy.together(sympy.expand(d.rewrite(sympy.exp)))) == 0
    except (sympy.PolynomialError, TypeError, ValueError, ZeroDivisionError):
        return False


@functools.lru_cache(maxsize=1024)
def _identify(expr):
    """The candidate whose definition ``expr`` provably is, else None."""
    for name in _CANDIDATES:
        want = _DEFINITIONS[name]
        try:
            if _differ(expr, want):
                continue
        except (TypeError, ValueError):
            continue
        if _proved_equal(expr, want):
            return name
    return None


def _in_vocabulary(n) -> bool:
    if n.op not in ("map", "zip") or n.dtype not in FLOAT:
        return False
    p = n.p.get("param")
    return p is None or closed(p)


def cones(n, uses):
    """A cone rooted at ``n`` of one leaf that provably is gelu / silu / sigmoid of it."""
    if not _in_vocabulary(n) or (n.op, n.p.get("fn")) not in _ROOTS:
        return False
    # the elementwise region above n (bounded), then each of its nodes as the leaf
    region, stack = [], [n]
    while stack and len(region) < _MAX_REGION:
        m = stack.pop()
        if any(m is r for r in region):
            continue
        region.append(m)
        stack.extend(a for a in m.args if _in_vocabulary(a))
    if not any(m.op == "map" and m.p["fn"] in _MARKS for m in region):
        return False
    for leaf in dict.fromkeys(a for m in region for a in m.args):
        order = _cone(n, leaf, uses)
        if order is None or len(order) < 2:
            continue
        vals = {id(leaf): _X}
        for m in order:
            vals[id(m)] = _real(m, [vals[id(a)] for a in m.args])
            if vals[id(m)] is None:
                break
        else:
            name = _identify(vals[id(n)])
            if name:
                n.become("map", [leaf], {"fn": name, "param": None})
                return True
    return False


def _cone(root, leaf, uses):
    """The nodes between ``leaf`` and ``root`` (topological order) when every path up from
    root ends at leaf through elementwise nodes used only inside; else None."""
    seen, order = {}, []

    def visit(m):
        if m is leaf:
            return True
        if id(m) in seen:
            return seen[id(m)]
        if not _in_vocabulary(m):
            seen[id(m)] = False
            return False
        seen[id(m)] = True  # provisional (a DAG: no cycles)
        ok = all(visit(a) for a in m.args)
        seen[id(m)] = ok
        if ok:
            order.append(m)
        return ok

    if not visit(root) or not any(leaf is a for m in order for a in m.args):
        return None
    counts = {}
    for m in order:
        for a in m.args:
            counts[id(a)] = counts.get(id(a), 0) + 1
    for m in order:
        if m is not root and counts.get(id(m), 0) != uses.get(id(m), 0):
            return None  # used outside the cone
    return order
