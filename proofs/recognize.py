"""Recognition: every entry of rewrites.recognize.TABLE rewrites its hand-written form
into a primitive that computes the same function.

Statement.  Let a host program contain a match of an entry's pattern
(:mod:`napkin.core.match`: the pattern's ops, at any axis names, woven over any
extra axes, interior values read only inside the match).  Replacing the match
by the entry's right-hand side leaves the program's function unchanged over
the reals, for every size of every axis — on every row that keeps an entry
for the softmax entries (below: what "keeps" means, and what a row that keeps
none becomes).  The identities, for one row x_1 … x_n of any length n ≥ 1
(m any real number constant along the row; Z ≠ 0; s a sink logit):

* softmax: exp(x_i − m) / Σ_j exp(x_j − m) = exp(x_i) / Σ_j exp(x_j) —
  multiply numerator and denominator by exp(m) (distributivity over a sum
  of n terms); with m = max x this is the shifted form, m = 0 the unshifted;
* softmax·contraction: (Σ_i p_i v_i) / Z = Σ_i (p_i / Z) v_i — Z lacks the
  summed axis (distributivity), then the softmax identity;
* sink: exp(x_i − m) / (Σ_j exp(x_j − m) + exp(s − m)) =
  exp(x_i) / (Σ_j exp(x_j) + exp(s)) — the same factor exp(m), with
  m = max(max x, s) or 0; and with the contraction as above;
* logsumexp: log Σ_j exp(x_j − m) + m = log(exp(m) · Σ_j exp(x_j − m)) =
  log Σ_j exp(x_j), with m = max x or m = 0;
* mean: (Σ_j x_j) · (1/n) = mean x, and Σ_j (x_j · 1/n) = (Σ_j x_j)/n;
* square: x · x = x²;
* RMSNorm: (x / √r) · g = (x · g) · r^(−1/2) for r > 0 (commutativity and
  associativity of the product), r = mean x² (+ ε).

Proof.  Each identity is term-wise in n, so it holds for every length of the
reduced axis; an extra axis is woven by every matched op (a premise the
matcher checks: it is never reduced, and a value carries a bound axis exactly
where the pattern's value does), so both sides apply the identity
independently at each index of the extra axes; axis names are labels.  What
remains is that the rule builds exactly these right-hand sides on the host's
arrays, and that its premises keep it to genuine instances: the symbolic
obligations apply the real rule (``rewrites.recognize``, proposed by its own
``candidates``) to instances of every entry — the pattern's axis names and
others, extra axes before and after the reduced one, reduced lengths 1 to 3;
every written variant of an entry (RMSNorm has 24) at lengths 1 and 2 —
evaluate both sides with the SYMPY backend on symbolic entries, through the
very primitive definitions the kernels use, and reduce their difference to 0
(exp of both sides where a log is involved: exp is injective on the reals).
The premise obligations check that the rule refuses, naming the premise,
hosts that are not instances: the max over one axis and the sum over another;
a subtracted max of another array; a logsumexp without the + m; a mean scaled
by another axis's length; an interior value read outside the match, or an
output of the program; a contraction that also sums an extra axis.  And the
obligations are not vacuous: :func:`prove_wrong` runs plausible wrong entries
(the max over one axis and the sum over another, a logsumexp without the + m,
a mean by the wrong axis's length, a softmax shifted by the max of another
array along another axis) through the same checks, and each fails with a
counterexample.  (A softmax shifted by the max of another array along the same
axis is no wrong identity — any shift constant along the axis cancels — but
the premise refuses it: only the same array's max makes the hand-written form
compute what the primitive does in floating point.)

Floating point, and rows that keep no entry (checked numerically, JAX,
float64): on random inputs of ragged sizes, and on logits of ±1e4 for the
shifted forms, both sides agree to rounding; at logits of ±1000 the unshifted
hand-written forms overflow (non-finite) while their primitives — the shifted,
numerically safe form of the same function — agree with the shifted
hand-written form.  The softmax primitives define a row whose entries are all
at or below the mask threshold (−5e29: −∞, or the mask's fill) as zeros
(napkin.core.primitives.MASKED), as the streamed softmax-contraction accumulator
computes it; the hand-written form gives NaN for a row of −∞ and the average
over the masked entries for a row of the fill.  That is the one place the
rewrite changes values, by the library's convention, and it is checked as
such: every other row equal, those rows zero (a sink that is finite keeps its
row: the sink takes the mass, and the two sides agree).  A logsumexp of a row
of −∞ is −∞ (the hand-written form: NaN, −∞ − (−∞)).  The right-hand sides at
bfloat16 stay within 2e-2 of the float64 meaning.
"""
from __future__ import annotations

