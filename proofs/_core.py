"""The proof kernel shared by every rule's proof module.

A proof is a list of *obligations*, each a finite check that the module's
docstring lifts to every size.  Two kinds carry the weight:

* **symbolic** — the rule's own diagrams (obtained by applying the real rule
  from ``rewrites`` to a small generic program) are evaluated with the SYMPY
  backend (:data:`napkin.core.backend.SYMPY`) on numpy object arrays of sympy
  symbols, through the very primitive definitions the kernels use, and the
  difference of the two sides is canonicalised to 0;
* **numeric** — both sides through :func:`napkin.core.semantics.evaluate` (JAX) on
  random inputs: float64, large logits, fully masked rows, bfloat16.

Premise checks ("the rule refuses …") guard the side conditions the argument
needs.  :class:`ProofResult` is what ``prove()`` returns.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import numpy as np
import sympy

from napkin.frontend.sampling import sample  # noqa: F401  (the proofs' inputs: napkin's one sampler)

# --------------------------------------------------------------------------- results


@dataclass
class Obligation:
    """One checked claim: ``description`` says what, ``detail`` how it went."""
    description: str
    ok: bool
    detail: str = ""
    kind: str = "symbolic"      # symbolic | numeric | premise | structure
    seconds: float = 0.0

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} [{self.kind}] {self.description}: {self.detail}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ProofResult:
    """The outcome of one rule's proof: ``ok`` iff there is at least one
    obligation and every obligation holds."""
    rule: str
    obligations: list[Obligation] = field(default_factory=list)
    module: str = ""
    statement: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.obligations) and all(o.ok for o in self.obligations)

    @property
    def failed(self) -> list[Obligation]:
        return [o for o in self.obligations if not o.ok]

    @property
    def detail(self) -> str:
        """The failed obligations, each with its description and detail."""
        if not self.obligations:
            return "no obligation was checked"
        return "; ".join(f"{o.description}: {o.detail}" for o in self.failed)

    def summary(self) -> str:
        head = (f"{'PROVED' if self.ok else 'FAILED'} {self.rule} ({self.module or '?'}, "
                f"{len(self.obligations) - len(self.failed)}/{len(self.obligations)} obligations, "
                f"{self.seconds:.2f}s)")
        return "\n".join([head] + ["  " + o.line() for o in self.obligations])

    def to_json(self) -> dict:
        return {"rule": self.rule, "module": self.module, "statement": self.statement,
                "ok": self.ok, "seconds": self.seconds,
                "obligations": [o.to_json() for o in self.obligations]}


class Failed(Exception):
    """Raised inside an obligation to fail it with a detail."""


class Proof:
    """Collects obligations: ``proof.check(description, fn)`` runs ``fn``; it
    returns a detail string (the obligation holds) or raises :class:`Failed`
    (or anything else: the obligation fails with the error)."""

    def __init__(self, rule: str, module: str, doc: str | None = None):
        self.rule, self.module = rule, module
        self.statement = _statement(doc)
        self.obligations: list[Obligation] = []
        self.t0 = time.perf_counter()

    def check(self, description: str, fn: Callable[[], str | None], kind: str = "symbolic"):
        t = time.perf_counter()
        try:
            detail, ok = fn() or "holds", True
        except Failed as e:
            detail, ok = str(e), False
        except Exception as e:  # an error while checking is a failed obligation
            detail, ok = f"error: {type(e).__name__}: {e}", False
        ob = Obligation(description, ok, detail, kind, round(time.perf_counter() - t, 3))
        self.obligations.append(ob)
        return ob

    def result(self) -> ProofResult:
        return ProofResult(self.rule, self.obligations, self.module, self.statement,
                           round(time.perf_counter() - self.t0, 3))


def _statement(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def format_results(results: list[ProofResult]) -> str:
    return "\n".join(r.summary() for r in results)


# --------------------------------------------------------------------------- symbols


def size(name: str) -> sympy.Symbol:
    """An axis-size symbol, as napkin makes them."""
    return sympy.Symbol(name, integer=True, positive=True)


def symbols(prefix: str, shape: tuple[int, ...], integer: bool = False) -> np.ndarray:
    """A numpy object array of distinct real sympy symbols (``integer``: integer ones, of
    any sign: an index, which may fall outside its axis)."""
    out = np.empty(shape, dtype=object)
    kind = {"integer": True} if integer else {"real": True}
    for idx in np.ndindex(*shape):
        out[idx] = sympy.Symbol(f"{prefix}{''.join(f'_{i}' for i in idx)}", **kind)
    return out


def sym_ctx(sizes: dict):
    from napkin.core.backend import SYMPY
    from napkin.core.primitives import EvalContext
    return EvalContext({size(k) if isinstance(k, str) else k: v for k, v in sizes.items()}, {},
                       SYMPY)


def sym_inputs(diagram, sizes: dict) -> list[np.ndarray]:
    """Symbolic arrays for every input of ``diagram`` at the given sizes."""
    from napkin.core.arrays import array_types
    env = {size(k) if isinstance(k, str) else k: v for k, v in sizes.items()}
    out = []
    for i, (ob, t) in enumerate(zip(diagram.dom.inside, array_types(diagram.dom))):
        shape = tuple(int(sympy.sympify(a.size).subs(env)) for a in t.axes)
        out.append(symbols(f"{ob.name.lower()}{i}", shape,
                           integer=t.dtype in ("int32", "int8")))
    return out


# --------------------------------------------------------------------------- deciding zero

def _numerator(e):
    return sympy.fraction(sympy.together(e))[0]


_CANON = (
    ("expand/powsimp", lambda e: sympy.expand(sympy.powsimp(sympy.expand(e)))),
    ("numerator expand/powsimp",
     lambda e: sympy.expand(sympy.powsimp(sympy.expand(_numerator(e))))),
)


def _short(e, n: int = 240) -> str:
    s = str(e)
    return s if len(s) <= n else s[:n] + " …"


def _index(s) -> bool:
    """An index symbol (symbols(..., integer=True)): an integer of any sign."""
    return bool(s.is_integer) and s.is_positive is None and s.is_nonnegative is None


def _probe(expr, rng: random.Random, points: int = 4):
    """Largest |expr| at random rational points (30 digits), and that point.  Index
    symbols (integers of any sign) take every combination of the integers −1 … 6 (up to
    two of them; random ones beyond): a wrong index shows at an integer only."""
    import itertools
    free = sorted(expr.free_symbols, key=str)
    ints = [s for s in free if _index(s)]
    reals = [s for s in free if not _index(s)]
    if ints and len(ints) <= 2:
        grid = list(itertools.product(range(-1, 7), repeat=len(ints)))
    else:
        grid = [tuple(rng.randint(-1, 6) for _ in ints) for _ in range(points)]
    worst, where = 0.0, {}
    for k in range(max(points, len(grid))):
        vals = {s: sympy.Integer(v) for s, v in zip(ints, grid[k % len(grid)])} if ints else {}
        vals.update({s: sympy.Rational(Fraction(rng.randint(-40, 40), rng.randint(1, 9)))
                     for s in reals})
        v = sympy.N(expr.subs(vals), 30)
        if not v.is_number:
            raise Failed(f"cannot evaluate {_short(v)}")
        if float(abs(v)) >= worst:
            worst, where = float(abs(v)), vals
    return worst, where


def _nonzero_at(expr, point: dict) -> bool:
    """Whether ``expr`` is not 0 at ``point`` (60 digits; a symbol the point lacks: not
    known to be 0)."""
    v = sympy.N(expr.subs(point), 60)
    return not v.is_number or abs(v) > 1e-20


def decide_zero(expr, allow_numeric: bool = False, seed: int = 0) -> tuple[bool, str]:
    """Is ``expr`` identically 0?  Canonical forms first (expand, powsimp —
    which also merges exp(a − m)·exp(m − m′) into exp(a − m′) with Max terms as
    opaque atoms — and the numerator over a common denominator); when those
    leave a residue, random rational points look for a counterexample, then
    ``simplify`` is tried.  ``allow_numeric``: accept agreement at random
    rational points when symbolic simplification is inconclusive."""
    expr = sympy.sympify(expr)
    if expr == 0:
        return True, "identical"
    residue = expr
    for how, f in _CANON:
        residue = f(expr)
        if residue == 0:
            return True, how
    rng = random.Random(seed)
    worst, where = _probe(residue, rng)
    # a counterexample is one of the claim: the canonical form's many terms can cancel past
    # what sympy.N evaluates a Max to (a sink's saved L: 2.1e-13 where mpmath at 400 digits
    # gives 3e-398), so the point is checked on ``expr`` as written
    if worst > 1e-20 and _nonzero_at(expr, where):
        point = ", ".join(f"{k}={v}" for k, v in where.items())
        return False, (f"counterexample: the difference is {worst:.3g} at {_short(point, 160)} "
                       f"(difference {_short(residue)})")
    if sympy.simplify(residue) == 0:
        return True, "simplify"
    if allow_numeric and _probe(residue, rng, 8)[0] <= 1e-20:
        return True, "zero at 12 random rational points (symbolic simplification inconclusive)"
    return False, f"not proven: difference {_short(residue)}"


def compare(lhs, rhs, env: dict | None = None, allow_numeric: bool = False) -> str:
    """Entrywise symbolic equality of two arrays (or tuples of arrays).
    Entries with a ``log`` are also compared after ``exp`` (injective on ℝ).
    Returns a detail string or raises :class:`Failed`."""
    env = {size(k) if isinstance(k, str) else k: v for k, v in (env or {}).items()}
    lhs = lhs if isinstance(lhs, (tuple, list)) else [lhs]
    rhs = rhs if isinstance(rhs, (tuple, list)) else [rhs]
    if len(lhs) != len(rhs):
        raise Failed(f"{len(lhs)} outputs against {len(rhs)}")
    hows, n = set(), 0
    for k, (a, b) in enumerate(zip(lhs, rhs)):
        a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
        if a.shape != b.shape:
            raise Failed(f"output {k}: shape {a.shape} against {b.shape}")
        for idx in np.ndindex(*a.shape):
            ea = sympy.sympify(a[idx]).subs(env)
            eb = sympy.sympify(b[idx]).subs(env)
            if ea.has(sympy.log) or eb.has(sympy.log):
                # sympy does not merge μ + log Σ…: compare exp of both sides
                ok, how = decide_zero(sympy.exp(ea) - sympy.exp(eb), allow_numeric)
                how = f"after exp (injective on the reals): {how}"
            else:
                ok, how = decide_zero(ea - eb, allow_numeric)
            if not ok:
                raise Failed(f"output {k} entry {list(idx)}: {how}")
            hows.add(how)
            n += 1
    return f"{n} entries equal ({', '.join(sorted(hows))})"


# --------------------------------------------------------------------------- streams


@dataclass
class Streamed:
    """A program before and after the stream partition of its whole body."""
    reference: object          # the un-streamed diagram f
    rewritten: object          # the diagram holding the Stream box
    spec: object               # the napkin.core.streamed.Stream spec
    ins: tuple                 # the Stream box's input ArrayTypes
    perm: list[int]            # stream input i is reference input perm[i]
    out_perm: list[int]        # reference output j is stream output out_perm[j]

    @property
    def axis(self) -> str:
        return self.spec.axis


_STREAMED: dict = {}


def stream_rule(diagram, axis: str, chunk="s") -> Streamed:
    """Apply the real ``stream_partition`` rule to every op of ``diagram``
    (memoised per diagram object: building diagrams is the slow part)."""
    from napkin.core.ir import ops as op_order, to_graph
    from napkin.core.region import Site
    from rewrites import RULES
    key = (id(diagram), axis, chunk)
    if key in _STREAMED and _STREAMED[key][0] is diagram:
        return _STREAMED[key][1]
    n = len(op_order(to_graph(diagram)))
    new = RULES["stream_partition"].apply(diagram, Site((), tuple(range(n))),
                                          {"axis": axis,
                                           "chunk": f"s_{axis}" if chunk == "s" else chunk})
    _STREAMED[key] = (diagram, _streamed(diagram, new))
    return _STREAMED[key][1]


@functools.lru_cache(maxsize=None)
def library(name: str, dtype: str = "f64"):
    """A library algorithm's diagram (cached: diagrams are immutable)."""
    from napkin.frontend.library import get
    return get(name).diagram(dtype)


