"""Primitive operations: what a box means, declared once.

Each primitive is an immutable *spec* (it lives in the DisCoPy box's ``data``)
with four faces, used by every functor in the system:

* ``infer(ins)``  – output array types from input array types (type checking);
* ``evaluate(ctx, ins, *arrays)`` – the JAX meaning (named axes, any extra
  woven axes: everything is written against axis *names*, so weaving is free);
* ``flops(ins, outs)`` – a sympy count;
* ``label()`` – the box's name in drawings and messages;

and the facts the schedule, the pseudocode, the drawing and the lowering need, declared
here once rather than kept as tables keyed on ``kind`` in each of them:
``elementwise`` (acts entry by entry: fusable, may write in place), ``commutative``,
``transcendental`` (runs on the special-function unit), ``unit(ins, outs)`` (which unit
its FLOPs run on), ``neutral(axis)`` (the value that leaves a reduction over ``axis``
unchanged: what a masked tail is padded with), ``absorbs(tag, port, ins, axis)`` (how a
mask's fill travels through it, for tile skipping), ``infix`` and ``colour`` (printing),
and ``vjp`` (the reverse derivative as boxes: the input cotangents built from the output's,
napkin.frontend.grad; proved in proofs/vjp.py).

Axis roles are not declared per primitive: they follow from the types.  An axis
in the output is *woven*; an input axis missing from every output is *reduced*;
an input lacking a woven axis is *broadcast* along it.  See :func:`roles`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import sympy

from napkin.core.arrays import ArrayType, Axis, canonical_dtype
from napkin.core.backend import MASK_FILL, MASKED  # noqa: F401  (masks' constants, here too)
from napkin.core.errors import NapkinError

# numpy's dtypes (ml_dtypes' for bf16 and fp8, as JAX's are): JAX takes them, and building
# a diagram imports no JAX (``napkin algorithms`` starts without it)
JNP_DTYPES = {name: np.dtype(t) for name, t in {
    "f64": np.float64, "f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16,
    "fp8": ml_dtypes.float8_e4m3fn, "int32": np.int32, "int8": np.int8, "bool": np.bool_,
}.items()}
FLOATING = ("f64", "f32", "bf16", "f16", "fp8")
INTEGER = ("int32", "int8")
_LOW_NP = tuple(JNP_DTYPES[t] for t in ("bf16", "f16", "fp8"))
_WIDTH = {"bool": 0, "int8": 1, "int32": 2, "fp8": 3, "bf16": 4, "f16": 4, "f32": 5, "f64": 6}



def _jax():
    from napkin.core.backend_jax import JAX
    return JAX


@dataclass
class EvalContext:
    """What evaluation knows besides the arrays: the size of every symbolic
    axis, and the global start index of every axis that a group or stream
    partition has sliced (index-dependent masks need it).

    ``exact``: casts between floating dtypes are the identity — the meaning over
    the reals that the rules are proved for, which the checker compares in
    float64 (rounding to a wire's dtype is checked separately, with a tolerance
    per dtype)."""
    env: dict = field(default_factory=dict)
    offsets: dict = field(default_factory=dict)
    xp: Any = field(default_factory=_jax)  # JAX imported when something is first evaluated
    exact: bool = False

    def number(self, expr) -> float:
        if isinstance(expr, (int, float)):
            return expr
        value = sympy.sympify(expr).subs(self.env)
        if value.free_symbols:
            free = sorted(map(str, value.free_symbols))
            given = ", ".join(f"'{n}': ..." for n in free)
            raise NapkinError(f"cannot evaluate {expr}: no input carries an axis of size "
                              f"{', '.join(free)} (a size a constant names is still a size): "
                              f"give it, e.g. nk.evaluate(diagram, sizes={{{given}}})")
        return float(value)

    def shifted(self, axis: str, start) -> EvalContext:
        offsets = dict(self.offsets)
        offsets[axis] = offsets.get(axis, 0) + start
        return EvalContext(self.env, offsets, self.xp, self.exact)

    def bound(self, symbol, value) -> EvalContext:
        """Context where a symbolic size (e.g. a group size g_q) has a value."""
        if not isinstance(symbol, sympy.Symbol):
            return self
        env = dict(self.env)
        env[symbol] = value
        return EvalContext(env, self.offsets, self.xp, self.exact)


def align(xp, x, src: tuple[str, ...], dst: tuple[str, ...]):
    """Transpose ``x`` (axes ``src``) into the order of ``dst``, inserting
    size-1 axes for the names ``src`` lacks (broadcasting)."""
    present = [n for n in dst if n in src]
    x = xp.transpose(x, [src.index(n) for n in present]) if present != list(src) else x
    shape, it = [], iter(x.shape)
    for n in dst:
        shape.append(next(it) if n in src else 1)
    return xp.reshape(x, shape)


def merge_axes(types: tuple[ArrayType, ...], what: str) -> dict[str, Axis]:
    """All axes of several arrays by name, checking that sizes agree."""
    seen: dict[str, Axis] = {}
    for i, t in enumerate(types):
        for a in t.axes:
            if a.name in seen and seen[a.name].size != a.size:
                raise NapkinError(
                    f"{what}: axis {a.name} has size {seen[a.name].size} in input 0.. "
                    f"but {a.size} in input {i}")
            seen.setdefault(a.name, a)
    return seen


def stray_axis(side: ArrayType, x: ArrayType, axis: str) -> str | None:
    """The first axis that keeps ``side`` from being an array over ``x``'s axes other than
    ``axis`` (a sink logit per row, a take's index): ``axis`` itself, or one ``x`` lacks;
    None when there is none."""
    if side.has(axis):
        return axis
    return next((n for n in side.names if not x.has(n)), None)


def promote(dtypes) -> str:
    dtypes = list(dtypes)
    best = max(dtypes, key=lambda d: _WIDTH[d])
    if {"bf16", "f16"} <= set(dtypes):
        return "f32"
    return best


class Spec:
    """Base of all primitive specs (frozen dataclasses)."""
    kind: ClassVar[str]
    n_in: ClassVar[int | None] = 1
    elementwise: ClassVar[bool] = False
    colour: ClassVar[str] = "#ffffff"      # box fill in drawings

    # -- declared facts (see the module doc) -----------------------------------------------
    @property
    def commutative(self) -> bool:
        return False

    @property
    def transcendental(self) -> bool:
        return False

    @property
    def infix(self) -> tuple[str, int] | None:
        """(operator, precedence) when printed as ``a op b``."""
        return None

    def unit(self, ins, outs) -> str:
        """Where the FLOPs run: "tensor" (a matrix product), "sfu" or "vector"."""
        return "sfu" if self.transcendental else "vector"

    def neutral(self, axis: str) -> float | None:
        """The entry that leaves this box's reduction over ``axis`` unchanged (None: it
        does not reduce the axis, or no padding value would do)."""
        return None

    def absorbs(self, tag: str, port: int, ins, axis: str, key: str | None = None) -> str | None:
        """What a masked entry becomes after this box, read on input ``port``: "NEG" (about
        the mask's fill, a huge negative), "ZERO" (exactly 0), "ABSORBED" (reduced away
        without a trace), or None (it leaks: skipping masked chunks would change the
        result).  ``axis``: the streamed axis; ``key``: the masks' key axis (``axis`` itself
        for a stream over the keys; for one over the queries, the other axis of the masks)."""
        return None

    def infer(self, ins: tuple[ArrayType, ...]) -> tuple[ArrayType, ...]:
        raise NotImplementedError

    def evaluate(self, ctx: EvalContext, ins, outs, *xs) -> tuple:
        raise NotImplementedError

    def flops(self, ins, outs) -> sympy.Expr:
        return sum((o.numel for o in outs), sympy.Integer(0))

    def label(self) -> str:
        return self.kind

    def relabelled(self, axis: str, size) -> Spec:
        """The spec once ``axis`` is relabelled to a tile size.  Primitives see
        sizes only through their input types; specs that carry types or
        diagrams of their own (fill, group, stream) override this."""
        return self

    def woven(self, axis: str) -> Spec:
        """The spec mapped over one more axis.  Named axes make this the
        identity for most primitives: only specs that list output axes
        explicitly need to add the new one."""
        return self

    def unwoven(self, axis: str) -> Spec:
        """The spec with a carried ``axis`` dropped (napkin.frontend.weave.unweave): the identity
        but for specs that list axes or hold types or diagrams."""
        return self

    def vjp(self, ad, ins, outs, xs, y, ct) -> tuple:
        """The vector-Jacobian product, as boxes: one cotangent per input (None: zero, or
        none at all — an integer or boolean input), built with ``ad.ops`` (napkin.ops) from
        the traced inputs ``xs``, the traced output ``y`` and its cotangent ``ct``;
        ``ad.to(v, type)`` sums ``v`` over the axes ``type`` lacks (a broadcast input's
        cotangent), broadcasts it over those it has and orders and casts it as ``type``."""
        raise NapkinError(f"{self.label()} declares no derivative (a vector-Jacobian "
                          f"product)")

    def check_arity(self, ins):
        if self.n_in is not None and len(ins) != self.n_in:
            raise NapkinError(f"{self.label()} takes {self.n_in} input(s), got {len(ins)}")


# --------------------------------------------------------------------------- contraction
@dataclass(frozen=True)
class Contract(Spec):
    """einsum over named axes: ``out`` lists the output axes in order."""
    out: tuple[str, ...]
    kind: ClassVar[str] = "contract"
    n_in: ClassVar[None] = None

    def infer(self, ins):
        if not ins:
            raise NapkinError("contract needs at least one input")
        seen = merge_axes(ins, "contract")
        missing = [n for n in self.out if n not in seen]
        if missing:
            raise NapkinError(f"contract: output axis {missing[0]} is in no input "
                              f"(inputs have {', '.join(seen)})")
        if len(set(self.out)) != len(self.out):
            raise NapkinError(f"contract: output repeats an axis: {self.out}")
        return (ArrayType(tuple(seen[n] for n in self.out), promote(t.dtype for t in ins)),)

    def evaluate(self, ctx, ins, outs, *xs):
        letters = {}
        for t in ins:
            for n in t.names:
                letters.setdefault(n, chr(ord("a") + len(letters)))
        spec = ",".join("".join(letters[n] for n in t.names) for t in ins)
        spec += "->" + "".join(letters[n] for n in self.out)
        if hasattr(ctx.xp, "axis_names"):  # a kernel writer: its refusals name the axes
            ctx.xp.axis_names = {c: n for n, c in letters.items()}
        return (ctx.xp.einsum(spec, *xs),)

    def vjp(self, ad, ins, outs, xs, y, ct):
        # ∂/∂x_i Σ ct·Π x_j = the product of ct and the other operands, onto x_i's axes
        # (an axis only x_i has gets ct broadcast along it: a product with ones)
        grads = []
        for i, t in enumerate(ins):
            others = [x for j, x in enumerate(xs) if j != i] + [ct]
            have = {n for v in others for n in v.type.names}
            lone = tuple(a for a in t.axes if a.name not in have)
            if lone:
                others.append(ad.ones(ArrayType(lone, ct.type.dtype)))
            grads.append(ad.to(ad.ops.contract(*others, out=t.names), t) if ad.floating(t)
                         else None)
        return tuple(grads)

    def woven(self, axis):
        return self if axis in self.out else Contract((axis, *self.out))

    def unwoven(self, axis):
        return Contract(tuple(a for a in self.out if a != axis))

    colour = "#d6e6f7"

    def unit(self, ins, outs) -> str:
        return "tensor" if matmul_axes(ins, outs)[0] else "vector"

    def neutral(self, axis):
        return None if axis in self.out else 0.0

    def absorbs(self, tag, port, ins, axis, key=None):
        if tag != "ZERO":
            return None
        return "ABSORBED" if axis not in self.out else "ZERO"

    def flops(self, ins, outs):
        # n-ary product of every index combination: (n-1) multiplies + 1 add.
        allaxes = merge_axes(ins, "contract")
        return len(ins) * sympy.Mul(*[a.size for a in allaxes.values()])

    def label(self):
        return f"contract->{''.join(self.out) if all(len(n) == 1 for n in self.out) else ','.join(self.out)}"


def matmul_axes(ins, outs) -> tuple[bool, list, list, tuple]:
    """Whether a contraction is a matrix product — two inputs, each with an output axis of
    its own, and a summed axis (tensor cores run those) — with its m axes (output axes of
    the first input), n axes (of the second only) and the summed axes."""
    allaxes = merge_axes(ins, "contract")
    out_names = {n for o in outs for n in o.names}
    reduced = tuple(n for n in allaxes if n not in out_names)
    m_ax = n_ax = []
    if len(ins) == 2 and rows_from_second(ins, outs):
        ins = (ins[1], ins[0])
    if len(ins) == 2:
        m_ax = [n for n in ins[0].names if n in out_names]
        n_ax = [n for n in ins[1].names if n in out_names and n not in ins[0].names]
    mm = bool(reduced and n_ax and any(n not in ins[1].names for n in m_ax))
    return mm, m_ax, n_ax, reduced


def rows_from_second(ins, outs) -> bool:
    """Whether a product of two operands takes its rows (M) from the second: the output's
    leading axis that only one operand carries is the second's (V·dO into dP[q, x] is
    written dO·Vᵀ).  Rows are the output's leading axes, so the result needs no transpose
    and the row operand is the one a tensor-core instruction's 64 rows tile."""
    if len(ins) != 2 or not outs:
        return False
    a, b = ins[0].names, ins[1].names
    for n in outs[0].names:
        if (n in a) != (n in b):
            return n in b
    return False