import math

import numpy as np
import sympy

from proofs._core import Failed, Proof, compare, numeric, refuses, sym_ctx, sym_inputs

RULE = "recognize"
EPS = 1e-6
CONSTS = {"eps": EPS, "c": 0.5}  # each constant variable's value in the numeric checks

# Instances of each entry: {input: host axes} and {axis variable: host axis}.  The first
# uses the pattern's own names with an extra axis; the second other names, extra axes on
# both sides of the reduced one, and on the other inputs.
INSTANCES = {
    "softmax": [({"X": "n v"}, {"v": "v"}), ({"X": "h x q"}, {"v": "x"})],
    "softmax_contraction": [({"S": "q x", "V": "x d"}, {"x": "x"}),
                            ({"S": "h k q", "V": "h k e"}, {"x": "k"})],
    "sink_softmax": [({"X": "n v", "s": "n"}, {"v": "v"}), ({"X": "h x q", "s": "h"}, {"v": "x"})],
    "sink_attention": [({"S": "q x", "V": "x d", "s": ""}, {"x": "x"}),
                       ({"S": "h q k", "V": "h k e", "s": "h"}, {"x": "k"})],
    "sink_attention_const": [({"S": "q x", "V": "x d"}, {"x": "x"}),
                             ({"S": "h q k", "V": "h k e"}, {"x": "k"})],
    "logsumexp": [({"X": "n v"}, {"v": "v"}), ({"X": "h x q"}, {"v": "x"})],
    "mean": [({"X": "n v"}, {"v": "v"}), ({"X": "x h"}, {"v": "x"})],
    "square": [({"X": "n v"}, {}), ({"X": "h x q"}, {})],
    "rmsnorm": [({"X": "n v", "G": "v"}, {"v": "v"}), ({"X": "b d n", "G": "n d"}, {"v": "d"})],
}
for _base in ("softmax", "softmax_contraction", "sink_softmax", "sink_attention", "logsumexp"):
    INSTANCES[f"{_base}_unshifted"] = INSTANCES[_base]
INSTANCES["mean_prescaled"] = INSTANCES["mean"]

SOFTMAXES = ("softmax", "softmax_unshifted", "softmax_contraction",
             "softmax_contraction_unshifted")
SINKS = ("sink_softmax", "sink_softmax_unshifted", "sink_attention", "sink_attention_unshifted")
UNSHIFTED = tuple(n for n in (*SOFTMAXES, *SINKS, "logsumexp_unshifted") if "unshifted" in n)
SHIFTED = ("softmax", "softmax_contraction", "sink_softmax", "sink_attention", "logsumexp",
           "sink_attention_const")
CONST_SINKS = ("sink_attention_const",)  # a finite constant sink: every row keeps it


def reduced_axis(entry, var_map) -> str | None:
    """The host axis of the pattern's first axis variable (its reduced axis): the one whose
    length the checks vary."""
    return next(iter(var_map.values()), None)


def instance(entry, inputs: dict, var_map: dict, sizes: dict | None = None, dtype="f64",
             eps=None, variant: int = 0):
    """The entry's hand-written form (its ``variant``-th) as a program of its own: inputs
    with these host axes (symbolic sizes, or ints from ``sizes``), the pattern's axis
    variables named by ``var_map``, its constants ``eps`` (a value or a symbol for every
    constant variable; default :data:`CONSTS`)."""
    from napkin.core.arrays import Axis
    from napkin.frontend.trace import Array, trace
    sizes = sizes or {}
    ax = {}
    for names in inputs.values():
        for n in names.split():
            ax.setdefault(n, Axis(n, sizes.get(n, n)))
    kwargs = {var: ax[host] for var, host in var_map.items()}
    for c in entry.consts:
        kwargs[c] = CONSTS[c] if eps is None else eps
    spec = [(name, Array(*(ax[n] for n in inputs[name].split()), dtype=dtype))
            for name in entry.inputs]
    lhs = entry.variants[variant]
    return trace(lambda *xs: lhs(*xs, **kwargs), spec, f"hand-written {entry.name}")


