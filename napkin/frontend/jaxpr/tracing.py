"""A function's jaxpr as a flat list of equations: traced at symbolic sizes (or, where the
function needs numbers, at the given sizes and once more at others), every call (jit, pjit,
custom_jvp, custom_vjp, remat) inlined, constants read as literals."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import sympy

from napkin.frontend.jaxpr.vocabulary import INLINE, fail


class Var:
    """A jaxpr variable: its shape (ints and sympy size expressions) and dtype, and the
    equation that makes it (None for an argument)."""
    __slots__ = ("id", "shape", "dtype", "eqn")
    _count = 0

    def __init__(self, shape, dtype):
        Var._count += 1
        self.id, self.shape, self.dtype, self.eqn = Var._count, shape, dtype, None

    def __repr__(self):
        return f"v{self.id}{list(self.shape)}"


class Lit:
    """A literal or closed-over constant: one value (or an :class:`ArrayConstant`)."""
    __slots__ = ("value", "dtype")

    def __init__(self, value, dtype):
        self.value, self.dtype = value, dtype


@dataclass
class Eqn:
    prim: str
    ins: list
    outs: list
    params: dict
    src: str
    scope: tuple = ()

    def at(self) -> str:
        """Where in the user's code: ``at FILE:LINE (FUNCTION)``, and the JAX function it
        is inside of, if any."""
        inside = f", inside {self.scope[-1]}" if self.scope else ""
        return f"at {self.src}{inside}"

    def where(self) -> str:
        return f"{self.prim} {self.at()}"


@dataclass
class Traced:
    eqns: list
    invars: list
    outvars: list
    mode: str                   # "symbolic" or "concrete"
    sizes: dict                 # axis name -> int (the arguments' sizes)
    symbols: dict               # axis name -> sympy Symbol
    reason: str = ""            # why the symbolic trace failed, in concrete mode
    lits: list = field(default_factory=list)      # (Lit, where it is read)
    by_size: dict = field(default_factory=dict)   # concrete: int size -> [axis names]
    arg_shapes: list = field(default_factory=list)
    per: list = field(default_factory=list)       # per argument, its dims' axis names
    stand_ins: dict = field(default_factory=dict)  # concrete: a named axis of size 1 traced
                                                   # at another size -> its size (1)


class ArrayConstant:
    """A constant array of several values: refused where a live equation reads it."""

    def __init__(self, shape, where):
        self.shape, self.where = shape, where

    def refuse(self, at):
        fail(f"fn closes over an array constant of shape {self.shape} (read {at}); napkin "
             f"diagrams take arrays as arguments: pass it to fn as one")


def _scalar(value, where):
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item()
    flat = arr.reshape(-1)
    if flat.size and np.all(flat == flat[0]):
        return flat[0].item()  # a constant array: every entry one value (broadcast)
    return ArrayConstant(arr.shape, where)


def axis_sizes(structs, names):
    """{axis name: int size} and per argument its dims' names (sizes mode: n<size>)."""
    sizes, per = {}, []
    for i, s in enumerate(structs):
        dims = []
        for j, n in enumerate(s.shape):
            a = names[i][j] if names is not None else (None if n == 1 else f"n{n}")
            if a is not None:
                sizes[a] = n
            dims.append(a)
        per.append(dims)
    return sizes, per


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def trace(fn, structs, names, label) -> Traced:
    """``fn``'s equations, traced at one ``jax.export`` symbol per axis; where that fails
    (the function needs a size as a Python number), at the given sizes."""
    import jax
    sizes, per = axis_sizes(structs, names)
    symbols = {a: sympy.Symbol(a, integer=True, positive=True) for a in sizes}
    shapes = [s.shape for s in structs]
    try:
        from jax import export
        dims = dict(zip(sizes, export.symbolic_shape(", ".join(sizes)))) if sizes else {}
        sym_structs = [jax.ShapeDtypeStruct(tuple(dims[a] if a else 1 for a in p), s.dtype)
                       for p, s in zip(per, structs)]
        closed = jax.make_jaxpr(fn)(*sym_structs)
    except Exception as e:  # noqa: BLE001 — any failure: trace at the given sizes instead
        reason = _first_line(e)
    else:
        eqns, invars, outvars, lits = _flatten(closed, symbols, label)
        return Traced(eqns, invars, outvars, "symbolic", sizes, symbols, lits=lits,
                      arg_shapes=shapes, per=per)
    # at fixed sizes a dimension of size 1 cannot be told from a broadcast one: an axis the
    # caller named that has size 1 is traced at a size no other axis has (the equations are
    # the same at every size, which the second trace at other sizes checks), and the diagram
    # keeps its size 1
    stand_ins = {a: 1 for a, n in sizes.items() if n == 1}
    spare = iter(n for n in range(2, 10**6) if n not in sizes.values())
    for a in stand_ins:
        sizes[a] = next(spare)
    if stand_ins:
        structs = [jax.ShapeDtypeStruct(tuple(sizes[a] if a else 1 for a in p), s.dtype)
                   for p, s in zip(per, structs)]
        shapes = [s.shape for s in structs]
    try:
        eqns, invars, outvars, lits = _flatten(jax.make_jaxpr(fn)(*structs), symbols, label)
    except Exception as e:  # noqa: BLE001 — a function that needs its size-1 axis to be 1
        if not stand_ins:
            raise
        fail(f"axis {', '.join(stand_ins)} has size 1 and fn does not trace with symbolic "
             f"sizes ({reason}), nor at another size ({_first_line(e)}): give it another "
             f"size, or mark it '1' (a broadcast dimension)")
    by_size = {}
    for a, n in sizes.items():
        by_size.setdefault(n, []).append(a)
    return Traced(eqns, invars, outvars, "concrete", sizes, symbols, reason, lits, by_size,
                  shapes, per, stand_ins)