def matmul_sides(box) -> dict | None:
    """A contraction box's sides as a matrix product: {"M": ..., "N": ..., "K": ...}, each
    [(axis, size), ...] — M the first operand's output axes the second lacks, N the second's
    own, K the summed ones; None when the box is no matrix product (tensor cores run those
    sides: M rows per warp group, no side under the least dot)."""
    if box.spec.kind != "contract":
        return None
    ins = tuple(ob.type for ob in box.dom.inside)
    mm, m_ax, n_ax, summed = matmul_axes(ins, tuple(ob.type for ob in box.cod.inside))
    if not mm:
        return None
    size = {a.name: a.size for t in ins for a in t.axes}
    second = ins[0] if rows_from_second(ins, tuple(ob.type for ob in box.cod.inside)) else ins[1]
    sides = {"M": [a for a in m_ax if a not in second.names], "N": n_ax, "K": list(summed)}
    return {what: [(a, size[a]) for a in axes] for what, axes in sides.items()}


def merged_runs(box, names) -> list[tuple[str, ...]]:
    """The runs of a value's layout ``names`` that the matrix product ``box`` reads as one
    side: two or more of its axes, adjacent in the layout, in layout order (GQA's rows
    (r, q) of Q[r, q, d]: a reshape, where axes apart would be a transpose)."""
    runs = []
    for side in (matmul_sides(box) or {}).values():
        at = sorted(names.index(a) for a, _ in side if a in names)
        if len(at) >= 2 and at == list(range(at[0], at[0] + len(at))):
            runs.append(tuple(names[k] for k in at))
    return runs