def recognized(rule, entry, D):
    """The real rule at its own proposal for the whole of ``D`` (which must be one match of
    ``entry``): the rewritten program."""
    from napkin.core.ir import view
    from napkin.core.region import Site
    props = rule.proposals(view(D))
    n_ops = len([b for b in D.boxes if getattr(b, "spec", None) is not None])
    whole = tuple(range(n_ops))
    hits = [ops_ for ops_, name in props if name == entry.name and ops_ == whole]
    if not hits:
        raise Failed(f"the rule does not propose {entry.name} over the whole instance "
                     f"(it proposes {[(name, list(o)) for o, name in props]})")
    return rule.apply(D, Site((), whole), {"pattern": entry.name})


def _sym_sizes(inputs, n_red, red):
    return {a: (n_red if a == red else 2) for names in inputs.values() for a in names.split()}


def symbolic(rule, entry, lengths=(1, 2, 3)) -> str:
    """lhs = rhs on symbolic entries for each instance and reduced length (every variant:
    the first at every instance, the others at the first, lengths up to 2)."""
    from napkin.core.semantics import run
    done = []
    cases = [(0, inputs, var_map, lengths) for inputs, var_map in INSTANCES.get(entry.name, ())]
    cases += [(k, *INSTANCES[entry.name][0], lengths[:2]) for k in range(1, len(entry.variants))]
    for k, inputs, var_map, ns in cases:
        eps = sympy.Symbol("epsilon", positive=True)
        D = instance(entry, inputs, var_map, eps=eps, variant=k)
        R = recognized(rule, entry, D)
        if R.dom != D.dom or R.cod != D.cod:
            raise Failed(f"the rewritten program has type {R.dom} -> {R.cod}, "
                         f"not {D.dom} -> {D.cod}")
        red = reduced_axis(entry, var_map)
        for n in ns if red else (1,):
            sz = _sym_sizes(inputs, n, red)
            ctx, xs = sym_ctx(sz), sym_inputs(D, sz)
            try:
                compare(run(R, ctx, *xs), run(D, ctx, *xs), sz)
            except Failed as e:
                where = f" ({entry.variants[k].__name__})" if k else ""
                raise Failed(f"{_shape(inputs)}{where}, |{red}| = {n}: {e}") from None
        if not k:
            done.append(_shape(inputs))
    if not done:
        raise Failed(f"no instance of {entry.name} to check")
    more = f"; {len(entry.variants) - 1} more variants" if len(entry.variants) > 1 else ""
    return f"{'; '.join(done)}, reduced lengths {list(lengths)}{more}: equal"


def _shape(inputs) -> str:
    return ", ".join(f"{k}[{','.join(v.split())}]" for k, v in inputs.items())


def _num_sizes(inputs, red, n_red=7, other=3):
    return {a: (n_red if a == red else other) for names in inputs.values() for a in names.split()}


def _sample(D, sizes, rng, scale=1.0, positive=()):
    from proofs._core import sample
    kinds = {name: "positive" for name in positive}
    return sample(D, sizes, rng, scale=scale, kinds=kinds)


def numeric_random(rule, entry, rng) -> str:
    """float64, ragged sizes, both instances; shifted forms also at logits of ±1e4."""
    out = []
    cases = [(0, inputs, var_map) for inputs, var_map in INSTANCES[entry.name]]
    cases += [(k, *INSTANCES[entry.name][0]) for k in range(1, len(entry.variants))]
    for k, inputs, var_map in cases:
        D = instance(entry, inputs, var_map, variant=k)
        R = recognized(rule, entry, D)
        sz = _num_sizes(inputs, reduced_axis(entry, var_map))
        out.append(numeric(D, R, _sample(D, sz, rng), tol=1e-12, jit=False))
        if entry.name in SHIFTED:
            out.append("logits ±1e4: " + numeric(D, R, _sample(D, sz, rng, scale=1e4), tol=1e-12,
                                                     jit=False))
    worst = max(float(o.split("relative error ")[1].split()[0]) for o in out)
    return f"{len(cases)} programs ({len(entry.variants)} variants): worst relative error " \
           f"{worst:.1e} ≤ 1e-12"


