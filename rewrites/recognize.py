"""Recognition: a softmax, logsumexp, mean or RMSNorm written by hand becomes the
primitive the streamability rules know.

A hand-written softmax — max, sub, exp, sum, div — has three reductions over one
axis, and a stream partition streams a reduction only when nothing before it in
the stream depends on another reduction over that axis: exp(x − max x) needs the
max first.  So it streams in three passes (two for a logsumexp), or not at all
(attention that divides after P·V).  Written as ``ops.softmax`` it is one claim
of the softmax-contraction accumulator, which carries the running max itself.
This rule rewrites the first into the second.

The rule is data: :data:`TABLE` lists each :class:`Recognition` — a name (the
rule's parameter ``pattern``), a left-hand side stated as a pattern diagram
(:class:`napkin.core.match.Pattern`: napkin.frontend.ops over array and axis variables; its
sharing of axis variables and values are the side conditions, each failure
named after the pattern's ops) and a right-hand-side builder.  Matches come
from the one generic matcher (:mod:`napkin.core.match`), at any axis names and under
any extra woven axes.

Matches: the ops of one match of the pattern named by ``pattern``, ending at
the site's last op; the site's ops must be exactly the match's.  Parameters:
``{"pattern": NAME}``.  Proof: proofs/recognize.py (every entry's lhs = rhs on
symbolic entries and numerically, and the premises enforced).

Where floating point differs from the hand-written form (the proof states and
checks each): the unshifted forms exp(x)/Σ exp(x) and log Σ exp(x) overflow
where their primitives — the shifted, numerically safe form of the same
function — do not; a softmax of a row that kept no entry (every entry −∞ or
below the mask threshold, :data:`napkin.core.primitives.MASKED`) is zeros, as
``ops.softmax`` defines it and as the softmax-contraction accumulator streams
it (the hand-written form gives NaN for a row of −∞, and the average over the
masked entries for a row of the mask's fill); a logsumexp of a row of −∞ is −∞
(the hand-written form: NaN).  On every other input the two sides are the same
function (float64: equal to rounding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import networkx as nx

from napkin.frontend import ops
from napkin.core.arrays import ArrayType
from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, to_diagram, view
from napkin.core.match import Pattern, attempt, by_kind, match_at
from napkin.core.primitives import Map
from napkin.core.region import Site, body_at, inline, region, replace_at
from napkin.frontend.trace import trace
from rewrites.base import Rule, ob


@dataclass(frozen=True)
class Recognition:
    """One row of the table: ``lhs(*arrays, **variables)`` is the hand-written form over
    ``inputs`` ({name: axis variables}) — or a tuple of such forms, *variants* of one
    hand-written computation (x·x or square(x), Σ/n or mean, …), each its own pattern;
    ``rhs(match, *arrays)`` builds the primitive form on the host's arrays
    (``match.axis("v")``, ``match.const("eps")``, ``match.out_ob``).  ``subsumes``:
    entries not proposed where this one matches a superset of their ops (the unshifted
    softmax inside the shifted one)."""
    name: str
    summary: str
    lhs: Callable | tuple
    inputs: dict
    rhs: Callable
    consts: tuple = ()
    notes: tuple = ()          # ((op name, text), ...): what a parameter must be
    conditions: tuple = ()     # extra napkin.core.match.Condition s
    subsumes: tuple = ()

    @property
    def variants(self) -> tuple:
        return self.lhs if isinstance(self.lhs, tuple) else (self.lhs,)

    @property
    def patterns(self) -> tuple[Pattern, ...]:
        return _patterns(self)

    @property
    def pattern(self) -> Pattern:
        return self.patterns[0]


_PATTERNS: dict = {}


def _patterns(entry: Recognition) -> tuple[Pattern, ...]:
    key = id(entry)
    if key not in _PATTERNS or _PATTERNS[key][0] is not entry:
        _PATTERNS[key] = (entry, tuple(
            Pattern(entry.name, fn, entry.inputs, entry.consts, entry.conditions, dict(entry.notes))
            for fn in entry.variants))
    return _PATTERNS[key][1]


# ----------------------------------------------------------------------------- the table
def softmax_lhs(X, *, v):
    m = ops.max_(X, v, name="the max")
    e = ops.exp(ops.sub(X, m, name="the subtraction"), name="the exponential")
    return ops.div(e, ops.sum_(e, v, name="the sum"), name="the division")


def softmax_unshifted_lhs(X, *, v):
    e = ops.exp(X, name="the exponential")
    return ops.div(e, ops.sum_(e, v, name="the sum"), name="the division")


def softmax_rhs(m, X):
    return ops.softmax(X, m.axis("v"), as_=m.out_ob.name)


def kept_axes(p, V, x):
    """The contraction's output axes: every axis of its inputs but x (none in the pattern
    itself; the woven ones when the pattern is written out on a host's arrays)."""
    return [a for a in dict.fromkeys((*p.type.names, *V.type.names)) if a != x.name]