def _streamed(reference, rewritten) -> Streamed:
    from napkin.core.arrays import array_types
    from napkin.core.ir import to_graph
    g = to_graph(rewritten)
    nodes = [n for n in g.nodes if g.nodes[n]["kind"] == "op"]
    streams = [n for n in nodes if getattr(g.nodes[n]["box"].spec, "kind", None) == "stream"]
    if len(nodes) != 1 or len(streams) != 1:
        raise Failed(f"expected the whole body to become one stream box, got "
                     f"{[g.nodes[n]['box'].name for n in nodes]}")
    node = g.nodes[streams[0]]
    inputs, outputs = g.graph["inputs"], g.graph["outputs"]
    return Streamed(reference, rewritten, node["box"].spec, tuple(array_types(node["box"].dom)),
                    [inputs.index(v) for v in node["ins"]],
                    [node["outs"].index(v) for v in outputs])


def with_stream(st: Streamed, spec) -> Streamed:
    """The same program with another Stream spec in the box (wrong variants)."""
    from napkin.core.ir import to_diagram, to_graph
    from napkin.core.op import make_op
    g = to_graph(st.rewritten)
    (n,) = [n for n in g.nodes if g.nodes[n]["kind"] == "op"]
    box = g.nodes[n]["box"]
    g.nodes[n]["box"] = make_op(spec, box.dom, [o.name for o in box.cod.inside], box.name)
    return _streamed(st.reference, to_diagram(g))