def numeric_bf16(rule, entry, rng) -> str:
    from proofs._core import as_f64, bf16
    inputs, var_map = INSTANCES[entry.name][0]
    D = instance(entry, inputs, var_map)
    R16 = recognized(rule, entry, instance(entry, inputs, var_map, dtype="bf16"))
    xs = _sample(D, _num_sizes(inputs, reduced_axis(entry, var_map)), rng)
    x16 = bf16(xs)
    return numeric(D, R16, as_f64(x16), x16, tol=2e-2, jit=False)


def numeric_overflow(rule, entry, rng) -> str:
    """The unshifted hand-written form overflows at logits of ±1000, its primitive does not
    and equals the shifted hand-written form there."""
    import jax
    from napkin.core.semantics import evaluate
    from rewrites.recognize import TABLE
    shifted = next(e for e in TABLE if e.name == entry.name.replace("_unshifted", ""))
    inputs, var_map = INSTANCES[entry.name][0]
    D = instance(entry, inputs, var_map)
    R = recognized(rule, entry, D)
    sz = _num_sizes(inputs, reduced_axis(entry, var_map))
    xs = _sample(D, sz, rng, scale=1000.0)
    with jax.enable_x64(True):
        lhs = np.asarray(evaluate(D)(*xs))
    if np.isfinite(lhs).all():
        raise Failed("the unshifted hand-written form did not overflow at logits of ±1000")
    safe = numeric(instance(shifted, inputs, var_map), R, xs, tol=1e-12, jit=False)
    return (f"hand-written: {int((~np.isfinite(lhs)).sum())} of {lhs.size} entries non-finite; "
            f"primitive vs the shifted hand-written form: {safe}")


def masked_rows(rule, entry) -> str:
    """Rows that keep no entry: a row of −∞ and a row of the mask's fill become zeros (the
    hand-written form: NaN, and the average over the masked entries); every other row is
    the same.  With a finite sink those rows keep the sink: both sides agree."""
    import jax
    from napkin.core.primitives import MASK_FILL
    from napkin.core.semantics import evaluate
    inputs, var_map = INSTANCES[entry.name][0]
    D = instance(entry, inputs, var_map)
    R = recognized(rule, entry, D)
    sz = _num_sizes(inputs, reduced_axis(entry, var_map), other=4)
    rng = np.random.default_rng(7)
    xs = _sample(D, sz, rng)
    first = list(entry.inputs)[0]
    X = xs[0]
    X[0] = -math.inf
    X[1] = MASK_FILL
    sinks = entry.name in SINKS or entry.name in CONST_SINKS
    if entry.name in SINKS:  # a sink of −∞ on the rows of −∞: neither a score nor a sink
        s = xs[list(entry.inputs).index("s")]
        if s.ndim:
            s[0] = -math.inf
        else:
            xs[list(entry.inputs).index("s")] = np.asarray(0.5)
    with jax.enable_x64(True):
        lhs, rhs = np.asarray(evaluate(D)(*xs)), np.asarray(evaluate(R)(*xs))
    rest = slice(2, None)
    if not np.allclose(lhs[rest], rhs[rest], rtol=1e-12, atol=0):
        raise Failed("the rows that keep an entry differ")
    if sinks:
        if not np.allclose(lhs[1], rhs[1], rtol=1e-12, atol=1e-300):
            raise Failed("a row of the mask's fill with a finite sink differs (the sink takes "
                         "its mass on both sides)")
        if entry.name in CONST_SINKS:
            if not np.allclose(lhs[0], rhs[0], rtol=1e-12, atol=1e-300):
                raise Failed("a row of −∞ with a constant sink differs (the sink takes it all)")
            return (f"{first}: other rows equal; rows of −∞ and of the fill keep the constant "
                    f"sink on both sides ({float(np.abs(rhs[0]).max()):.1e}, "
                    f"{float(np.abs(rhs[1]).max()):.1e})")
        if s.ndim and not (rhs[0] == 0).all():
            raise Failed(f"a row of −∞ with a −∞ sink is {rhs[0]}, not zeros")
        mass = float(np.abs(rhs[1]).max())
        return (f"{first}: other rows equal; a fill row with a finite sink: both {mass:.1e} (the "
                f"sink's mass); a −∞ row with a −∞ sink: zeros (hand-written: "
                f"{lhs[0].ravel()[0]})")
    if not (rhs[0] == 0).all() or not (rhs[1] == 0).all():
        raise Failed(f"rows that keep no entry are {rhs[0]}, {rhs[1]}, not zeros")
    return (f"{first}: other rows equal; a row of −∞ → zeros (hand-written: "
            f"{lhs[0].ravel()[0]}); a row of the fill → zeros (hand-written: "
            f"{lhs[1].ravel()[0]:.3g})")