# --------------------------------------------------------------------------- elementwise
# name -> backend function name (napkin.core.backend)
UNARY = {
    "exp": "exp", "log": "log", "tanh": "tanh", "neg": "negative", "sigmoid": "sigmoid",
    "square": "square", "sqrt": "sqrt", "rsqrt": "rsqrt", "recip": "reciprocal",
    "relu": "relu", "silu": "silu", "abs": "abs", "id": None,
    # x·Φ(x): the exact (erf) form, and the tanh form (jax.nn.gelu's two)
    "gelu": "gelu", "gelu_tanh": "gelu_tanh", "erf": "erf",
    # x where finite, else 0: the shift of a running max that has seen only −∞ (or
    # +∞), so that exp(x − shift) is exp(−∞) = 0 rather than exp(−∞ + ∞) = NaN
    "finite_or_zero": "finite_or_zero",
}
PARAM_UNARY = {
    "scale": lambda xp, x, c: xp.multiply(x, c),
    "softcap": lambda xp, x, c: xp.multiply(xp.tanh(xp.divide(x, c)), c),
    "add_const": lambda xp, x, c: xp.add(x, c),
    "pow": lambda xp, x, c: xp.power(x, c),
    # max(x, c) and min(x, c) with a constant c (either side: both commute)
    "max_const": lambda xp, x, c: xp.maximum(x, c),
    "min_const": lambda xp, x, c: xp.minimum(x, c),
}
# Transcendental maps run on the special-function unit (cost and lowering care).
TEMPORARIES = {"erf": 2, "gelu": 2}  # Map.temporaries
TRANSCENDENTAL = {"exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "silu", "softcap", "gelu",
                  "gelu_tanh", "erf"}