def fold(st: Streamed, ctx, xs, chunks, finalize: bool = True, start: int = 0):
    """Fold the accumulator from init over chunks of the given lengths (any sequence,
    not only uniform ones) of the reference inputs ``xs``, the first at ``start`` (a
    parallel split's positions are the global ones); return the outputs in the
    reference's order, or the state when ``finalize`` is false."""
    from napkin.core.semantics import run
    spec, xp = st.spec, ctx.xp
    args = [xs[i] for i in st.perm]
    state = run(spec.init, ctx)
    for c in chunks:
        sub = ctx.shifted(spec.axis, start).bound(spec.chunk, c)
        part = [xp.take(x, t.names.index(spec.axis), start, start + c) if t.has(spec.axis) else x
                for t, x in zip(st.ins, args)]
        state = run(spec.update, sub, *state, *part)
        start += c
    if not finalize:
        return state
    fixed = [x for t, x in zip(st.ins, args) if not t.has(spec.axis)]
    out = run(spec.finalize, ctx, *state, *fixed)
    return tuple(out[j] for j in st.out_perm)


def _axis_size(st: Streamed):
    for t in st.ins:
        if t.has(st.axis):
            return t.axis(st.axis).size
    raise Failed(f"no input carries {st.axis}")


def describe(ty) -> str:
    return ", ".join(f"{ob.name}[{','.join(ob.type.names)}]:{ob.type.dtype}" for ob in ty.inside)