def attention_lhs(S, V, *, x):
    """(Σ_x exp(S − max S)·V) / Σ_x exp(S − max S): attention that divides after P·V."""
    mx = ops.max_(S, x, name="the max")
    p = ops.exp(ops.sub(S, mx, name="the subtraction"), name="the exponential")
    o = ops.contract(p, V, out=kept_axes(p, V, x), name="the contraction")
    return ops.div(o, ops.sum_(p, x, name="the sum"), name="the division")


def attention_unshifted_lhs(S, V, *, x):
    p = ops.exp(S, name="the exponential")
    o = ops.contract(p, V, out=kept_axes(p, V, x), name="the contraction")
    return ops.div(o, ops.sum_(p, x, name="the sum"), name="the division")


def attention_rhs(m, S, V):
    return ops.contract(ops.softmax(S, m.axis("x")), V, out=list(m.out_ob.type.names),
                        as_=m.out_ob.name)


def logsumexp_lhs(X, *, v):
    mx = ops.max_(X, v, name="the max")
    s = ops.sum_(ops.exp(ops.sub(X, mx, name="the subtraction"), name="the exponential"), v,
                 name="the sum")
    return ops.add(ops.log(s, name="the log"), mx, name="the addition of the max")


def logsumexp_unshifted_lhs(X, *, v):
    return ops.log(ops.sum_(ops.exp(X, name="the exponential"), v, name="the sum"),
                   name="the log")


def logsumexp_rhs(m, X):
    return ops.logsumexp(X, m.axis("v"), as_=m.out_ob.name)


def mean_lhs(X, *, v):
    return ops.scale(ops.sum_(X, v, name="the sum"), 1 / v.size, name="the scale")


def mean_prescaled_lhs(X, *, v):
    return ops.sum_(ops.scale(X, 1 / v.size, name="the scale"), v, name="the sum")


def mean_rhs(m, X):
    return ops.mean(X, m.axis("v"), as_=m.out_ob.name)


def square_lhs(X):
    return ops.mul(X, X, name="the product")


def square_rhs(m, X):
    return ops.square(X, as_=m.out_ob.name)


def _rmsnorm_variant(square: str, mean: str, root: str, with_eps: bool):
    """x / √(mean x² (+ ε)) · g as written by hand: x² as square(x) or x·x; the mean as
    mean_v, (Σ_v) · 1/|v| or Σ_v (· 1/|v|); the root as x / √r or x · rsqrt(r)."""
    def lhs(X, G, *, v, eps=None):
        sq = ops.square(X, name="the square") if square == "square" else \
            ops.mul(X, X, name="the square")
        if mean == "mean":
            ms = ops.mean(sq, v, name="the mean")
        elif mean == "sum/n":
            ms = ops.scale(ops.sum_(sq, v, name="the sum"), 1 / v.size, name="the scale")
        else:
            ms = ops.sum_(ops.scale(sq, 1 / v.size, name="the scale"), v, name="the sum")
        if with_eps:
            ms = ops.add_const(ms, eps, name="the epsilon")
        if root == "sqrt":
            Xn = ops.div(X, ops.sqrt(ms, name="the root"), name="the normalisation")
        else:
            Xn = ops.mul(X, ops.rsqrt(ms, name="the root"), name="the normalisation")
        return ops.mul(Xn, G, name="the weighting")
    lhs.__name__ = f"rmsnorm_{square}_{mean}_{root}{'_eps' if with_eps else ''}".replace("/", "_")
    return lhs


RMSNORM_VARIANTS = tuple(_rmsnorm_variant(sq, mean, root, eps)
                         for root in ("sqrt", "rsqrt") for eps in (True, False)
                         for sq in ("square", "mul") for mean in ("mean", "sum/n", "sum(/n)"))