def lse_minus_inf(rule, entry) -> str:
    import jax
    from napkin.core.semantics import evaluate
    inputs, var_map = INSTANCES[entry.name][0]
    D = instance(entry, inputs, var_map)
    R = recognized(rule, entry, D)
    xs = _sample(D, _num_sizes(inputs, reduced_axis(entry, var_map), other=4),
                 np.random.default_rng(8))
    xs[0][0] = -math.inf
    with jax.enable_x64(True):
        lhs, rhs = np.asarray(evaluate(D)(*xs)), np.asarray(evaluate(R)(*xs))
    if rhs[0] != -math.inf or not np.allclose(lhs[1:], rhs[1:], rtol=1e-12, atol=0):
        raise Failed(f"a row of −∞ gives {rhs[0]}; other rows equal: "
                     f"{np.allclose(lhs[1:], rhs[1:], rtol=1e-12, atol=0)}")
    return f"a row of −∞ → −∞ (hand-written: {lhs[0]}); other rows equal"


# ----------------------------------------------------------------------------- premises
def hosts():
    """Programs that are NOT instances, each with the pattern tried, the expected words of
    the refusal and what it shows."""
    import napkin as nk
    from napkin.frontend import ops
    n, v, d = nk.axes("n v d")

    def two_axes(X):
        m = ops.max_(X, v)
        e = ops.exp(ops.sub(X, m))
        return ops.div(e, ops.sum_(e, d))

    def another_array(X, Y):
        m = ops.max_(Y, v)
        e = ops.exp(ops.sub(X, m))
        return ops.div(e, ops.sum_(e, v))

    def lse_without_m(X):
        return ops.log(ops.sum_(ops.exp(ops.sub(X, ops.max_(X, v))), v))

    def mean_wrong_size(X):
        return ops.scale(ops.sum_(X, v), 1 / d.size)

    def escaping_sum(X):
        m = ops.max_(X, v)
        e = ops.exp(ops.sub(X, m))
        z = ops.sum_(e, v)
        return ops.div(e, z), z

    def escaping_max(X):
        m = ops.max_(X, v)
        e = ops.exp(ops.sub(X, m))
        return ops.add(ops.div(e, ops.sum_(e, v)), m)

    def summing_extra(S, V):
        m = ops.max_(S, v)
        p = ops.exp(ops.sub(S, m))
        return ops.div(ops.contract(p, V, out=(n,)), ops.sum_(p, v))
    return [
        ("softmax", nk.trace(two_axes, {"X": (n, v, d)}, "max over v, sum over d"),
         ("the max reduces v but the sum reduces d",),
         "the max over one axis and the sum over another are refused"),
        ("softmax", nk.trace(another_array, {"X": (n, v), "Y": (n, v)}, "another array's max"),
         ("the subtraction and the max must read the same array X",),
         "a subtracted max of another array is refused (equal over the reals — any shift "
         "constant along the axis cancels — but only the same array's max makes the "
         "hand-written form the primitive's floating-point computation)"),
        ("logsumexp", nk.trace(lse_without_m, {"X": (n, v)}, "lse without + m"),
         ("the pattern ends in the addition of the max (add), and log is not one",),
         "a logsumexp without the + m is refused (it ends in log, not in the addition of m)"),
        ("mean", nk.trace(mean_wrong_size, {"X": (n, v, d)}, "Σ_v x / |d|"),
         ("the scale is scale(1/d) but the pattern needs scale(1/v)",),
         "a mean scaled by another axis's length is refused"),
        ("softmax", nk.trace(escaping_sum, {"X": (n, v)}, "softmax and its sum"),
         ("is also an output of the program",),
         "an interior value that is an output of the program is refused (gluing)"),
        ("softmax", nk.trace(escaping_max, {"X": (n, v)}, "softmax plus its max"),
         ("is also read by", "outside the pattern"),
         "an interior value read outside the match is refused (gluing)"),
        ("softmax_contraction", nk.trace(summing_extra, {"S": (n, v), "V": (v, d)},
                                         "P·V summing d too"),
         ("the contraction also reduces d",),
         "a contraction that also sums an extra axis is refused (extra axes are woven)"),
    ]