def accumulator_obligations(proof: Proof, st: Streamed, sizes: dict, what: str,
                            lengths=(1, 2, 3),
                            pairs=((1, 1), (1, 2), (2, 1), (2, 2), (3, 1)),
                            folds=((1, 1, 1), (2, 1, 2), (1, 3)),
                            uniform=((3, 2), (5, 2)),
                            allow_numeric: bool = False):
    """The symbolic obligations of an accumulator (init, update, finalize)
    against the un-streamed program f, on symbolic entries:

    1. base: finalize(update(init, x)) = f(x) for one chunk of each length;
    2. law: update(state(x), y) = state(x ⊕ y), state(x) := update(init, x),
       for chunk lengths (|x|, |y|) in ``pairs`` (states compared entrywise);
    3. fold: finalize after folding chunks c₁…c_k = f(x₁ ⊕ … ⊕ x_k);
    4. the Stream box itself (uniform chunks, ragged last) = f;
    5. merge (where the stream has one): merge(state(x), state(y)) = state(x ⊕ y) =
       merge(state(y), state(x)), each state folded from init on its own (y at its global
       positions), for (|x|, |y|) in ``pairs`` — in either order, as a ring over devices
       merges its chunks; and init is its unit on either side (a split with no entry);
    and the rewritten program keeps f's type.  ``sizes`` binds the other
    axes (small ints)."""
    from napkin.core.semantics import run
    axis_size = _axis_size(st)
    n_sym = axis_size if isinstance(axis_size, sympy.Symbol) else None

    def env(n):
        e = dict(sizes)
        if n_sym is not None:
            e[n_sym] = n
        return e

    def setup(n):
        e = env(n)
        return e, sym_ctx(e), sym_inputs(st.reference, e)

    def base():
        for n in lengths:
            e, ctx, xs = setup(n)
            ref = run(st.reference, ctx, *xs)
            compare(fold(st, ctx, xs, (n,)), ref, e, allow_numeric)
        return f"lengths {list(lengths)}: equal"

    def law():
        for n1, n2 in pairs:
            e, ctx, xs = setup(n1 + n2)
            two = fold(st, ctx, xs, (n1, n2), finalize=False)
            one = fold(st, ctx, xs, (n1 + n2,), finalize=False)
            try:
                compare(two, one, e, allow_numeric)
            except Failed as err:
                raise Failed(f"|x|={n1}, |y|={n2}: state {err}") from None
        return f"(|x|,|y|) in {[list(p) for p in pairs]}: states equal"

    def folded():
        for cs in folds:
            e, ctx, xs = setup(sum(cs))
            ref = run(st.reference, ctx, *xs)
            try:
                compare(fold(st, ctx, xs, cs), ref, e, allow_numeric)
            except Failed as err:
                raise Failed(f"chunks {list(cs)}: {err}") from None
        return f"chunks {[list(c) for c in folds]}: equal"

    def box():
        for n, c in uniform:
            e, ctx, xs = setup(n)
            ref = run(st.reference, ctx, *xs)
            got = run(st.rewritten, ctx.bound(st.spec.chunk, c), *xs)
            try:
                compare(got, ref, e, allow_numeric)
            except Failed as err:
                raise Failed(f"|{st.axis}|={n}, chunk {c}: {err}") from None
        return f"(|{st.axis}|, chunk) in {[list(u) for u in uniform]}: equal"

    def merged():
        from napkin.core.semantics import run
        for n1, n2 in pairs:
            e, ctx, xs = setup(n1 + n2)
            x = fold(st, ctx, xs, (n1,), finalize=False)
            y = fold(st, ctx, xs, (n2,), finalize=False, start=n1)
            both = fold(st, ctx, xs, (n1 + n2,), finalize=False)
            try:
                compare(run(st.spec.merge, ctx, *x, *y), both, e, allow_numeric)
            except Failed as err:
                raise Failed(f"|x|={n1}, |y|={n2}: merged state {err}") from None
            try:  # out of order: what a ring over devices folds (device i starts at chunk i)
                compare(run(st.spec.merge, ctx, *y, *x), both, e, allow_numeric)
            except Failed as err:
                raise Failed(f"|x|={n1}, |y|={n2}: merge(state(y), state(x)) {err}: the "
                             f"merge is not commutative, so chunks must fold in order") from None
        # the empty state (a split that holds no entry) is the merge's unit, either side
        e, ctx, xs = setup(lengths[-1])
        empty, x = run(st.spec.init, ctx), fold(st, ctx, xs, lengths[-1:], finalize=False)
        for side, args in (("init ∥ x", (*empty, *x)), ("x ∥ init", (*x, *empty))):
            try:
                compare(run(st.spec.merge, ctx, *args), x, e, allow_numeric)
            except Failed as err:
                raise Failed(f"merge({side}) is not state(x): {err}") from None
        return (f"(|x|,|y|) in {[list(p) for p in pairs]}: merged states equal, in either "
                f"order; init is the unit on both sides")

    def types():
        ref, new = st.reference, st.rewritten
        if ref.dom != new.dom or ref.cod != new.cod:
            raise Failed(f"{describe(ref.dom)} -> {describe(ref.cod)} became "
                         f"{describe(new.dom)} -> {describe(new.cod)}")
        return f"{describe(ref.dom)} -> {describe(ref.cod)}"

    sym = "symbolic entries" + (", random rational points where simplification is inconclusive"
                                if allow_numeric else "")
    proof.check(f"{what}: the rewritten program has the same type (axes, sizes, dtypes)", types,
                "structure")
    proof.check(f"{what}: base case finalize(update(init, x)) = f(x) ({sym})", base)
    proof.check(f"{what}: accumulator law update(state(x), y) = state(x ⊕ y) ({sym})", law)
    proof.check(f"{what}: fold over chunks then finalize = f(concatenation) ({sym})", folded)
    proof.check(f"{what}: the Stream box (uniform chunks, ragged last) = f ({sym})", box)
    if st.spec.merge is not None:
        proof.check(f"{what}: merge law merge(state(x), state(y)) = state(x ⊕ y) = "
                    f"merge(state(y), state(x)), y's positions after x's ({sym})", merged)


