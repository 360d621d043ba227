"""Patterns read back as the napkin primitives the search streams: softmax, logsumexp and
log-softmax, mean, softcap, logsumexp's finite_or_zero shift, masks made numbers and back —
and, in :mod:`~napkin.frontend.jaxpr.elementwise` and :mod:`~napkin.frontend.jaxpr.masks`, gelu / silu /
sigmoid and causal / window masks.

Every rule is exact: it fires only on a structure whose meaning is the primitive's (over the
reals, a float cast the identity, as in napkin's semantics), with constants compared
exactly; napkin's softmax giving zeros for a row that keeps no entry is the one documented
difference.  A shared intermediate (JAX's softmax and log-softmax of one array share
x − max x once common subexpressions are shared) stays computed for its other users."""
from __future__ import annotations

import sympy

from napkin.frontend.jaxpr.constants import exact
from napkin.frontend.jaxpr.elementwise import cones
from napkin.frontend.jaxpr.graph import A, Node, Uses
from napkin.frontend.jaxpr.masks import masks
from napkin.frontend.jaxpr.vocabulary import FLOAT, rounded


def recognise(graph, outs):
    """Rewrite the graph's patterns in place, each rule until it no longer fires."""
    for rule in (_bool_where, _finite_or_zero, _softmax_family, _mean, _softcap, cones,
                 masks):
        while True:
            uses = Uses(graph, outs)
            if not any(rule(n, uses) for n in uses.live):
                break
    _share(graph, outs)


def _share(graph, outs):
    """Common subexpressions once more, after the patterns (log-softmax and logsumexp of one
    array each made a logsumexp)."""
    canon, seen = {}, {}
    for n in graph.nodes:
        n.args = [canon.get(id(a), a) for a in n.args]
        if n.op == "input":
            continue
        key = (n.op, tuple(id(a) for a in n.args), repr(sorted(n.p.items())), n.dtype)
        if key in seen:
            canon[id(n)] = seen[key]
        else:
            seen[key] = n
    for i, o in enumerate(outs):
        if isinstance(o, A) and id(o.node) in canon:
            outs[i] = A(canon[id(o.node)], o.dims)


def _indicator(m) -> bool:
    """where(c, a, 0) with a nonzero in its dtype: c as a number."""
    if m.op != "where" or len(m.args) != 1 or m.p["a"] is None or m.p["b"] != 0:
        return False
    a = m.p["a"]
    return (rounded(a, m.dtype) if m.dtype in FLOAT else a) != 0


def _bool_where(n, uses):
    """A mask made numbers and back (jnp.tril of ones, dot_product_attention's): where(c, a,
    0), a ≠ 0, read as bool (a cast, ``!= 0``, or a bool where(c, True, False)) is c."""
    if (n.is_("cast", dtype="bool") or n.is_("compare", fn="ne", const=0)) \
            and _indicator(n.args[0]):
        uses.replace(n, n.args[0].args[0])
        return True
    if n.dtype == "bool" and _indicator(n):
        uses.replace(n, n.args[0])
        return True
    return False


def _finite_or_zero(n, uses):
    """where(is_finite(m), m, 0) -> finite_or_zero(m) (logsumexp's shift)."""
    if n.op != "where" or n.p["a"] is not None or n.p["b"] != 0 or len(n.args) != 2:
        return False
    cond, m = n.args
    if cond.is_("map", fn="is_finite") and cond.args[0] is m:
        n.become("map", [m], {"fn": "finite_or_zero", "param": None})
        return True
    return False


def _shifted(y):
    """y = x − m with m = max_a(x) (or finite_or_zero of it): (x, a, m) or None."""
    if not y.is_("zip", fn="sub"):
        return None
    x, m = y.args
    m0 = m.args[0] if m.is_("map", fn="finite_or_zero") else m
    if m0.is_("reduce", fn="max") and m0.args[0] is x:
        return x, m0.p["axis"], m
    return None