@dataclass(frozen=True)
class Map(Spec):
    """Unary elementwise function; ``param`` (a number or a sympy expression
    in axis sizes, e.g. 1/sqrt(d)) for the parametrised ones."""
    fn: str
    param: Any = None
    kind: ClassVar[str] = "map"

    def __post_init__(self):
        if self.fn in UNARY:
            if self.param is not None:
                raise NapkinError(f"{self.fn} takes no parameter")
        elif self.fn in PARAM_UNARY:
            if self.param is None:
                raise NapkinError(f"{self.fn} needs a parameter")
            object.__setattr__(self, "param", sympy.sympify(self.param))
        else:
            raise NapkinError(f"unknown elementwise function {self.fn!r}; known: "
                              f"{', '.join(sorted(UNARY) + sorted(PARAM_UNARY))}")

    elementwise = True
    colour = "#eeeeee"

    @property
    def transcendental(self):
        return self.fn in TRANSCENDENTAL

    @property
    def temporaries(self) -> int:
        """Tiles of temporaries a kernel keeps beside this box's input and output while it
        computes it over a tile: Triton has no erf, and the kernel writer's erfc
        (napkin.lower.emit: t = 1/(1 + |x|/2) and a Horner polynomial in t beside |x|, which
        ptxas recomputes from x) holds two."""
        return TEMPORARIES.get(self.fn, 0)

    def absorbs(self, tag, port, ins, axis, key=None):
        if self.fn == "id" or (self.fn == "scale" and sympy.sympify(self.param).is_positive):
            return tag
        if self.fn == "min_const" and tag == "NEG":
            return "NEG"  # min(fill, c) <= fill: still about the fill (max(fill, c) is c: no)
        return "ZERO" if self.fn == "exp" and tag == "NEG" else None

    def infer(self, ins):
        self.check_arity(ins)
        return (ins[0],)

    def evaluate(self, ctx, ins, outs, x):
        xp = ctx.xp
        if self.fn in UNARY:
            return (x if UNARY[self.fn] is None else getattr(xp, UNARY[self.fn])(x),)
        c = self.param if xp.symbolic else ctx.number(self.param)
        return (PARAM_UNARY[self.fn](xp, x, xp.const(c, x)),)

    def vjp(self, ad, ins, outs, xs, y, ct):
        o, (x,), c, f = ad.ops, xs, self.param, self.fn
        if f in ("id", "add_const"):
            g = ct
        elif f == "neg":
            g = o.neg(ct)
        elif f == "scale":
            g = o.scale(ct, c)
        elif f == "relu":  # 0 at 0, as JAX's
            g = o.where(o.greater(x, 0.0), ct, 0.0)
        elif f in ("max_const", "min_const"):  # a tie splits the cotangent, as JAX's does
            beyond, edge = (o.greater if f == "max_const" else o.less), float(c)
            g = o.where(beyond(x, edge), ct,
                        o.where(o.equal(x, edge), o.scale(ct, sympy.Rational(1, 2)), 0.0))
        elif f == "abs":  # sign(x)·ct, 0 at 0 (JAX's)
            g = o.where(o.greater(x, 0.0), ct, 0.0) - o.where(o.less(x, 0.0), ct, 0.0)
        elif f == "finite_or_zero":  # the identity where x is finite, a constant elsewhere
            g = o.where(o.equal(o.finite_or_zero(x), x), ct, 0.0)
        else:
            g = ct * _slope(o, f, c, x, y)
        return (ad.to(g, ins[0]) if ad.floating(ins[0]) else None,)

    def label(self):
        if self.param is None:
            return self.fn
        p = self.param
        return f"{self.fn}({float(p):g})" if p.is_Number else f"{self.fn}({p})"


def _slope(o, f: str, c, x, y):
    """f′(x) as boxes over x and y = f(x), for the smooth maps."""
    if f == "exp":
        return y
    if f == "log":
        return o.recip(x)
    if f == "tanh":
        return 1.0 - y * y
    if f == "sigmoid":
        return y * (1.0 - y)
    if f == "square":
        return o.scale(x, 2)
    if f == "sqrt":
        return o.scale(o.recip(y), sympy.Rational(1, 2))
    if f == "rsqrt":  # (x^−½)′ = −½·x^−3/2 = −½·y³
        return o.scale(y * y * y, sympy.Rational(-1, 2))
    if f == "recip":
        return o.neg(y * y)
    if f == "silu":  # (x·σ)′ = σ·(1 + x·(1 − σ))
        s = o.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if f == "erf":  # 2/√π · exp(−x²)
        return o.scale(o.exp(o.neg(o.square(x))), 2 / sympy.sqrt(sympy.pi))
    if f == "gelu":  # Φ(x) + x·φ(x)
        cdf = o.scale(1.0 + o.erf(o.scale(x, 1 / sympy.sqrt(2))), sympy.Rational(1, 2))
        pdf = o.scale(o.exp(o.scale(o.square(x), sympy.Rational(-1, 2))),
                      1 / sympy.sqrt(2 * sympy.pi))
        return cdf + x * pdf
    if f == "gelu_tanh":  # ½(1 + t) + ½x(1 − t²)·k(1 + 3a·x²), t = tanh(k(x + a·x³))
        k, a = sympy.sqrt(2 / sympy.pi), sympy.Rational(44715, 10 ** 6)
        t = o.tanh(o.scale(x + o.scale(o.square(x) * x, a), k))
        inner = o.scale(1.0 + o.scale(o.square(x), 3 * a), k)
        return o.scale(1.0 + t, sympy.Rational(1, 2)) + \
            o.scale(x * (1.0 - t * t) * inner, sympy.Rational(1, 2))
    if f == "softcap":  # (c·tanh(x/c))′ = 1 − (y/c)²
        return 1.0 - o.scale(o.square(y), 1 / c ** 2)
    if f == "pow":
        return o.scale(o.power(x, c - 1), c)
    raise NapkinError(f"{f} declares no derivative")


BINARY = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide",
          "max": "maximum", "min": "minimum",
          # guard(x, m): 0 where the row maximum m kept no entry (m <= MASKED), else x
          "guard": "guard"}


@dataclass(frozen=True)
class Zip(Spec):
    """Binary elementwise function; an input lacking an axis is broadcast."""
    fn: str
    kind: ClassVar[str] = "zip"
    n_in: ClassVar[int] = 2

    def __post_init__(self):
        if self.fn not in BINARY:
            raise NapkinError(f"unknown binary function {self.fn!r}; known: {', '.join(BINARY)}")

    elementwise = True
    colour = "#eeeeee"

    @property
    def commutative(self):
        return self.fn in ("add", "mul", "max", "min")

    @property
    def infix(self):
        return {"add": ("+", 1), "sub": ("-", 1), "mul": ("*", 2), "div": ("/", 2)}.get(self.fn)

    def absorbs(self, tag, port, ins, axis, key=None):
        other = ins[1 - port]
        # shifted by a value no mask over (·, key) can have masked: a per-row statistic
        if tag == "NEG" and not other.has(key or axis) and \
                ((self.fn in ("sub", "add") and port == 0) or (self.fn == "add" and port == 1)):
            return "NEG"  # shifted by a value constant along the keys: still about the fill
        if tag == "ZERO" and (self.fn == "mul" or (self.fn == "guard" and port == 0)):
            return "ZERO"  # 0·y = 0; guard(0, m) is 0 either way
        return None

    def infer(self, ins):
        self.check_arity(ins)
        seen = merge_axes(ins, self.fn)
        return (ArrayType(tuple(seen.values()), promote(t.dtype for t in ins)),)

    def vjp(self, ad, ins, outs, xs, y, ct):
        o, (a, b), f = ad.ops, xs, self.fn
        if f == "add":
            ga, gb = ct, ct
        elif f == "sub":
            ga, gb = ct, o.neg(ct)
        elif f == "mul":
            ga, gb = ct * b, ct * a
        elif f == "div":
            ga, gb = ct / b, o.neg(ct * y / b)
        elif f in ("max", "min"):  # the larger (smaller) side takes it; a tie splits it
            wins = o.greater if f == "max" else o.less
            half = o.where(o.equal(a, b), o.scale(ct, sympy.Rational(1, 2)), 0.0)
            ga, gb = o.where(wins(a, b), ct, half), o.where(wins(b, a), ct, half)
        elif f == "guard":  # x where the row kept an entry, else a constant 0
            ga, gb = o.guard(ct, b), None
        else:
            raise NapkinError(f"{f} declares no derivative")
        return tuple(ad.to(g, t) if g is not None and ad.floating(t) else None
                     for g, t in zip((ga, gb), ins))

    def evaluate(self, ctx, ins, outs, a, b):
        xp, names = ctx.xp, outs[0].names
        return (getattr(xp, BINARY[self.fn])(align(xp, a, ins[0].names, names),
                                             align(xp, b, ins[1].names, names)),)

    def label(self):
        return self.fn