def rmsnorm_rhs(m, X, G):
    """The library's form (napkin.frontend.library.rmsnorm_matmul): the per-row factor last, where
    normalized_contraction pulls it out of a contraction that follows."""
    ms = ops.mean(ops.square(X), m.axis("v"), as_="ms")
    if "eps" in m.consts:
        ms = ops.add_const(ms, m.const("eps"))
    return ops.mul(ops.mul(X, G, as_="Xg"), ops.rsqrt(ms, as_="inv"), as_=m.out_ob.name)


def _sink_term(s, mx):
    return ops.exp(ops.sub(s, mx, name="the sink's subtraction"), name="the sink's exponential")


def sink_softmax_lhs(X, s, *, v):
    """exp(x − m) / (Σ exp(x − m) + exp(s − m)), m = max(max x, s): a logit s more a row."""
    mx = ops.maximum(ops.max_(X, v, name="the max"), s, name="the max with the sink")
    p = ops.exp(ops.sub(X, mx, name="the subtraction"), name="the exponential")
    z = ops.add(ops.sum_(p, v, name="the sum"), _sink_term(s, mx), name="the sink's mass")
    return ops.div(p, z, name="the division")


def sink_softmax_unshifted_lhs(X, s, *, v):
    p = ops.exp(X, name="the exponential")
    z = ops.add(ops.sum_(p, v, name="the sum"), ops.exp(s, name="the sink's exponential"),
                name="the sink's mass")
    return ops.div(p, z, name="the division")


def sink_softmax_rhs(m, X, s):
    return ops.softmax(X, m.axis("v"), sink=s, as_=m.out_ob.name)


def sink_attention_lhs(S, V, s, *, x):
    """(Σ_x p·V) / (Σ_x p + exp(s − m)), p = exp(S − m), m = max(max S, s)."""
    mx = ops.maximum(ops.max_(S, x, name="the max"), s, name="the max with the sink")
    p = ops.exp(ops.sub(S, mx, name="the subtraction"), name="the exponential")
    z = ops.add(ops.sum_(p, x, name="the sum"), _sink_term(s, mx), name="the sink's mass")
    return ops.div(ops.contract(p, V, out=kept_axes(p, V, x), name="the contraction"), z,
                   name="the division")


def sink_attention_unshifted_lhs(S, V, s, *, x):
    p = ops.exp(S, name="the exponential")
    z = ops.add(ops.sum_(p, x, name="the sum"), ops.exp(s, name="the sink's exponential"),
                name="the sink's mass")
    return ops.div(ops.contract(p, V, out=kept_axes(p, V, x), name="the contraction"), z,
                   name="the division")


def sink_attention_const_lhs(S, V, *, x, c):
    """(Σ_x p·V) / (Σ_x p + exp(c − m)), p = exp(S − m), m = max(max S, c): a sink logit
    written as a constant (c − m as ops.sub(c, m) and jnp write it: −m + c)."""
    mx = ops.apply(Map("max_const", c), ops.max_(S, x, name="the max"),
                   name="the max with the sink")[0]
    p = ops.exp(ops.sub(S, mx, name="the subtraction"), name="the exponential")
    sink = ops.exp(ops.add_const(ops.neg(mx, name="the negated max"), c,
                                 name="the sink's subtraction"), name="the sink's exponential")
    z = ops.add(ops.sum_(p, x, name="the sum"), sink, name="the sink's mass")
    return ops.div(ops.contract(p, V, out=kept_axes(p, V, x), name="the contraction"), z,
                   name="the division")


def sink_attention_const_rhs(m, S, V):
    sink = ops.add_const(ops.fill(ArrayType((), S.type.dtype), 0.0), m.const("c"), as_="sink")
    return sink_attention_rhs(m, S, V, sink)


def sink_attention_rhs(m, S, V, s):
    return ops.contract(ops.softmax(S, m.axis("x"), sink=s), V, out=list(m.out_ob.type.names),
                        as_=m.out_ob.name)