def refused_everywhere(rule, name, D, needles) -> str:
    """The rule proposes nothing for ``name`` in ``D``, and at the site of every op of
    ``D`` up to the last that could end the pattern it refuses with ``needles`` in its
    reason."""
    from napkin.core.ir import ops as op_order, view
    from napkin.core.match import anchor_key
    from napkin.core.region import Site
    g = view(D)
    props = [p for p in rule.proposals(g) if p[1] == name]
    if props:
        raise Failed(f"the rule proposes {name} at ops {list(props[0][0])}")
    order = op_order(g)
    key = rule.table[name].pattern.key
    ends = [i for i, n in enumerate(order) if anchor_key(g.nodes[n]["box"].spec) == key]
    last = ends[-1] if ends else len(order) - 1
    return refuses(lambda: rule.check(D, Site((), tuple(range(last + 1))), {"pattern": name}),
                   *needles)


def prove():
    from rewrites import RULES
    rule = RULES[RULE]
    proof = Proof(RULE, __name__, __doc__)
    rng = np.random.default_rng(14)
    for entry in rule.table.values():
        proof.check(f"{entry.name}: {entry.summary}: lhs = rhs on symbolic entries",
                    lambda e=entry: symbolic(rule, e))
        proof.check(f"{entry.name}: float64, ragged sizes, other axis names and extra axes (JAX)",
                    lambda e=entry: numeric_random(rule, e, rng), "numeric")
        proof.check(f"{entry.name}: the primitive form at bfloat16 vs the float64 meaning "
                    f"(tolerance 2e-2)", lambda e=entry: numeric_bf16(rule, e, rng), "numeric")
        if entry.name in UNSHIFTED:
            proof.check(f"{entry.name}: where the hand-written form overflows (logits ±1000) "
                        f"the primitive is the shifted form (numerically safe)",
                        lambda e=entry: numeric_overflow(rule, e, rng), "numeric")
        if entry.name in ("softmax", "softmax_contraction", "sink_softmax", "sink_attention",
                          *CONST_SINKS):
            proof.check(f"{entry.name}: rows that keep no entry become zeros (the primitive's "
                        f"convention), every other row equal", lambda e=entry: masked_rows(rule, e),
                        "numeric")
        if entry.name == "logsumexp":
            proof.check("logsumexp: a row of −∞ gives −∞, every other row equal",
                        lambda e=entry: lse_minus_inf(rule, e), "numeric")
    for name, D, needles, what in hosts():
        proof.check(f"premise enforced: {what}",
                    lambda name=name, D=D, needles=needles: refused_everywhere(rule, name, D,
                                                                               needles),
                    "premise")
    return proof.result()