# --------------------------------------------------------------------------- reductions
REDUCERS = ("sum", "max", "mean", "logsumexp")


@dataclass(frozen=True)
class Reduce(Spec):
    fn: str
    axis: str
    kind: ClassVar[str] = "reduce"

    def __post_init__(self):
        if self.fn not in REDUCERS:
            raise NapkinError(f"unknown reduction {self.fn!r}; known: {', '.join(REDUCERS)}")

    colour = "#fbe0c4"

    def neutral(self, axis):
        if axis != self.axis:
            return None
        return {"sum": 0.0, "mean": 0.0, "max": float("-inf"),
                "logsumexp": float("-inf")}.get(self.fn)

    def absorbs(self, tag, port, ins, axis, key=None):
        if self.axis == axis and ((tag == "NEG" and self.fn in ("max", "logsumexp"))
                                  or (tag == "ZERO" and self.fn == "sum")):
            return "ABSORBED"
        return None

    def infer(self, ins):
        self.check_arity(ins)
        ins[0].axis(self.axis)
        return (ins[0].without(self.axis),)

    def evaluate(self, ctx, ins, outs, x):
        i, xp = ins[0].names.index(self.axis), ctx.xp
        if self.fn == "mean" and not xp.symbolic:
            # the mean is Σ / |axis|, the declared size: a kernel's padded block is longer
            # (its padding the neutral 0), so it divides by the size, not the extent
            try:
                n = ctx.number(ins[0].axis(self.axis).size)
            except NapkinError:
                n = x.shape[i]
            if x.shape[i] != n:
                total = xp.sum(xp.astype(x, np.float32), i)
                return (xp.astype(xp.multiply(total, xp.const(1.0 / n, total)), x.dtype),)
        return (getattr(xp, self.fn)(x, i),)

    def flops(self, ins, outs):
        return ins[0].numel * (4 if self.fn == "logsumexp" else 1)

    def vjp(self, ad, ins, outs, xs, y, ct):
        o, (x,), t = ad.ops, xs, ins[0]
        if not ad.floating(t):
            return (None,)
        if self.fn == "sum":
            g = ct
        elif self.fn == "mean":
            g = o.scale(ct, 1 / t.axis(self.axis).size)
        elif self.fn == "max":  # the maxima share the cotangent equally, as in JAX
            at = o.equal(x, y)
            g = o.where(at, ct, 0.0) / o.sum_(o.where(at, 1.0, 0.0), self.axis)
        else:  # logsumexp: softmax · ct (a row of −∞ has none: 0, not NaN)
            g = ct * o.exp(x - o.finite_or_zero(y))
        return (ad.to(g, t),)

    def label(self):
        return f"{self.fn}_{self.axis}"


@dataclass(frozen=True)
class Softmax(Spec):
    axis: str
    kind: ClassVar[str] = "softmax"
    colour = "#fbe0c4"

    def neutral(self, axis):
        return float("-inf") if axis == self.axis else None

    def infer(self, ins):
        self.check_arity(ins)
        ins[0].axis(self.axis)
        return (ins[0],)

    def evaluate(self, ctx, ins, outs, x):
        # A fully masked row (every score the mask's fill) has no distribution: zeros.
        xp, i = ctx.xp, ins[0].names.index(self.axis)
        shape = list(x.shape)
        shape[i] = 1
        return (xp.guard(xp.softmax(x, i), xp.reshape(xp.max(x, i), shape)),)

    def flops(self, ins, outs):
        return 5 * ins[0].numel  # max, subtract, exp, sum, divide

    def vjp(self, ad, ins, outs, xs, y, ct):
        # P ⊙ (ct − Σ ct ⊙ P): a row that kept nothing (P = 0) gets 0; the row term Σ ct ⊙ P
        # a contraction (or, with P·V saved, Σ dO ⊙ O: napkin.frontend.grad)
        g = y * (ct - ad.row_term(ct, y, self.axis))
        return (ad.to(g, ins[0]) if ad.floating(ins[0]) else None,)

    def label(self):
        return f"softmax_{self.axis}"


