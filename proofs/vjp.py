"""The primitives' reverse derivatives: for every primitive f and every cotangent c of its
output, the boxes its ``vjp`` builds (napkin.frontend.grad) compute c·∂f/∂xᵢ for every
floating input xᵢ.

Argument.  A primitive acts entry by entry (maps, zips, masks, casts, selects), along one
axis (reductions, softmax), or as a sum of products over named axes (contract, take): an
entry of its derivative reads the entries that share its indices, or its row.  Sizes of 2
and 3 per axis therefore show every pattern of coinciding and distinct indices (a
broadcast input, an axis only one operand has, a row of several entries), so the symbolic
check at these sizes — sympy differentiates the primitive's own symbolic meaning (the
SYMPY backend: the definitions the kernels use) and the difference to the vjp's boxes is
decided 0 entry by entry — carries to every size.  Non-smooth primitives (max, min, abs,
relu, the selects and comparisons) are checked in float64 against ``jax.vjp`` of the
primitive's JAX meaning, off their kinks and at ties (JAX's convention: a tie splits the
cotangent); every primitive is checked so, and a wrong derivative (a sign, a missing term)
fails both (:func:`prove_wrong`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
import sympy

from proofs._core import Failed, Proof, ProofResult, compare, sym_ctx, sym_inputs

MODULE = "proofs.vjp"
SIZES = {"a": 2, "b": 3}


@dataclass(frozen=True)
class Case:
    """One primitive in one configuration: ``build(ops, A, B)`` records its box on inputs
    declared by ``inputs`` ({name: (axis names, dtype)}); ``smooth``: checked symbolically
    too; ``ties``: the numeric inputs also repeat entries (max, min at a tie)."""
    name: str
    inputs: dict
    build: Callable
    smooth: bool = True
    ties: bool = False
    positive: bool = False


def _cases() -> list[Case]:
    f = "f64"
    A, AB, BA, B = (("a",), f), (("a", "b"), f), (("b", "a"), f), (("b",), f)
    c = []
    for fn in ("exp", "log", "tanh", "neg", "sigmoid", "square", "sqrt", "rsqrt", "recip",
               "silu", "id", "gelu", "gelu_tanh", "erf"):
        c.append(Case(f"map {fn}", {"x": AB}, lambda o, x, fn=fn: o.apply(_map(fn), x)[0],
                      positive=fn in ("log", "sqrt", "rsqrt")))
    for fn, p in (("scale", sympy.Rational(3, 7)), ("add_const", 2.5), ("softcap", 5.0),
                  ("pow", 3)):
        c.append(Case(f"map {fn}({p})", {"x": AB},
                      lambda o, x, fn=fn, p=p: o.apply(_map(fn, p), x)[0]))
    for fn in ("relu", "abs", "finite_or_zero"):
        c.append(Case(f"map {fn}", {"x": AB}, lambda o, x, fn=fn: o.apply(_map(fn), x)[0],
                      smooth=False))
    for fn in ("max_const", "min_const"):
        c.append(Case(f"map {fn}(0.25)", {"x": AB},
                      lambda o, x, fn=fn: o.apply(_map(fn, 0.25), x)[0], smooth=False,
                      ties=True))
    for fn in ("add", "sub", "mul", "div"):
        c.append(Case(f"zip {fn} (b broadcast over a)", {"x": AB, "y": B},
                      lambda o, x, y, fn=fn: getattr(o, fn)(x, y)))
        c.append(Case(f"zip {fn} (transposed operands)", {"x": AB, "y": BA},
                      lambda o, x, y, fn=fn: getattr(o, fn)(x, y)))
    for fn in ("maximum", "minimum"):
        c.append(Case(f"zip {fn}", {"x": AB, "y": B}, lambda o, x, y, fn=fn: getattr(o, fn)(x, y),
                      smooth=False, ties=True))
    c.append(Case("zip guard", {"x": AB, "m": B}, lambda o, x, m: o.guard(x, m), smooth=False))
    c += [
        Case("contract a,b -> b (a summed)", {"x": AB, "y": AB},
             lambda o, x, y: o.contract(x, y, out="b")),
        Case("contract ab,b -> a", {"x": AB, "y": B}, lambda o, x, y: o.contract(x, y, out="a")),
        Case("contract a,b -> ab (outer)", {"x": A, "y": B},
             lambda o, x, y: o.contract(x, y, out="a b")),
        Case("contract ab -> ba (transpose)", {"x": AB}, lambda o, x: o.contract(x, out="b a")),
        Case("contract a -> () (an axis one operand has)", {"x": A, "y": B},
             lambda o, x, y: o.contract(x, y, out="b")),
        Case("contract x·x -> a (one value on two ports)", {"x": AB},
             lambda o, x: o.contract(x, x, out="a")),
    ]
    for fn in ("sum", "mean", "logsumexp"):
        c.append(Case(f"reduce {fn} over b", {"x": AB},
                      lambda o, x, fn=fn: getattr(o, fn if fn != "sum" else "sum_")(x, "b")))
    c.append(Case("reduce max over b", {"x": AB}, lambda o, x: o.max_(x, "b"), smooth=False,
                  ties=True))
    c += [
        Case("softmax over b", {"x": AB}, lambda o, x: o.softmax(x, "b")),
        Case("softmax over b with a sink [a]", {"x": AB, "s": A},
             lambda o, x, s: o.softmax(x, "b", sink=s)),
        Case("causal mask", {"x": AB}, lambda o, x: o.causal_mask(x, "a", "b")),
        Case("window mask", {"x": AB}, lambda o, x: o.window_mask(x, "a", "b", 2)),
        Case("padding mask", {"x": AB, "v": B}, lambda o, x, v: o.padding_mask(x, v),
             smooth=False),
        Case("cast f32 -> f64", {"x": (("a", "b"), "f32")}, lambda o, x: o.cast(x, "f64"),
             smooth=False),
        Case("where(x > y, x, 1.5)", {"x": AB, "y": B},
             lambda o, x, y: o.where(o.greater(x, y), x, 1.5), smooth=False),
        Case("where(x > 0, y, x)", {"x": AB, "y": B},
             lambda o, x, y: o.where(o.greater(x, 0.0), y, x), smooth=False),
        Case("take_along_axis b", {"x": AB, "i": (("a",), "int32")},
             lambda o, x, i: o.take_along_axis(x, i, "b"), smooth=False),
    ]
    return c


def _map(fn, p=None):
    from napkin.core.primitives import Map
    return Map(fn, p)


def _diagram(case: Case, spec_swap=None):
    """The case's one-box diagram (``spec_swap(spec) -> spec``: a wrong derivative in its
    place, for :func:`prove_wrong`)."""
    import napkin as nk
    from napkin.frontend import ops
    ax = {n: nk.Axis(n, sympy.Symbol(n, integer=True, positive=True)) for n in SIZES}
    inputs = [(k, nk.Array(*(ax[n] for n in names), dtype=dt))
              for k, (names, dt) in case.inputs.items()]
    d = nk.trace(lambda *xs: case.build(ops, *xs), inputs, name=case.name)
    if spec_swap is None:
        return d
    return nk.trace(lambda *xs: _replay_swapped(d, xs, spec_swap), inputs, name=case.name)


def _replay_swapped(d, xs, spec_swap):
    from napkin.core.ir import ops as op_order, view
    from napkin.frontend import ops
    g = view(d)
    value = dict(zip(g.graph["inputs"], xs))
    for n in op_order(g):
        node = g.nodes[n]
        spec = spec_swap(node["box"].spec)
        value.update(zip(node["outs"], ops.apply(spec, *[value[v] for v in node["ins"]])))
    return [value[v] for v in g.graph["outputs"]]


def _floating(d) -> list[int]:
    from napkin.core.arrays import array_types
    from napkin.core.primitives import FLOATING
    return [i for i, t in enumerate(array_types(d.dom)) if t.dtype in FLOATING]


def _symbolic(d) -> str:
    """The vjp's boxes against sympy's derivative of the symbolic meaning, entry by entry."""
    from napkin.core.semantics import run
    from napkin.frontend.grad import grad
    from proofs._core import symbols
    ctx = sym_ctx(SIZES)
    xs = sym_inputs(d, SIZES)
    ys = run(d, ctx, *xs)
    cts = [symbols(f"ct{k}", np.shape(y)) for k, y in enumerate(ys)]
    got = run(grad(d), ctx, *xs, *cts)
    want = []
    for i in _floating(d):
        w = np.empty(np.shape(xs[i]), dtype=object)
        for idx in np.ndindex(*w.shape):
            w[idx] = sympy.Add(*[ct[j] * sympy.diff(sympy.sympify(y[j]), xs[i][idx])
                                 for y, ct in zip(ys, cts) for j in np.ndindex(*np.shape(y))])
        want.append(w)
    return compare(list(got), want, SIZES)


def _numeric(d, case: Case, seed: int = 0) -> str:
    import jax
    from napkin.core.semantics import evaluate
    from napkin.frontend.grad import grad
    from proofs._core import sample
    rng = np.random.default_rng(seed)
    sizes = {"a": 3, "b": 4}
    kinds = {k: ("positive" if case.positive else "normal") for k in case.inputs}
    kinds.update({k: "index:b" for k, (_, dt) in case.inputs.items() if dt == "int32"})
    worst = 0.0
    with jax.enable_x64(True):
        for trial in range(3):
            xs = sample(d, sizes, rng, kinds=kinds, dtype=np.float64)
            if case.ties and trial:  # repeat entries: ties inside a row and with constants
                xs = [np.round(x * 2) / 4 if x.dtype.kind == "f" else x for x in xs]
            f = evaluate(d, sizes)
            fl = _floating(d)

            def of_floats(*fx, xs=xs):
                a = list(xs)
                for i, v in zip(fl, fx):
                    a[i] = v
                return f(*a)
            y, vjp = jax.vjp(of_floats, *[xs[i] for i in fl])
            ct = rng.standard_normal(np.shape(y))
            want = vjp(np.asarray(ct, np.asarray(y).dtype))
            got = evaluate(grad(d), sizes)(*xs, ct)
            got = got if isinstance(got, tuple) else (got,)
            for g, w in zip(got, want):
                g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
                if g.shape != w.shape:
                    raise Failed(f"shape {g.shape} against jax.vjp's {w.shape}")
                scale = max(float(np.max(np.abs(w))), 1e-300)
                worst = max(worst, float(np.max(np.abs(g - w))) / scale)
    tol = 1e-6 if any(dt == "f32" for _, dt in case.inputs.values()) else 1e-12
    if not worst <= tol:
        raise Failed(f"relative error {worst:.2e} against jax.vjp (tolerance {tol:g})")
    return f"3 random points (and ties where it has them), relative error {worst:.1e}"


def prove_case(case: Case, spec_swap=None, rule: str | None = None) -> ProofResult:
    proof = Proof(rule or f"vjp {case.name}", MODULE, __doc__)
    d = _diagram(case, spec_swap)
    if case.smooth:
        proof.check(f"the vjp of {case.name} is sympy's derivative (sizes {SIZES})",
                    lambda: _symbolic(d), "symbolic")
    proof.check(f"the vjp of {case.name} is jax.vjp's in float64", lambda: _numeric(d, case),
                "numeric")
    return proof.result()


def prove() -> ProofResult:
    """Every case's obligations, as one result (``proofs.prove_derivatives`` lists them by
    primitive)."""
    proof = Proof("vjp", MODULE, __doc__)
    for case in _cases():
        proof.obligations += prove_case(case).obligations
    return proof.result()


def prove_each() -> list[ProofResult]:
    return [prove_case(c) for c in _cases()] + [prove_saved()]


SAVED = ("attention", "causal_attention", "gqa", "softcap_attention", "cross_entropy",
         "linear_cross_entropy")


def _from_saved(name: str, wrong: bool = False) -> str:
    """``grad(d, residuals=True)`` on what ``residuals(d)`` saves against ``grad(d)``,
    entry by entry on symbolic inputs (``wrong``: L saved without the row maximum's share
    — the logsumexp of the scores shifted by one)."""
    from napkin.core.semantics import run
    from napkin.frontend.grad import grad, residuals
    from proofs._core import library, symbols
    d = library(name)
    sizes = {"q": 2, "x": 2, "d": 2, "k": 1, "r": 2, "n": 2, "v": 2}
    ctx, xs = sym_ctx(sizes), sym_inputs(d, sizes)
    saved = list(run(residuals(d), ctx, *xs))
    if wrong:
        saved[1] = saved[1] - 1
    cts = [symbols(f"ct{k}", np.shape(y)) for k, y in enumerate(saved[:len(d.cod)])]
    return compare(list(run(grad(d, residuals=True), ctx, *xs, *saved, *cts)),
                   list(run(grad(d), ctx, *xs, *cts)), sizes)


def prove_saved(wrong: bool = False) -> ProofResult:
    """The backward from the saved residuals is the backward: a softmax replayed as
    exp(S − L) from the saved L, and its row term Σ_x dP ⊙ P read as Σ dO ⊙ O — the
    adjoint of the contraction O = P·V, in which P enters linearly and once — equal
    napkin.grad's own cotangents, symbolically, for attention, causal attention, GQA,
    soft-capped attention and the cross-entropies (a logsumexp read from its saved value);
    in float64 for attention and attention with a sink (whose L
    holds the sink's logit and whose sink probability is exp(s − L))."""
    rule = "wrong vjp: L saved off by one" if wrong else "vjp from saved residuals (L, O)"
    proof = Proof(rule, MODULE, prove_saved.__doc__)
    for name in SAVED[:1] if wrong else SAVED:
        proof.check(f"{name}: the cotangents from L and O are napkin.grad's (sizes of 2)",
                    lambda name=name: _from_saved(name, wrong), "symbolic")
    for name in ("attention", "sink_attention"):
        proof.check(f"{name} in float64 (JAX): the cotangents from L and O are napkin.grad's",
                    lambda name=name: _numeric_saved(name, wrong), "numeric")
    return proof.result()


def _numeric_saved(name: str, wrong: bool) -> str:
    """``grad(d, residuals=True)`` on what ``residuals(d)`` saves against ``grad(d)`` in
    float64 at random inputs (a sink attention's too: at the sizes of 2 its L — a
    log-add-exp shifted by the larger of two terms — and the softmax's own shift are
    different Max atoms, which sympy's canonical forms do not cancel)."""
    import jax
    from napkin.core.semantics import evaluate
    from napkin.frontend.grad import grad, residuals
    from napkin.frontend.library import LIBRARY
    from proofs._core import library
    d = library(name)
    sizes = {"h": 2, "q": 5, "x": 7, "d": 3}
    rng = np.random.default_rng(3)
    err = 0.0
    with jax.enable_x64(True):
        for scale in (1.0, 30.0):  # (30: logits and sinks far apart, either side larger)
            xs = [np.asarray(a, np.float64) * scale
                  for a in LIBRARY[name].sample(rng, {k: sizes[k] for k in sizes})]
            saved = list(evaluate(residuals(d), sizes)(*xs))
            if wrong:
                saved[1] = saved[1] - 1
            ct = rng.standard_normal(np.shape(saved[0]))
            a = evaluate(grad(d, residuals=True), sizes)(*xs, *saved, ct)
            b = evaluate(grad(d), sizes)(*xs, ct)
            # (of the largest cotangent: at scale 30 a row's dsink is 0 in one, 1e-100 in
            # the other — both exp(−230) rounded)
            top = max(float(np.max(np.abs(v))) for v in b)
            err = max([err] + [float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) / top
                               for u, v in zip(a, b)])
    if not err <= 1e-12:
        raise Failed(f"relative error {err:.2e}")
    return f"relative error {err:.1e}"