def _summary(source_info) -> str:
    try:
        from jax._src import source_info_util
        return source_info_util.summarize(source_info)
    except Exception:  # noqa: BLE001 — a private API: a message without the line
        return ""


def _sub_jaxpr(e):
    for k in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        p = e.params.get(k)
        if p is None:
            continue
        if hasattr(p, "jaxpr") and hasattr(p, "consts"):
            return p.jaxpr, list(p.consts)
        if hasattr(p, "eqns"):
            return p, []
    return None


def _scope_name(e) -> str:
    n = e.params.get("name")
    if isinstance(n, str):
        return n
    sub = _sub_jaxpr(e)
    info = getattr(sub[0], "debug_info", None) if sub else None
    src = getattr(info, "func_src_info", None) or ""
    return src.split(" ")[0] if src else e.primitive.name


def _flatten(closed, symbols, label):
    """The jaxpr's equations with every call inlined: (eqns, invars, outvars, literals)."""
    eqns, lits = [], []

    def dim(d):
        if isinstance(d, (int, np.integer)):
            return int(d)
        try:
            return sympy.sympify(str(d), locals=dict(symbols))
        except (sympy.SympifyError, TypeError):
            fail(f"cannot read the symbolic dimension {d}")

    def var(aval):
        return Var(tuple(dim(d) for d in aval.shape), np.dtype(aval.dtype))

    def lit(value, dtype, where):
        li = Lit(_scalar(value, where), np.dtype(dtype))
        lits.append((li, where))
        return li

    def run(jaxpr, consts, atoms, scope, outer=""):
        env = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = lit(c, v.aval.dtype, f"a constant of {label}")
        for v, a in zip(jaxpr.invars, atoms):
            env[v] = a

        def read(a, where):
            if type(a).__name__ == "Literal":
                return lit(a.val, a.aval.dtype, where)
            return env[a]

        for e in jaxpr.eqns:
            src = _summary(e.source_info) or outer or "an unknown line"
            ins = [read(a, src) for a in e.invars]
            name = e.primitive.name
            sub = _sub_jaxpr(e) if name in INLINE else None
            if sub is not None:
                outs = run(sub[0], sub[1], ins, scope + (_scope_name(e),), src)
            else:
                outs = [var(o.aval) for o in e.outvars]
                params = dict(e.params)
                for k in _SHAPE_PARAMS:
                    if isinstance(params.get(k), tuple):
                        params[k] = tuple(dim(d) for d in params[k])
                eq = Eqn(name, ins, outs, params, src, scope)
                for o in outs:
                    o.eqn = eq
                eqns.append(eq)
            for o, a in zip(e.outvars, outs):
                if type(o).__name__ != "DropVar":
                    env[o] = a
        return [read(v, f"an output of {label}") for v in jaxpr.outvars]

    invars = [var(v.aval) for v in closed.jaxpr.invars]
    outvars = run(closed.jaxpr, list(closed.consts), invars, ())
    return eqns, invars, outvars, lits


_SHAPE_PARAMS = ("slice_sizes", "shape", "new_sizes")


def dce(eqns, outvars):
    """The equations an output depends on."""
    live = {id(v) for v in outvars if isinstance(v, Var)}
    keep = []
    for e in reversed(eqns):
        if any(id(o) in live for o in e.outs):
            keep.append(e)
            live.update(id(a) for a in e.ins if isinstance(a, Var))
    return keep[::-1]


# -------------------------------------------------------------- sizes read as numbers
def _perturbed(sizes: dict) -> dict:
    """Other sizes, one per axis, chosen so that no two axes' ratios (to a power of ±½, ±1,
    ±2) agree: a constant that changes is then explained by one axis at most."""
    out, seen = {}, []
    for a, n in sizes.items():
        delta = 1
        while True:
            r = (n + delta) / n
            keys = [round(r ** p, 9) for p in (0.5, 1, 2)]
            if not any(k in seen for k in keys) and n + delta not in out.values():
                break
            delta += 1
        seen += keys
        out[a] = n + delta
    return out