@dataclass(frozen=True)
class SinkSoftmax(Softmax):
    """Softmax over ``axis`` with an attention *sink*: one extra logit s per row (input 1,
    its axes a subset of the others) that takes probability mass and carries no value:
    P = exp(x − m) / (Σ exp(x − m) + exp(s − m)), m = max(max x, s).  A row whose scores
    are all masked keeps the sink: its probabilities are 0 (the sink takes the mass); a
    row with neither a score nor a finite sink (everything −∞ or the mask's fill) gives
    zeros, as softmax does.  ``sink`` marks the two-input form (a field, so fingerprints
    tell the two apart); it is always True."""
    sink: bool = True
    n_in: ClassVar[int] = 2

    def __post_init__(self):
        if self.sink is not True:
            raise NapkinError("a sink softmax has sink=True (use Softmax for none)")

    def infer(self, ins):
        self.check_arity(ins)
        x, s = ins
        x.axis(self.axis)
        stray = stray_axis(s, x, self.axis)
        if stray == self.axis:
            raise NapkinError(f"softmax: the sink {s} has the softmax axis {self.axis}; a sink "
                              f"is one logit per row (its axes a subset of {x} without "
                              f"{self.axis})")
        if stray:
            raise NapkinError(f"softmax: the sink {s} has axis {stray}, which the scores {x} "
                              f"lack")
        merge_axes(ins, "softmax sink")
        return (x,)

    def evaluate(self, ctx, ins, outs, x, s):
        xp, names = ctx.xp, ins[0].names
        i = names.index(self.axis)
        dt = getattr(x, "dtype", None)
        low = dt is not None and dt in _LOW_NP
        if low:  # normalise a low-precision row in f32 (as the kernels do), round once
            x, s = xp.astype(x, np.float32), xp.astype(s, np.float32)
        shape = list(x.shape)
        shape[i] = 1
        s = align(xp, s, ins[1].names, names)
        m = xp.maximum(xp.reshape(xp.max(x, i), shape), s)
        shift = xp.finite_or_zero(m)  # a row of −∞ and a −∞ sink: exp(−∞) = 0, not NaN
        e = xp.exp(xp.subtract(x, shift))
        z = xp.add(xp.reshape(xp.sum(e, i), shape), xp.exp(xp.subtract(s, shift)))
        p = xp.guard(xp.divide(e, z), m)
        return (xp.astype(p, dt) if low else p,)

    def flops(self, ins, outs):
        return 5 * ins[0].numel + 3 * outs[0].without(self.axis).numel

    def vjp(self, ad, ins, outs, xs, y, ct):
        # the sink is one more logit with no value: its probability 1 − Σ P (exp(s − L)
        # from a saved L: napkin.frontend.grad), its cotangent −(1 − Σ P)·Σ ct ⊙ P; the
        # scores' as softmax's
        o = ad.ops
        r = ad.row_term(ct, y, self.axis)
        gx = y * (ct - r)
        gs = o.neg(ad.rest(y, self.axis, xs[1]) * r)
        return tuple(ad.to(g, t) if ad.floating(t) else None for g, t in zip((gx, gs), ins))

    def label(self):
        return f"softmax_{self.axis}+sink"


# --------------------------------------------------------------------------- masks
@dataclass(frozen=True)
class Mask(Spec):
    """``where(keep, x, fill)`` with an index-dependent ``keep``:

    * ``causal``:  key index k <= query index q + offset;
    * ``window``:  q + offset - width < k <= q + offset;
    * ``padding``: a second input (axes a subset of x's) is non-zero.
    Indices are global: a group or stream partition shifts them (EvalContext).
    """
    kind_: str
    q: str | None = None
    k: str | None = None
    width: int | None = None
    offset: int = 0
    fill: float = MASK_FILL
    kind: ClassVar[str] = "mask"

    def __post_init__(self):
        if self.kind_ not in ("causal", "window", "padding"):
            raise NapkinError(f"unknown mask {self.kind_!r}; known: causal, window, padding")
        if self.kind_ == "window" and (not isinstance(self.width, int) or self.width <= 0):
            raise NapkinError(f"a window mask needs a positive integer width, got {self.width!r}")

    elementwise = True
    colour = "#f5d3d3"

    def absorbs(self, tag, port, ins, axis, key=None):
        if port == 0 and tag == "NEG":
            return "NEG"
        if port == 0 and tag == "ZERO" and self.fill == 0:
            return "ZERO"  # a backward's mask on a cotangent: zeros stay zeros
        return None

    @property
    def n_in(self):
        return 2 if self.kind_ == "padding" else 1

    def infer(self, ins):
        self.check_arity(ins)
        x = ins[0]
        if self.kind_ == "padding":
            extra = [n for n in ins[1].names if n not in x.names]
            if extra:
                raise NapkinError(f"padding mask has axis {extra[0]} that the masked array "
                                  f"{x} lacks")
            merge_axes(ins, "padding mask")
        else:
            for role, n in (("query", self.q), ("key", self.k)):
                if n is None or not x.has(n):
                    raise NapkinError(f"{self.kind_} mask: {role} axis {n!r} is not an axis of {x}")
        return (x,)

    def evaluate(self, ctx, ins, outs, x, *rest):
        xp, names = ctx.xp, ins[0].names
        fill = xp.mask_fill(self.fill, x)
        if self.kind_ == "padding":
            keep = align(xp, rest[0], ins[1].names, names) != 0
        else:
            qi = ctx.offsets.get(self.q, 0) + xp.arange(x.shape[names.index(self.q)])
            ki = ctx.offsets.get(self.k, 0) + xp.arange(x.shape[names.index(self.k)])
            qi = align(xp, qi, (self.q,), names) + self.offset
            ki = align(xp, ki, (self.k,), names)
            keep = ki <= qi
            if self.kind_ == "window":
                keep = keep & (ki > qi - self.width)
        return (xp.where(keep, x, fill),)

    def vjp(self, ad, ins, outs, xs, y, ct):
        # the same mask on the cotangent, filling 0: a masked entry is a constant
        keep = Mask(self.kind_, self.q, self.k, self.width, self.offset, fill=0.0)
        g = ad.ops.apply(keep, ct, *xs[1:])[0]
        return (ad.to(g, ins[0]) if ad.floating(ins[0]) else None, *([None] * len(xs[1:])))

    def label(self):
        if self.kind_ == "causal":
            return "causal"
        if self.kind_ == "window":
            return f"window({self.width})"
        return "pad"


@dataclass(frozen=True)
class Cast(Spec):
    dtype: str
    kind: ClassVar[str] = "cast"
    elementwise = True
    colour = "#dcefd2"

    def absorbs(self, tag, port, ins, axis, key=None):
        return tag

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    def infer(self, ins):
        self.check_arity(ins)
        return (ins[0].with_dtype(self.dtype),)

    def evaluate(self, ctx, ins, outs, x):
        if ctx.exact and self.dtype in FLOATING and ins[0].dtype in FLOATING:
            return (x,)
        return (ctx.xp.astype(x, JNP_DTYPES[self.dtype]),)

    def flops(self, ins, outs):
        return sympy.Integer(0)

    def vjp(self, ad, ins, outs, xs, y, ct):
        return (ad.to(ct, ins[0]) if ad.floating(ins[0]) else None,)  # cast back

    def label(self):
        return f"cast({self.dtype})"