TABLE: tuple[Recognition, ...] = (
    Recognition("softmax", "exp(x − max x) / Σ exp(x − max x) → softmax(x)",
                softmax_lhs, {"X": ("v",)}, softmax_rhs, subsumes=("softmax_unshifted",)),
    Recognition("softmax_unshifted",
                "exp(x) / Σ exp(x) → softmax(x) (its numerically safe form)",
                softmax_unshifted_lhs, {"X": ("v",)}, softmax_rhs),
    Recognition("softmax_contraction",
                "(Σ_x exp(S − max S)·V) / Σ_x exp(S − max S) → Σ_x softmax(S)·V",
                attention_lhs, {"S": ("x",), "V": ("x",)}, attention_rhs,
                subsumes=("softmax_contraction_unshifted",)),
    Recognition("softmax_contraction_unshifted",
                "(Σ_x exp(S)·V) / Σ_x exp(S) → Σ_x softmax(S)·V (its numerically safe form)",
                attention_unshifted_lhs, {"S": ("x",), "V": ("x",)}, attention_rhs),
    Recognition("logsumexp", "log Σ exp(x − m) + m, m = max x → logsumexp(x)",
                logsumexp_lhs, {"X": ("v",)}, logsumexp_rhs, subsumes=("logsumexp_unshifted",)),
    Recognition("logsumexp_unshifted", "log Σ exp(x) → logsumexp(x) (its numerically safe form)",
                logsumexp_unshifted_lhs, {"X": ("v",)}, logsumexp_rhs),
    Recognition("mean", "(Σ_v x) · 1/|v| → mean_v(x)", mean_lhs, {"X": ("v",)}, mean_rhs,
                notes=(("the scale", "1/|{v}|: one over the length of the axis the sum reduces"),)),
    Recognition("mean_prescaled", "Σ_v (x · 1/|v|) → mean_v(x)", mean_prescaled_lhs,
                {"X": ("v",)}, mean_rhs,
                notes=(("the scale", "1/|{v}|: one over the length of the axis the sum reduces"),)),
    Recognition("sink_softmax",
                "exp(x − m) / (Σ exp(x − m) + exp(s − m)), m = max(max x, s) "
                "→ softmax(x, sink=s)",
                sink_softmax_lhs, {"X": ("v",), "s": ()}, sink_softmax_rhs,
                subsumes=("sink_softmax_unshifted",)),
    Recognition("sink_softmax_unshifted",
                "exp(x) / (Σ exp(x) + exp(s)) → softmax(x, sink=s) (its numerically safe form)",
                sink_softmax_unshifted_lhs, {"X": ("v",), "s": ()}, sink_softmax_rhs),
    Recognition("sink_attention",
                "(Σ_x p·V) / (Σ_x p + exp(s − m)), p = exp(S − m), m = max(max S, s) "
                "→ Σ_x softmax(S, sink=s)·V",
                sink_attention_lhs, {"S": ("x",), "V": ("x",), "s": ()}, sink_attention_rhs,
                subsumes=("sink_attention_unshifted",)),
    Recognition("sink_attention_unshifted",
                "(Σ_x exp(S)·V) / (Σ_x exp(S) + exp(s)) → Σ_x softmax(S, sink=s)·V "
                "(its numerically safe form)",
                sink_attention_unshifted_lhs, {"S": ("x",), "V": ("x",), "s": ()},
                sink_attention_rhs),
    Recognition("sink_attention_const",
                "(Σ_x p·V) / (Σ_x p + exp(c − m)), p = exp(S − m), m = max(max S, c), c a "
                "constant → Σ_x softmax(S, sink=c)·V",
                sink_attention_const_lhs, {"S": ("x",), "V": ("x",)}, sink_attention_const_rhs,
                consts=("c",)),
    Recognition("square", "x · x → square(x)", square_lhs, {"X": ()}, square_rhs),
    Recognition("rmsnorm",
                "x / √(mean x² + ε) · g → (x · g) · rsqrt(mean x² + ε) (ε or none; x² as "
                "x·x, the mean as Σ/|v|, the root as rsqrt: 24 variants)",
                RMSNORM_VARIANTS, {"X": ("v",), "G": ("v",)}, rmsnorm_rhs, consts=("eps",),
                notes=(("the scale", "1/|{v}|: one over the length of the axis the sum reduces"),),
                subsumes=("square", "mean", "mean_prescaled")),
)