_POWERS = (1, -1, sympy.Rational(1, 2), sympy.Rational(-1, 2), 2, -2)


def _holds(value, exact, dtype) -> bool:
    """The literal ``value`` is ``exact`` as its dtype holds it (floats: to the dtype's
    epsilon, relative — the rounding of the user's own arithmetic, ``math.sqrt(d)`` in
    float64 then float32)."""
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        return exact.is_integer and int(exact) == value
    import jax.numpy as jnp
    want, got = float(np.asarray(float(exact), dtype)), float(np.asarray(value, dtype))
    return abs(want - got) <= float(jnp.finfo(dtype).eps) * abs(got)


def _params_key(e) -> str:
    return repr(sorted((k, repr(v)) for k, v in e.params.items()
                       if k not in _SHAPE_PARAMS + ("sharding", "out_sharding")))


def read_size_constants(fn, structs, traced: Traced, dims, live, label, products=None,
                        fixed=None):
    """Trace ``fn`` again at other sizes and read every literal that changed as c·sizeᵖ.

    The reading is exact at both traced sizes: the two programs are the same equations with
    the same parameters, every dimension named an axis (``dims``, for the equations in
    ``live``) has that axis's size in both, and each changed constant is c·sizeᵖ to its
    dtype's rounding in both.  At sizes not traced it is the one law explaining both.
    ``products``: {argument axis: its parts} where fn merges or splits it (h = (g, h_1) of
    jnp.repeat), sized as their product; ``fixed``: the sizes of parts that are no argument's
    axis (fn's own numbers: they stay)."""
    import jax
    products, fixed = products or {}, fixed or {}
    base = {a: n for a, n in traced.sizes.items() if a not in products}
    other = _perturbed(base)

    def size(entry):
        if entry is None:
            return 1
        if isinstance(entry, tuple):
            return math.prod(size(a) for a in entry)
        return other[entry] if entry in other else fixed[entry]
    for a, parts in products.items():
        other[a] = size(parts)
    why = f"fn does not trace with symbolic sizes ({traced.reason})"
    advice = ("write sizes through jnp (jnp.sqrt(q.shape[-1]) rather than math.sqrt or "
              "d ** -0.5) so the diagram serves every size")
    try:
        structs2 = [jax.ShapeDtypeStruct(tuple(other[a] if a else 1 for a in p), s.dtype)
                    for p, s in zip(traced.per, structs)]
        closed2 = jax.make_jaxpr(fn)(*structs2)
    except Exception as e:  # noqa: BLE001
        fail(f"{why}, and at other sizes ({', '.join(f'{a}={n}' for a, n in other.items())}) "
             f"it fails ({_first_line(e)}); {advice}")
    eqns2, _, _, lits2 = _flatten(closed2, traced.symbols, label)
    if [(e.prim, _params_key(e)) for e in eqns2] != \
            [(e.prim, _params_key(e)) for e in traced.eqns] or len(lits2) != len(traced.lits):
        fail(f"{why}, and at other sizes it builds a different program; {advice}")
    for e1, e2 in zip(traced.eqns, eqns2):
        if id(e1) not in live:
            continue
        for o1, o2 in zip(e1.outs, e2.outs):
            for j, a in enumerate(dims(o1)):
                if o2.shape[j] != size(a):
                    what = "a unit dimension" if a is None else f"axis {a}" \
                        if isinstance(a, str) else f"the product of axes {' × '.join(a)}"
                    fail(f"{why}, and the dimension {e1.where()} makes has size "
                         f"{o1.shape[j]} at the given sizes but {o2.shape[j]} at other sizes "
                         f"({', '.join(f'{b}={n}' for b, n in other.items())}): it is not "
                         f"{what}; {advice}")
    for (lit, where), (lit2, _) in zip(traced.lits, lits2):
        v1, v2 = lit.value, lit2.value
        if isinstance(v1, ArrayConstant) or v1 == v2 or (isinstance(v1, float)
                                                          and math.isnan(v1) and math.isnan(v2)):
            continue
        found = []
        for a, n in base.items():  # a merged axis is explained by its parts
            for p in _POWERS:
                c = v1 / float(n) ** float(p)
                cs = sympy.nsimplify(c, tolerance=1e-7, rational=True)
                cs = cs if isinstance(cs, sympy.Rational) and cs.q <= 1000 else sympy.Float(c)
                if _holds(v1, cs * sympy.Integer(n) ** p, lit.dtype) and \
                        _holds(v2, cs * sympy.Integer(other[a]) ** p, lit2.dtype):
                    found.append((a, p, cs))
        if len(found) != 1:
            what = "more than one size explains it" if found else "it is no c·sizeᵖ"
            fail(f"the constant {v1:g} at {where} changes with the sizes ({v1:g}, then {v2:g} "
                 f"at other sizes: {what}) and {why}; {advice}")
        a, p, cs = found[0]
        lit.value = cs * traced.symbols[a] ** p