def roles(ins: tuple[ArrayType, ...], outs: tuple[ArrayType, ...]) -> dict:
    """Axis roles of a box, read off its types.

    Returns ``{"woven": [...], "reduced": [...], "broadcast": {input index: [...]}}``.
    """
    out_names = [n for o in outs for n in o.names]
    woven = list(dict.fromkeys(out_names))
    in_names = list(dict.fromkeys(n for t in ins for n in t.names))
    reduced = [n for n in in_names if n not in out_names]
    broadcast = {i: [n for n in woven if not t.has(n)] for i, t in enumerate(ins)}
    return {"woven": woven, "reduced": reduced,
            "broadcast": {i: b for i, b in broadcast.items() if b}}


@dataclass(frozen=True)
class Fill(Spec):
    """A constant array (no inputs): accumulators start from it."""
    value: float
    type: ArrayType
    kind: ClassVar[str] = "fill"
    colour = "#dcefd2"
    n_in: ClassVar[int] = 0

    def infer(self, ins):
        self.check_arity(ins)
        return (self.type,)

    def evaluate(self, ctx, ins, outs, *xs):
        shape = tuple(int(ctx.number(a.size)) for a in self.type.axes)
        dtype = JNP_DTYPES["f32" if self.type.dtype in ("bf16", "f16", "fp8") else self.type.dtype]
        value = sympy.sympify(self.value) if ctx.xp.symbolic else self.value
        if ctx.xp.symbolic and self.value == float("-inf"):
            value = -sympy.oo
        return (ctx.xp.full(shape, value, dtype),)

    def flops(self, ins, outs):
        return sympy.Integer(0)

    def vjp(self, ad, ins, outs, xs, y, ct):
        return ()

    def relabelled(self, axis, size):
        return Fill(self.value, self.type.resize(axis, size)) if self.type.has(axis) else self

    def unwoven(self, axis):
        return Fill(self.value, self.type.without(axis)) if self.type.has(axis) else self

    def label(self):
        return f"fill({self.value:g})"


# --------------------------------------------------------------------------- comparisons, select
COMPARE = {"lt": ("less", "<"), "le": ("less_equal", "<="), "gt": ("greater", ">"),
           "ge": ("greater_equal", ">="), "eq": ("equal", "=="), "ne": ("not_equal", "!=")}
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _number(value, what: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NapkinError(f"{what}: expected a Python number, got {value!r}")
    return value


@dataclass(frozen=True)
class Compare(Spec):
    """``a < b`` (``fn`` one of lt le gt ge eq ne) entry by entry, a boolean array; an input
    lacking an axis is broadcast.  With ``const`` (a number) the box has one input x and
    compares ``x fn const`` (a constant on the left is the flipped comparison: 2 < x is
    x > 2)."""
    fn: str
    const: float | None = None
    kind: ClassVar[str] = "compare"
    elementwise = True
    colour = "#f5d3d3"

    def __post_init__(self):
        if self.fn not in COMPARE:
            raise NapkinError(f"unknown comparison {self.fn!r}; known: {', '.join(COMPARE)}")
        if self.const is not None:
            object.__setattr__(self, "const", _number(self.const, COMPARE[self.fn][0]))

    @property
    def n_in(self):
        return 2 if self.const is None else 1

    @property
    def commutative(self):
        return self.fn in ("eq", "ne") and self.const is None

    @property
    def infix(self):
        return (COMPARE[self.fn][1], 0) if self.const is None else None

    def flipped(self) -> str:
        return _FLIPPED[self.fn]

    def infer(self, ins):
        self.check_arity(ins)
        seen = merge_axes(ins, COMPARE[self.fn][0])
        return (ArrayType(tuple(seen.values()), "bool"),)

    def evaluate(self, ctx, ins, outs, a, *rest):
        xp, names = ctx.xp, outs[0].names
        f = getattr(xp, COMPARE[self.fn][0])
        if self.const is not None:  # a Python number: weakly typed, as in JAX
            c = sympy.sympify(self.const) if xp.symbolic else self.const
            return (f(align(xp, a, ins[0].names, names), c),)
        return (f(align(xp, a, ins[0].names, names), align(xp, rest[0], ins[1].names, names)),)

    def vjp(self, ad, ins, outs, xs, y, ct):
        return (None,) * len(xs)  # a boolean result: piecewise constant

    def label(self):
        name = COMPARE[self.fn][0]
        return name if self.const is None else f"{name}({self.const:g})"


@dataclass(frozen=True)
class Where(Spec):
    """``where(cond, a, b)``: a where cond holds, else b, entry by entry; an input lacking
    an axis is broadcast.  ``a`` or ``b`` may be a constant (the fields; the box then has
    no input for it).  The result's dtype is promoted from a and b (a constant does not
    promote, as a Python number does not in JAX)."""
    a: float | None = None
    b: float | None = None
    kind: ClassVar[str] = "where"
    elementwise = True
    colour = "#f5d3d3"

    def __post_init__(self):
        for f in ("a", "b"):
            v = getattr(self, f)
            if v is not None:
                object.__setattr__(self, f, _number(v, "where"))

    @property
    def n_in(self):
        return 1 + (self.a is None) + (self.b is None)

    def infer(self, ins):
        self.check_arity(ins)
        if ins[0].dtype != "bool":
            raise NapkinError(f"where: the condition {ins[0]} has dtype {ins[0].dtype}, not bool "
                              f"(compare first: ops.less, ops.greater, ...)")
        seen = merge_axes(ins, "where")
        values = [t.dtype for t in ins[1:]]
        dtype = promote(values) if values else "f32"
        if dtype not in FLOATING and any(isinstance(c, float) for c in (self.a, self.b)):
            dtype = "f32"  # a float constant beside integers: a float result, as in JAX
        return (ArrayType(tuple(seen.values()), dtype),)

    def evaluate(self, ctx, ins, outs, cond, *rest):
        xp, names = ctx.xp, outs[0].names
        it = iter(zip(ins[1:], rest))
        branches = []
        for const in (self.a, self.b):
            if const is None:
                t, v = next(it)
                branches.append(align(xp, v, t.names, names))
            else:  # a Python number: weakly typed, as in JAX
                branches.append(sympy.sympify(const) if xp.symbolic else const)
        return (xp.where(align(xp, cond, ins[0].names, names), *branches),)

    def vjp(self, ad, ins, outs, xs, y, ct):
        grads, arrays = [None], iter(ins[1:])  # the condition: piecewise constant
        for const, side in ((self.a, Where(None, 0.0)), (self.b, Where(0.0, None))):
            if const is None:  # an array branch gets ct where it was picked, else 0
                t = next(arrays)
                g = ad.ops.apply(side, xs[0], ct)[0]
                grads.append(ad.to(g, t) if ad.floating(t) else None)
        return tuple(grads)

    def label(self):
        show = lambda v: "·" if v is None else f"{v:g}"  # noqa: E731
        return "where" if self.a is None and self.b is None else \
            f"where(·, {show(self.a)}, {show(self.b)})"


# --------------------------------------------------------------------------- positions, take
@dataclass(frozen=True)
class Positions(Spec):
    """The global index of every position along ``axis`` (iota; no inputs): inside a group
    or a stream chunk the piece's start (``EvalContext.offsets``) is added, so the values
    are right in every tile, as a mask's indices are.  ``size`` is the axis' size (the
    box knows its extent); ``dtype`` its output's (integers are exact in f32 up to 2²⁴)."""
    axis: str
    size: Any
    dtype: str = "f32"
    kind: ClassVar[str] = "positions"
    n_in: ClassVar[int] = 0
    colour = "#dcefd2"

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "size", Axis(self.axis, self.size).size)

    def infer(self, ins):
        self.check_arity(ins)
        return (ArrayType((Axis(self.axis, self.size),), self.dtype),)

    def evaluate(self, ctx, ins, outs, *xs):
        xp = ctx.xp
        n = ctx.number(self.size)
        if n != int(n):
            raise NapkinError(f"positions_{self.axis}: size {self.size} = {n:g} is not an integer")
        i = xp.arange(int(n))
        start = ctx.offsets.get(self.axis, 0)
        if not (isinstance(start, int) and start == 0):
            i = i + start
        dtype = "f32" if self.dtype in ("bf16", "f16", "fp8") else self.dtype
        return (xp.astype(i, JNP_DTYPES[dtype]),)

    def flops(self, ins, outs):
        return sympy.Integer(0)

    def vjp(self, ad, ins, outs, xs, y, ct):
        return ()

    def relabelled(self, axis, size):
        return Positions(self.axis, size, self.dtype) if axis == self.axis else self

    def label(self):
        return f"positions_{self.axis}"