# --------------------------------------------------------------------------- numbers


def bf16(xs):
    """Floating inputs rounded to bf16 (integer ones, labels and indices, kept)."""
    import jax.numpy as jnp
    return [jnp.asarray(x, dtype=jnp.bfloat16) if _floating(x) else x for x in xs]


def as_f64(xs):
    return [np.asarray(np.asarray(x, dtype=np.float32), dtype=np.float64) if _floating(x) else x
            for x in xs]


def _floating(x) -> bool:
    import jax.numpy as jnp
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.floating))


def numeric(lhs, rhs, xs_lhs, xs_rhs=None, sizes_lhs=None, sizes_rhs=None,
            tol: float = 1e-9, nonfinite: bool = False, jit: bool = True) -> str:
    """Both sides through :func:`napkin.core.semantics.evaluate` (64-bit JAX
    enabled for the call); max error relative to max |lhs| must be ≤ ``tol``.
    ``nonfinite``: inputs hold ±∞ or NaN, and both sides must have the same
    non-finite entries (NaN where NaN, −∞ where −∞); otherwise any non-finite
    value fails.  ``jit``: each side as one compiled program (a program of many boxes,
    folded over many pieces, runs op by op much slower).  Returns a detail string or
    raises :class:`Failed`."""
    import jax
    from napkin.core.semantics import evaluate
    wrap = jax.jit if jit else (lambda f: f)
    with jax.enable_x64(True):
        a = wrap(evaluate(lhs, sizes_lhs))(*xs_lhs)
        b = wrap(evaluate(rhs, sizes_rhs))(*(xs_lhs if xs_rhs is None else xs_rhs))
        a = [np.asarray(np.asarray(v, dtype=np.float32) if v.dtype.itemsize < 4 else v, np.float64)
             for v in (a if isinstance(a, tuple) else (a,))]
        b = [np.asarray(np.asarray(v, dtype=np.float32) if v.dtype.itemsize < 4 else v, np.float64)
             for v in (b if isinstance(b, tuple) else (b,))]
    worst = 0.0
    for k, (u, v) in enumerate(zip(a, b)):
        if u.shape != v.shape:
            raise Failed(f"output {k}: shape {u.shape} against {v.shape}")
        if nonfinite:
            bad = ~((u == v) | (np.isnan(u) & np.isnan(v))) & ~(np.isfinite(u) & np.isfinite(v))
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                raise Failed(f"output {k} at {at}: {v[at]} where the algorithm gives {u[at]}")
            finite = np.isfinite(u)
            u, v = np.where(finite, u, 0.0), np.where(finite, v, 0.0)
        elif not np.all(np.isfinite(u)) or not np.all(np.isfinite(v)):
            raise Failed(f"output {k}: non-finite values (lhs finite: {np.isfinite(u).all()}, "
                         f"rhs finite: {np.isfinite(v).all()})")
        err = float(np.max(np.abs(u - v), initial=0.0)) / max(float(np.max(np.abs(u), initial=0.0)),
                                                             1e-300)
        worst = max(worst, err)
    if worst > tol:
        raise Failed(f"relative error {worst:.2e} > tol {tol:g}")
    return f"relative error {worst:.1e} ≤ {tol:g}"