# --------------------------------------------------------------------------- wrong variants
def _wrong(kind: str, fn: Callable):
    """``spec_swap`` giving specs of ``kind`` the derivative ``fn`` instead of their own."""
    def swap(spec):
        if spec.kind != kind:
            return spec
        cls = type(f"Wrong{type(spec).__name__}", (type(spec),), {"vjp": fn})
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})
    return swap


def _tanh_plus(self, ad, ins, outs, xs, y, ct):  # 1 + y² for 1 − y²
    return (ct * (1.0 + y * y),)


def _softmax_no_row(self, ad, ins, outs, xs, y, ct):  # P ⊙ ct, the row term forgotten
    return (y * ct,)


def _sub_same_sign(self, ad, ins, outs, xs, y, ct):  # −ct on b forgotten
    return (ad.to(ct, ins[0]), ad.to(ct, ins[1]))


def _contract_no_broadcast_sum(self, ad, ins, outs, xs, y, ct):  # the other operand ignored
    return tuple(ad.to(ct, t) for t in ins)


def _sink_plus(self, ad, ins, outs, xs, y, ct):  # the sink's minus sign forgotten
    o = ad.ops
    r = o.sum_(ct * y, self.axis)
    return (ad.to(y * (ct - r), ins[0]), ad.to((1.0 - o.sum_(y, self.axis)) * r, ins[1]))