@dataclass(frozen=True)
class TakeAlong(Spec):
    """``take_along_axis``: out[…] = x[…, index[…], …] — x (input 0) without ``axis``, at the
    position an integer ``index`` (input 1) names.  The index's axes are any but ``axis``:
    those x has are matched entry by entry, those it lacks are new axes of the result
    (``table[:, bucket]``, a T5 bias: table[h, b], bucket[q, x] -> [h, q, x]), after x's.
    Meaning: Σ over ``axis`` of x where the GLOBAL position equals the index, else
    0 — exact, streamable with the sum accumulator (a chunk contributes only where the
    index falls in it, the chunk's offset added as for masks), 0 its neutral element, and
    written in a kernel without a gather (a compare, a select, a sum).  An index outside
    [0, |axis|) picks 0."""
    axis: str
    kind: ClassVar[str] = "take"
    n_in: ClassVar[int] = 2
    colour = "#fbe0c4"

    def neutral(self, axis):
        return 0.0 if axis == self.axis else None

    def absorbs(self, tag, port, ins, axis, key=None):
        if port != 0:
            return None
        if axis == self.axis:
            return "ABSORBED" if tag == "ZERO" else None  # a masked fill could be picked
        return tag  # woven over the masked axis: picks entry by entry

    def infer(self, ins):
        self.check_arity(ins)
        x, index = ins
        if not x.has(self.axis):
            raise NapkinError(f"take_along_axis: the array {x} has no axis {self.axis}")
        if index.dtype not in INTEGER:
            raise NapkinError(f"take_along_axis: the index {index} has dtype {index.dtype}; an "
                              f"index is an integer array ({' or '.join(INTEGER)})")
        if index.has(self.axis):
            raise NapkinError(f"take_along_axis: the index {index} has axis {self.axis}, the "
                              f"axis it takes along (its axes are any others)")
        axes = merge_axes(ins, "take_along_axis")
        extra = tuple(axes[n] for n in index.names if not x.has(n))
        rest = x.without(self.axis)
        return (ArrayType(rest.axes + extra, x.dtype),)

    def evaluate(self, ctx, ins, outs, x, index):
        xp, names = ctx.xp, ins[0].names
        full = names + tuple(n for n in ins[1].names if n not in names)
        i = names.index(self.axis)
        pos = xp.arange(x.shape[i])
        start = ctx.offsets.get(self.axis, 0)
        if not (isinstance(start, int) and start == 0):
            pos = pos + start
        pos = align(xp, pos, (self.axis,), full)
        hit = xp.equal(pos, align(xp, index, ins[1].names, full))
        return (xp.sum(xp.where(hit, align(xp, x, names, full), xp.const(0, x)), i),)

    def flops(self, ins, outs):
        # a compare-select and an add per entry of x, per entry of the index's new axes
        return outs[0].numel * ins[0].axis(self.axis).size

    def vjp(self, ad, ins, outs, xs, y, ct):
        # a scatter as a select: ct lands where the position equals the index
        o, (x, index), t = ad.ops, xs, ins[0]
        hit = o.equal(o.positions(t.axis(self.axis), dtype=index.type.dtype), index)
        return (ad.to(o.where(hit, ct, 0.0), t) if ad.floating(t) else None, None)

    def label(self):
        return f"take_{self.axis}"