def refuses(fn: Callable, *needles: str) -> str:
    """The rule raises RuleError (whose message contains every needle)."""
    from napkin.core.errors import RuleError
    try:
        fn()
    except RuleError as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        if missing:
            raise Failed(f"refused, but the message lacks {missing!r}: {msg}") from None
        return f"refused: {msg}"
    raise Failed("the rule applied where its premise fails")


def all_ops(diagram, path=()) -> tuple[int, ...]:
    from napkin.core.ir import ops as op_order, to_graph
    from napkin.core.region import body_at
    return tuple(range(len(op_order(to_graph(body_at(diagram, path))))))


def apply_rule(name: str, diagram, params: dict, path=(), ops=None):
    from napkin.core.region import Site
    from rewrites import RULES
    site = Site(tuple(path), tuple(ops) if ops is not None else all_ops(diagram, path))
    return RULES[name].apply(diagram, site, dict(params))


def merge_numeric(st: Streamed, sizes: dict, rng: np.random.Generator, *, splits: int = 3,
                  empty: bool = False, ring: bool = False, tol: float = 1e-12) -> str:
    """float64 (JAX): the axis cut at random points into ``splits`` parts (one of them
    possibly empty), each part's state folded from init on its own, merged left to right
    and finalized, equals the reference; ``empty``: the first input along the axis is −∞
    throughout the first part (a split every key of which is masked); ``ring``: merged in
    a ring device's order instead (from a random part, then the ones before it, wrapping
    round)."""
    import jax
    import jax.numpy as jnp
    from napkin.core.primitives import EvalContext
    from napkin.core.arrays import array_types
    from napkin.core.semantics import bind_sizes, run
    xs = sample(st.reference, sizes, rng, scale=3.0)
    n = sizes[st.axis]
    cuts = sorted(int(c) for c in rng.integers(0, n + 1, splits - 1))
    bounds = list(zip([0] + cuts, cuts + [n]))
    with jax.enable_x64(True):
        xs = [jnp.asarray(x) for x in xs]
        if empty:
            i = next(j for j, t in enumerate(array_types(st.reference.dom)) if t.has(st.axis))
            t = array_types(st.reference.dom)[i]
            k = t.names.index(st.axis)
            first = bounds[0][1] if bounds[0][1] > 0 else 1
            idx = [slice(None)] * xs[i].ndim
            idx[k] = slice(0, first)
            xs[i] = xs[i].at[tuple(idx)].set(-jnp.inf)
        env = bind_sizes(array_types(st.reference.dom), xs, {}, [str(o) for o in
                                                                  st.reference.dom.inside])
        ctx = EvalContext(env)
        state = None
        if ring:
            r = int(rng.integers(len(bounds)))
            bounds = [bounds[(r - j) % len(bounds)] for j in range(len(bounds))]
        for a, b in bounds:
            part = fold(st, ctx, xs, (b - a,) if b > a else (), finalize=False, start=a)
            state = part if state is None else run(st.spec.merge, ctx, *state, *part)
        args = [xs[i] for i in st.perm]
        fixed = [x for t, x in zip(st.ins, args) if not t.has(st.axis)]
        out = run(st.spec.finalize, ctx, *state, *fixed)
        got = [np.asarray(out[j], np.float64) for j in st.out_perm]
        ref = [np.asarray(v, np.float64) for v in run(st.reference, ctx, *xs)]
    for u, v in zip(got, ref):
        same = (u == v) | (np.isnan(u) & np.isnan(v))  # the non-finite entries must agree
        finite = np.isfinite(u) & np.isfinite(v)
        with np.errstate(invalid="ignore"):
            err = np.abs(np.where(finite, u - v, 0)).max(initial=0)
        if not (same | finite).all() or err > tol * max(np.abs(np.where(finite, v, 0)).max(
                initial=0), 1):
            raise Failed(f"splits {bounds}: the merged result differs from f (largest "
                         f"difference {err:.3g}; non-finite entries that disagree: "
                         f"{int((~(same | finite)).sum())}); counterexample at the inputs drawn")
    return f"splits {bounds}{', the first all −∞' if empty else ''}: equal within {tol:g}"