def _max_every_tie(self, ad, ins, outs, xs, y, ct):  # each maximum takes all of ct
    o, (x,) = ad.ops, xs
    return (ad.to(o.where(o.equal(x, y), ct, 0.0), ins[0]),)


WRONG = {
    "tanh′ = 1 + tanh²": ("map tanh", _wrong("map", _tanh_plus)),
    "softmax′ without the row term": ("softmax over b", _wrong("softmax", _softmax_no_row)),
    "a − b with +ct for b": ("zip sub (b broadcast over a)", _wrong("zip", _sub_same_sign)),
    "contract′ without the other operand": ("contract ab,b -> a",
                                            _wrong("contract", _contract_no_broadcast_sum)),
    "a sink's cotangent without its sign": ("softmax over b with a sink [a]",
                                            _wrong("softmax", _sink_plus)),
    "max′ with every tie taking all of ct": ("reduce max over b",
                                             _wrong("reduce", _max_every_tie)),
}


def prove_wrong() -> list[ProofResult]:
    """The wrong derivatives, through the same checks: every result must be not ok."""
    cases = {c.name: c for c in _cases()}
    return [prove_case(cases[case], swap, f"wrong vjp: {name}")
            for name, (case, swap) in WRONG.items()] + [prove_saved(wrong=True)]