# ----------------------------------------------------------------------------- the rule
class Recognize(Rule):
    name = "recognize"
    params = ("pattern",)
    eager = True
    summary = ("a softmax, logsumexp, mean, x·x or RMSNorm written by hand becomes the "
               "primitive the streamability rules know (one table of patterns)")
    proof = "proofs.recognize"

    def __init__(self, table=TABLE):
        self.table = {e.name: e for e in table}

    def entry(self, params) -> Recognition:
        name = params.get("pattern")
        if not isinstance(name, str):
            raise RuleError(f"recognize needs a parameter pattern (one of: "
                            f"{', '.join(self.table)})")
        if name not in self.table:
            raise RuleError(f"recognize knows no pattern {name!r}; known: {', '.join(self.table)}")
        return self.table[name]

    def _find(self, program, site, params):
        entry = self.entry(params)
        g = view(body_at(program, site.path))
        order = op_order(g)
        if not site.ops:
            raise RuleError("recognize needs a site of at least one op")
        bad = [i for i in site.ops if not 0 <= i < len(order)]
        if bad:
            raise RuleError(f"site names op #{bad[0]} but the body has ops #0..#{len(order) - 1}")
        last = max(site.ops)
        anchor = order[last]
        found, why, best = [], "", -2
        for pattern in entry.patterns:  # every variant; the furthest failure says why
            matches, reason, progress = attempt(pattern, g, anchor)
            found += matches
            if progress > best:
                why, best = reason, progress
        if not found:
            raise RuleError(f"no hand-written {entry.name} ends at {g.nodes[anchor]['box'].name} "
                            f"(op #{last}): {why}")
        want = tuple(sorted(set(site.ops)))
        for m in found:
            if m.indices() == want:
                reg = region(g, list(want))
                if reg.outputs != [m.output]:  # gluing: napkin.core.match keeps what it computes
                    raise RuleError(f"the hand-written {entry.name} "  # inside
                                    + ("is discarded: nothing reads what it computes"
                                       if not reg.outputs else "leaks a value it computes"))
                return g, entry, m, reg
        raise RuleError(f"the hand-written {entry.name} that ends at "
                        f"{g.nodes[anchor]['box'].name} (op #{last}) is ops "
                        f"{list(found[0].indices())}, not the site's {list(want)}")

    def check(self, program, site, params):
        self._find(program, site, params)

    def apply(self, program, site, params):
        g, entry, m, reg = self._find(program, site, params)
        want = m.out_ob

        def rhs(*args):
            env = dict(zip(reg.inputs, args))
            out = entry.rhs(m, *[env[m.inputs[n]] for n in m.pattern.input_names])
            if out.type == want.type:
                return out
            if set(out.type.names) != set(want.type.names) or out.type.dtype != want.type.dtype:
                raise RuleError(f"the primitive form of {entry.name} is {out.ob} "
                                f"({out.type.dtype}) where the program has {want} "
                                f"({want.type.dtype})")
            return ops.contract(out, out=list(want.type.names), name="transpose", as_=want.name)
        new = trace(rhs, [(ob(g, v).name, ob(g, v).type) for v in reg.inputs],
                    f"recognized {entry.name}")
        return replace_at(program, site.path, to_diagram(inline(reg, new)))

    def proposals(self, graph) -> tuple:
        """(op indices, pattern name) of every match in a body's graph: the largest ones
        (an entry is not proposed inside a match of an entry that subsumes it).  Memoised
        on the frozen view: the search asks again for every state sharing the body."""
        key = ("_recognize", tuple(self.table))
        cached = graph.graph.get(key) if hasattr(graph, "graph") else None
        if cached is not None and cached[0] is self:
            return cached[1]
        index = by_kind(graph)
        found = []
        for entry in self.table.values():
            for pattern in entry.patterns:
                for n in index.get(pattern.key, ()):
                    for m in match_at(pattern, graph, n)[0]:
                        found.append((m.indices(), entry.name))
        kept = []
        for ops_, name in dict.fromkeys(found):
            sub = set(ops_)
            if any(name in self.table[other].subsumes and sub < set(o2) for o2, other in found):
                continue
            try:
                region(graph, list(ops_))
            except RuleError:
                continue
            kept.append((ops_, name))
        result = tuple(kept)
        if nx.is_frozen(graph):
            graph.graph[key] = (self, result)
        return result

    def candidates(self, program, path=()):
        """Every match, on a program nothing has partitioned yet: recognition commutes with
        a partition of the region that holds it (recognise, then group or stream, is the
        program that grouping or streaming first, then recognising inside, gives), so
        proposing it before any partition reaches every program once instead of once per
        order (and a partition that splits a pattern leaves nothing to recognise).  ``check``
        and ``apply`` take any site, inside groups too (a certificate may have one)."""
        if path:
            return
        g = view(program)
        if any(g.nodes[n]["box"].spec.kind in ("group", "stream") for n in op_order(g)):
            return
        for ops_, name in self.proposals(g):
            yield Site((), ops_), {"pattern": name}