# ----------------------------------------------------------------------------- wrong variants
def _wrong_table():
    """Plausible but wrong table entries: each must fail the obligations above."""
    from napkin.frontend import ops
    from rewrites.recognize import (Recognition, kept_axes, logsumexp_rhs, mean_rhs,
                                    sink_attention_const_rhs, softmax_rhs)

    def two_axes(X, *, v, d):
        e = ops.exp(ops.sub(X, ops.max_(X, v, name="the max"), name="the subtraction"))
        return ops.div(e, ops.sum_(e, d, name="the sum"), name="the division")

    def lse_without_m(X, *, v):
        return ops.log(ops.sum_(ops.exp(ops.sub(X, ops.max_(X, v, name="the max"))), v,
                                name="the sum"), name="the log")

    def mean_wrong_size(X, *, v, d):
        return ops.scale(ops.sum_(X, v, name="the sum"), 1 / d.size, name="the scale")

    def another_max(X, Y, *, n, v):
        e = ops.exp(ops.sub(X, ops.max_(Y, n, name="the max"), name="the subtraction"))
        return ops.div(e, ops.sum_(e, v, name="the sum"), name="the division")

    def sink_unshifted_mass(S, V, *, x, c):  # the sink's mass exp(c), not exp(c − m)
        from napkin.core.primitives import Map
        mx = ops.apply(Map("max_const", c), ops.max_(S, x, name="the max"),
                       name="the max with the sink")[0]
        p = ops.exp(ops.sub(S, mx, name="the subtraction"), name="the exponential")
        z = ops.add(ops.sum_(p, x, name="the sum"), ops.exp(ops.add_const(
            ops.scale(mx, 0.0, name="the dropped shift"), c), name="the sink's exponential"),
            name="the sink's mass")
        return ops.div(ops.contract(p, V, out=kept_axes(p, V, x), name="the contraction"), z,
                       name="the division")

    # (entry, instances) — each instance {input: host axes}, {axis variable: host axis}
    return [
        (Recognition("wrong: a constant sink's mass without the shift",
                     "(Σ p·V) / (Σ p + exp(c)), p = exp(S − m), m = max(max S, c) → "
                     "Σ softmax(S, sink=c)·V", sink_unshifted_mass, {"S": ("x",), "V": ("x",)},
                     sink_attention_const_rhs, consts=("c",)),
         [({"S": "q x", "V": "x d"}, {"x": "x"})]),
        (Recognition("wrong: the max over v, the sum over d → softmax_v",
                     "exp(x − max_v x) / Σ_d exp(x − max_v x) → softmax_v(x)", two_axes,
                     {"X": ("v", "d")}, softmax_rhs),
         [({"X": "v d"}, {"v": "v", "d": "d"})]),
        (Recognition("wrong: logsumexp without the + m",
                     "log Σ exp(x − max x) → logsumexp(x)", lse_without_m, {"X": ("v",)},
                     logsumexp_rhs),
         [({"X": "n v"}, {"v": "v"})]),
        (Recognition("wrong: a mean dividing by the wrong axis's size",
                     "(Σ_v x) · 1/|d| → mean_v(x)", mean_wrong_size, {"X": ("v", "d")},
                     mean_rhs),
         [({"X": "v d"}, {"v": "v", "d": "d"})]),
        (Recognition("wrong: softmax whose subtracted max is of another array, over another axis",
                     "exp(x − max_n y) / Σ_v exp(x − max_n y) → softmax_v(x)", another_max,
                     {"X": ("n", "v"), "Y": ("n", "v")}, lambda m, X, Y: softmax_rhs(m, X)),
         [({"X": "n v", "Y": "n v"}, {"v": "v", "n": "n"})]),
    ]


def prove_wrong() -> list:
    """One ProofResult per wrong table entry, run through the same obligations as the real
    ones (the rule built from that entry alone): each must be not ok."""
    from rewrites.recognize import Recognize
    results = []
    for entry, instances in _wrong_table():
        INSTANCES[entry.name] = instances
        rule = Recognize((entry,))
        proof = Proof(entry.name, __name__, __doc__)
        rng = np.random.default_rng(15)
        proof.check(f"{entry.summary}: lhs = rhs on symbolic entries",
                    lambda e=entry: symbolic(rule, e, lengths=(1, 2, 3)))
        proof.check(f"{entry.summary}: float64, ragged sizes (JAX)",
                    lambda e=entry: numeric_random(rule, e, rng), "numeric")
        results.append(proof.result())
    return results