def merge_checks(proof: Proof, st, sizes: dict, what: str, seed: int = 27):
    """The merge in float64 on splits the accumulator's own fold does not make: three
    parts at random cuts (one may be empty), and a first part that is all −∞."""
    rng = np.random.default_rng(seed)
    proof.check(f"{what}: merged splits = f (float64, JAX; an empty split, an all −∞ one, "
                f"merged in a ring's order)",
                lambda: "; ".join(merge_numeric(st, sizes, rng, empty=e, ring=r)
                                  for e, r in ((False, False), (False, False), (True, False),
                                               (False, True), (True, True))), "numeric")


def ragged(rng: np.random.Generator, lo: int, hi: int) -> tuple[int, int]:
    """A random length in [lo, hi] and a chunk size that does not divide it."""
    while True:
        n = int(rng.integers(lo, hi + 1))
        c = int(rng.integers(2, max(3, n)))
        if n % c:
            return n, c


# Shared numeric sizes: eager JAX compiles once per (primitive, shape), so the
# proofs reuse these shapes wherever the obligation does not need others.
SIZES = {"q": 6, "x": 5, "d": 2, "n": 3, "v": 5, "a": 5, "b": 5, "c": 2, "e": 2}
CHUNK = 3   # 5 = 3 + 2: a ragged last chunk
GROUP = 4   # 6 = 4 + 2, 5 = 4 + 1: ragged last groups
