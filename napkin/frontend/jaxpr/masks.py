"""Causal and sliding-window masks written with ``jnp.arange`` comparisons, read back as
napkin's ``causal_mask`` / ``window_mask`` so the search skips masked tiles.

``where(keep, s, fill)`` becomes ``mask(s)`` only where the two mean the same:

* every use of the masked scores is a softmax over the key axis: there a fill f ≤ −5e29
  (napkin's MASKED) and napkin's own fill (−1e30) give the same row — an entry at either
  is exp(−∞) = 0 beside a kept score, and a row that keeps no score (its maximum ≤ MASKED)
  is zeros under napkin's softmax either way;
* the fill is ≤ MASKED as the scores' dtype holds it (NaN is not), and the dtype is f64,
  f32 or bf16: f16 and fp8 clip napkin's fill to half their range, above MASKED;
* ``keep`` compares positions of the key axis with positions of one other axis of s (plus
  integer constants), in an exact dtype (int32 or f64: float32 positions round above 2²⁴),
  as k ≤ q + offset (causal) or that and k ≥ q + offset − width + 1 (window).

Anything else stays positions / compare / where: correct, not skipped."""
from __future__ import annotations

from napkin.frontend.jaxpr.constants import closed, number
from napkin.frontend.jaxpr.vocabulary import rounded
from napkin.core.primitives import MASKED

_MASKABLE = ("f64", "f32", "bf16")
_EXACT_POSITIONS = ("int32", "f64")


def _position(n):
    """n = positions(a) + c (c an integer, every step in an exact dtype): (a, c) or None."""
    c = 0
    while n.is_("map", fn="add_const") and n.dtype in _EXACT_POSITIONS and closed(n.p["param"]) \
            and float(number(n.p["param"])).is_integer():
        c += int(number(n.p["param"]))
        n = n.args[0]
    if n.is_("cast") and n.dtype in _EXACT_POSITIONS:
        n = n.args[0]
    if n.op == "positions" and n.dtype in _EXACT_POSITIONS:
        return n.p["axis"], c
    return None


def _bound(cmp, negate=False):
    """A comparison of two positions as (b, "le" | "ge", a, c): pos_b ≤ / ≥ pos_a + c —
    ``i >= j + c``, or of their difference with an integer, ``i - j < c``."""
    if cmp.op != "compare" or cmp.p["fn"] not in ("lt", "le", "gt", "ge"):
        return None
    if cmp.p["const"] is None:
        pa, pb = _position(cmp.args[0]), _position(cmp.args[1])
    else:
        diff, c = cmp.args[0], cmp.p["const"]
        if not diff.is_("zip", fn="sub") or diff.dtype not in _EXACT_POSITIONS \
                or not isinstance(c, int) or isinstance(c, bool):
            return None
        pa, pb = _position(diff.args[0]), _position(diff.args[1])
        pb = None if pb is None else (pb[0], pb[1] + c)  # a − b fn c  ⟺  a fn b + c
    if pa is None or pb is None or pa[0] == pb[0]:
        return None
    fn = cmp.p["fn"]
    if negate:
        fn = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}[fn]
    (a, ca), (b, cb) = pa, pb
    d = ca - cb
    # a + ca  fn  b + cb, over the integers
    return {"ge": (b, "le", a, d), "gt": (b, "le", a, d - 1),
            "le": (b, "ge", a, d), "lt": (b, "ge", a, d + 1)}[fn]


def _as_key(bound, k):
    """(kind, q, offset) with the bound written as k ≤ q + off ("upper") or k ≥ q + off."""
    b, rel, a, c = bound
    if b == k:
        return ("upper" if rel == "le" else "lower", a, c)
    if a == k:  # b rel k + c  ->  k rel' b − c
        return ("lower" if rel == "le" else "upper", b, -c)
    return None


def _fill(n):
    """(keep condition, scores, fill, negated) of where(keep, s, fill) / where(c, fill, s)."""
    if n.op != "where" or len(n.args) != 2:
        return None
    if n.p["a"] is None and n.p["b"] is not None:
        return n.args[0], n.args[1], n.p["b"], False
    if n.p["b"] is None and n.p["a"] is not None:
        return n.args[0], n.args[1], n.p["a"], True
    return None


def masks(n, uses):
    """where(keep, s, fill) -> causal_mask / window_mask, under the module's conditions."""
    found = _fill(n) if n.dtype in _MASKABLE else None
    if found is None:
        return False
    cond, s, fill, negate = found
    if not rounded(fill, n.dtype) <= rounded(MASKED, n.dtype):  # NaN fails too
        return False
    users = uses.users.get(id(n), [])
    if not users or uses.get(id(n)) != len(users) or any(m.op != "softmax" for m in users):
        return False
    keys = {m.p["axis"] for m in users}
    if len(keys) != 1:
        return False
    (k,) = keys
    conds = list(cond.args) if cond.op == ("or" if negate else "and") else [cond]
    bounds = [_bound(c, negate) for c in conds]
    if any(b is None for b in bounds):
        return False
    keyed = [_as_key(b, k) for b in bounds]
    if any(x is None for x in keyed) or len({q for _, q, _ in keyed}) != 1:
        return False
    q = keyed[0][1]
    if q not in s.axes or k not in s.axes:
        return False
    upper = [c for kind, _, c in keyed if kind == "upper"]
    lower = [c for kind, _, c in keyed if kind == "lower"]
    if len(upper) == 1 and not lower:
        n.become("mask", [s], {"kind": "causal", "q": q, "k": k, "offset": upper[0]})
        return True
    if len(upper) == 1 and len(lower) == 1 and upper[0] - lower[0] + 1 > 0:
        n.become("mask", [s], {"kind": "window", "q": q, "k": k, "offset": upper[0],
                               "width": upper[0] - lower[0] + 1})
        return True
    return False