def _summed(z):
    """z = Σ_a e, or Σ_a e summed in another float dtype (jnp sums bf16 in float32): (e, a)
    or None.  Only float casts: a sum of e cast to integers is no Σ e."""
    if z.is_("cast") and z.dtype in FLOAT:
        inner = z.args[0]
        if inner.is_("reduce", fn="sum") and inner.args[0].is_("cast") \
                and inner.args[0].dtype in FLOAT and inner.args[0].args[0].dtype in FLOAT:
            return inner.args[0].args[0], inner.p["axis"]
        return None
    if z.is_("reduce", fn="sum"):
        return z.args[0], z.p["axis"]
    return None


def _softmax_family(n, uses):
    if n.dtype not in FLOAT:
        return False
    # softmax: e / Σ_a e, e = exp(x − max_a x) (or exp(y) for any y: the same over ℝ)
    if n.is_("zip", fn="div"):
        e, z = n.args
        summed = _summed(z)
        if e.is_("map", fn="exp") and summed and summed[0] is e:
            axis, y = summed[1], e.args[0]
            sh = _shifted(y)
            if sh and sh[1] == axis:
                n.become("softmax", [sh[0]], {"axis": axis})
                return True
            if axis in y.axes:
                n.become("softmax", [y], {"axis": axis})
                return True
    # logsumexp: log Σ_a exp(x − m) + m;  log-softmax: (x − m) − log Σ_a exp(x − m)
    if n.op == "zip" and n.p["fn"] in ("add", "sub"):
        pairs = [(n.args[1], n.args[0])] if n.p["fn"] == "sub" else \
            [(n.args[0], n.args[1]), (n.args[1], n.args[0])]
        for lg, other in pairs:
            if not lg.is_("map", fn="log"):
                continue
            z = lg.args[0]
            z = z.args[0] if z.is_("map", fn="abs") else z  # |Σ exp| = Σ exp
            summed = _summed(z)
            if not summed or not summed[0].is_("map", fn="exp"):
                continue
            y = summed[0].args[0]
            sh = _shifted(y)
            if not sh or sh[1] != summed[1]:
                continue
            x, a, m = sh
            if n.p["fn"] == "add" and other is m:
                n.become("reduce", [x], {"fn": "logsumexp", "axis": a})
                return True
            if n.p["fn"] == "sub" and other is y:
                lse = Node("reduce", [x], {"fn": "logsumexp", "axis": a},
                           tuple(k for k in x.axes if k != a), n.dtype, n.src)
                nodes = uses.graph.nodes
                nodes.insert(next(i for i, k in enumerate(nodes) if k is n), lse)
                n.become("zip", [x, lse], {"fn": "sub"})
                return True
    return False


def _mean(n, uses):
    """(Σ_a x)·c with c·|a| = 1 exactly -> mean_a x."""
    if n.dtype in FLOAT and n.is_("map", fn="scale") and n.args[0].is_("reduce", fn="sum"):
        s = n.args[0]
        size = sympy.Symbol(s.p["axis"], integer=True, positive=True)
        if sympy.simplify(exact(n.p["param"]) * size - 1) == 0:
            n.become("reduce", [s.args[0]], {"fn": "mean", "axis": s.p["axis"]})
            return True
    return False


def _softcap(n, uses):
    """c·tanh(x·r) with c > 0 and c·r = 1 exactly (x / c makes r = 1/c exactly) ->
    softcap(c)."""
    if n.is_("map", fn="scale") and n.args[0].is_("map", fn="tanh") \
            and n.args[0].args[0].is_("map", fn="scale"):
        inner = n.args[0].args[0]
        c, r = exact(n.p["param"]), exact(inner.p["param"])
        if c.is_positive and sympy.simplify(c * r - 1) == 0:
            n.become("map", [inner.args[0]], {"fn": "softcap", "param": n.p["param"]})
            return True
    return False
