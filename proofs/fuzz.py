"""Soundness fuzzing: random algorithms, random rule chains, compared in float64.

An attacker's view of the rules.  :func:`random_algorithm` builds a small
algorithm from the public primitives (napkin.frontend.ops) over axes whose names collide
with the tiles rules like to introduce (``a`` and ``g_a``, ``x`` and ``s_x``),
with symbolic or integer sizes.  :func:`random_chain` applies rule applications
proposed by the rules' own ``candidates``, with the default tile names, integer
tiles and names that clash with an axis, a size or another tile.  Masks (causal,
window, padding) and rows of zeros or −∞ give fully masked rows.  For every
proposal, ``check`` passing means ``apply`` must succeed (:class:`Finding` kind
``apply``); every rewritten program is evaluated against its algorithm in
float64 (:func:`compare`) at sizes that are ragged, prime or 1, on inputs with
±1e4, −∞, NaN and fully −∞ rows.

The choices go through a :class:`Chooser`, so the same generator serves a
hypothesis test (which shrinks a failure to a small one) and a long seeded
campaign (benchmarks/fuzz.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import sympy

from napkin.frontend import ops
from napkin.core.arrays import Axis
from napkin.core.errors import NapkinError, RuleError
from napkin.core.ir import ops as op_order, view
from napkin.core.region import Site, body_at
from napkin.frontend.trace import Array, trace

# Axis names: each pair collides with a default tile of the other (g_a groups a,
# s_x streams x), and d is a common head dimension that a careless tile might reuse.
AXIS_NAMES = ("a", "g_a", "x", "s_x", "d", "q")
UNARY = ("tanh", "neg", "square", "abs_", "sigmoid", "relu", "exp", "scale", "add_const",
         "softcap")
BINARY = ("add", "sub", "mul", "max", "min")
SIZES = (1, 2, 3, 5, 7)        # ragged against every tile below, prime, and 1
TILES = (1, 2, 3, 4)
SPECIAL = (1e4, -1e4, -math.inf, math.nan)
RTOL = 1e-9


class Chooser:
    """Where the random choices come from."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, seq):
        seq = list(seq)
        return seq[self.integer(0, len(seq) - 1)]

    def boolean(self, p: float = 0.5) -> bool:
        return self.integer(0, 999) < int(p * 1000)

    def subset(self, seq, lo: int = 1, hi: int | None = None) -> list:
        seq = list(seq)
        hi = len(seq) if hi is None else min(hi, len(seq))
        k = self.integer(min(lo, hi), hi)
        pool, out = list(seq), []
        for _ in range(k):
            out.append(pool.pop(self.integer(0, len(pool) - 1)))
        return out


class RandomChooser(Chooser):
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def integer(self, lo, hi):
        return int(self.rng.integers(lo, hi + 1))


class HypothesisChooser(Chooser):
    """Choices drawn from hypothesis's ``data`` (``st.data()``), so failures shrink."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def integer(self, lo, hi):
        return self.data.draw(self.st.integers(lo, hi))


# ----------------------------------------------------------------------------- algorithms
@dataclass
class Algorithm:
    diagram: object
    axes: dict                  # name -> Axis
    description: list = field(default_factory=list)


LIBRARY = ("attention", "causal_attention", "sliding_window_attention", "gqa", "mqa",
           "logsumexp", "cross_entropy", "linear_cross_entropy", "rmsnorm_matmul", "matmul",
           "softmax")


def random_algorithm(ch: Chooser, max_ops: int = 6) -> Algorithm:
    """A random algorithm, now and then a library one, now and then woven over one
    more axis for some of its inputs (as GQA is)."""
    if ch.boolean(0.2):
        from napkin.frontend.library import get
        name = ch.choice(LIBRARY)
        alg = Algorithm(get(name).diagram(), {}, [name])
    else:
        alg = _random_algorithm(ch, max_ops)
    if ch.boolean(0.2):
        from napkin.frontend.weave import weave
        names = {a for ob in alg.diagram.dom.inside for a in ob.type.names}
        free = [n for n in ("h", "k", "r") if n not in names]
        n_in = len(alg.diagram.dom.inside)
        chosen = ch.subset(range(n_in), 1, n_in)
        axis = Axis(free[0], free[0])
        try:
            alg = Algorithm(weave(alg.diagram, axis, inputs=chosen), alg.axes,
                            [*alg.description, f"woven over {axis.name} for inputs {chosen}"])
        except NapkinError:  # e.g. a padding mask whose validity alone gains the axis
            pass
    return alg


def _random_algorithm(ch: Chooser, max_ops: int) -> Algorithm:
    names = ch.subset(AXIS_NAMES, 2, 4)
    axes = {n: Axis(n, ch.choice((2, 3, 4)) if ch.boolean(0.2) else n) for n in names}
    inputs = []
    for i in range(ch.integer(1, 3)):
        picked = ch.subset(names, 1, 3)
        inputs.append((f"X{i}", Array(*(axes[n] for n in picked))))
    steps = []

    def body(*xs):
        values = list(xs)
        for _ in range(ch.integer(1, max_ops)):
            out = _random_op(ch, values, axes, steps)
            if out is not None:
                values.append(out)
        outs = [values[-1]]
        if len(values) > len(xs) + 1 and ch.boolean(0.3):
            other = ch.choice(values[len(xs):-1])
            if other is not outs[0]:
                outs.append(other)
        return tuple(outs) if len(outs) > 1 else outs[0]
    diagram = trace(body, inputs, "fuzz")
    return Algorithm(diagram, axes, steps)


def _random_op(ch, values, axes, steps):
    x = ch.choice(values)
    kind = ch.choice(("contract", "unary", "binary", "reduce", "softmax", "mask", "contract",
                      "divide", "reduce", "normalized", "size_constant"))
    try:
        if kind == "size_constant":  # a constant naming any axis's size, carried or not
            size = axes[ch.choice(sorted(axes))].size
            steps.append(f"scale({x.name}, 1/sqrt({size}))")
            return ops.scale(x, 1 / sympy.sqrt(size))
        if kind == "contract":
            y = ch.choice(values)
            union = list(dict.fromkeys([*x.type.names, *y.type.names]))
            out = ch.subset(union, 0, 3)
            steps.append(f"contract({x.name}, {y.name} -> {out})")
            return ops.contract(x, y, out=out) if y is not x else ops.contract(x, out=out)
        if kind == "unary":
            fn = ch.choice(UNARY)
            steps.append(f"{fn}({x.name})")
            if fn == "scale":
                return ops.scale(x, ch.choice((0.5, -2.0, sympy.Rational(1, 3))))
            if fn == "add_const":
                return ops.add_const(x, ch.choice((1.0, -0.5)))
            if fn == "softcap":
                return ops.softcap(x, 5.0)
            return getattr(ops, fn)(x)
        if kind == "normalized" and x.type.names:  # (x / (1 + (Σ_s x)²)) · y, summed over s
            s = ch.choice(x.type.names)
            D = ops.add_const(ops.square(ops.sum_(x, s)), 1.0)
            y = ch.choice([v for v in values if v.type.has(s)] or [x])
            union = list(dict.fromkeys([*x.type.names, *y.type.names]))
            out = [a for a in union if a != s and (a in y.type.names or ch.boolean())]
            steps.append(f"normalized({x.name}, {y.name} over {s} -> {out})")
            return ops.contract(ops.div(x, D), y, out=out)
        if kind == "divide":  # by a positive denominator: normalisers, as in n / Σ exp
            y = ch.choice(values)
            steps.append(f"div({x.name}, 1 + {y.name}²)")
            return ops.div(x, ops.add_const(ops.square(y), 1.0))
        if kind == "binary":
            y, fn = ch.choice(values), ch.choice(BINARY)
            steps.append(f"{fn}({x.name}, {y.name})")
            return {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "max": ops.maximum,
                    "min": ops.minimum}[fn](x, y)
        if not x.type.names:
            return None
        axis = ch.choice(x.type.names)
        if kind == "reduce":
            fn = ch.choice(("sum", "max", "mean", "logsumexp"))
            steps.append(f"{fn}_{axis}({x.name})")
            return {"sum": ops.sum_, "max": ops.max_, "mean": ops.mean,
                    "logsumexp": ops.logsumexp}[fn](x, axis)
        if kind == "softmax":
            steps.append(f"softmax_{axis}({x.name})")
            return ops.softmax(x, axis)
        valid = [v for v in values if v is not x and set(v.type.names) <= set(x.type.names)]
        if valid and ch.boolean(0.4):  # zeros in `valid` mask entries out: whole rows, at times
            y = ch.choice(valid)
            steps.append(f"pad({x.name}, {y.name})")
            return ops.padding_mask(x, y)
        if len(x.type.names) < 2:
            return None
        q, k = ch.subset(x.type.names, 2, 2)
        if ch.boolean():
            steps.append(f"causal({x.name}, {q}, {k})")
            return ops.causal_mask(x, q, k)
        steps.append(f"window({x.name}, {q}, {k}, 2)")
        return ops.window_mask(x, q, k, 2)
    except NapkinError:
        return None


# ----------------------------------------------------------------------------- chains
@dataclass
class Finding:
    """A soundness failure: a move whose check passed but apply failed, or a
    program that computes something else than its algorithm."""
    kind: str                   # "apply" | "mismatch" | "evaluate"
    detail: str
    chain: list


def proposals(program, ch: Chooser) -> list[tuple]:
    """(rule, site, params) for every candidate of every rule in every group body,
    with tile parameters varied: the rule's default, an integer, a clashing name;
    and a few arbitrary sites (any set of ops, any axis) that the premises must
    judge as well as the rules' own proposals."""
    from rewrites import RULES
    out = []
    for path in _paths(program):
        g = view(body_at(program, path))
        n_ops = len(op_order(g))
        axes = sorted({a for v in g.nodes if g.nodes[v]["kind"] == "value"
                       for a in g.nodes[v]["ob"].type.names})
        for _ in range(6):
            if not n_ops or not axes:
                break
            site = Site(tuple(path), tuple(sorted(ch.subset(range(n_ops), 1, n_ops))))
            rule = ch.choice(sorted(RULES))
            params = {"axis": ch.choice(axes)}
            if rule == "relabel_level":
                params = {"level": ch.choice(("l2", "smem", "registers"))}
            elif rule == "normalized_contraction":
                params = {}
            out.append((rule, site, params))
        for name, rule in RULES.items():
            try:
                cands = list(rule.candidates(program, path))
            except NapkinError as e:
                raise AssertionError(f"{name}.candidates raised {e}") from None
            for site, params in cands:
                out.append((name, site, dict(params)))
                key = {"group_partition": "size", "stream_partition": "chunk"}.get(name)
                if key and key not in params:
                    out.append((name, site, {**params, key: ch.choice(TILES)}))
                    out.append((name, site, {**params, key: ch.choice(_taken_names(program))}))
    return out


def _taken_names(program) -> list[str]:
    from rewrites.tiles import names
    known = names(program)
    return sorted(known.axes | known.sizes | set(known.tiles)) or ["a"]


def _paths(program, path=()):
    yield tuple(path)
    g = view(body_at(program, path))
    for i, n in enumerate(op_order(g)):
        if g.nodes[n]["box"].spec.kind == "group":
            yield from _paths(program, (*path, i))


def random_chain(alg: Algorithm, ch: Chooser, length: int = 4, tries: int = 8):
    """Apply up to ``length`` random proposals; returns (programs, chain, findings,
    refusals).  A proposal whose check passes must apply."""
    from rewrites import RULES
    program, programs, chain, findings, refused = alg.diagram, [], [], [], 0
    for _ in range(length):
        props = proposals(program, ch)
        applied = False
        for _ in range(tries):
            if not props:
                break
            rule, site, params = props.pop(ch.integer(0, len(props) - 1))
            try:
                RULES[rule].check(program, site, dict(params))
            except RuleError:
                refused += 1
                continue
            except Exception as e:  # noqa: BLE001 - a premise check must not crash
                findings.append(Finding("apply", f"{rule}.check crashed: {type(e).__name__}: {e}",
                                        [*chain, (rule, site, params)]))
                continue
            try:
                program = RULES[rule].apply(program, site, dict(params))
            except Exception as e:  # noqa: BLE001 - check passed: apply must succeed
                findings.append(Finding("apply", f"{rule} passed check, then apply raised "
                                                 f"{type(e).__name__}: {e}",
                                        [*chain, (rule, site, params)]))
                continue
            chain.append((rule, site, params))
            programs.append(program)
            applied = True
            break
        if not applied:
            break
    return programs, chain, findings, refused


# ----------------------------------------------------------------------------- evaluation
def tile_values(program, sizes: dict, ch: Chooser) -> dict:
    from napkin.certify.checker import partitions
    tiles = {}
    for tile, _ in partitions(program):
        if isinstance(tile, sympy.Symbol) and tile.name not in tiles:
            tiles[tile.name] = ch.choice(TILES)
    return tiles


def random_inputs(diagram, sizes: dict, ch: Chooser, special: bool = True):
    rng = np.random.default_rng(ch.integer(0, 2 ** 31))
    xs = []
    for ob in diagram.dom.inside:
        shape = [a.size if isinstance(a.size, int) else sizes[str(a.size)] for a in ob.type.axes]
        if ob.type.dtype in ("int32", "int8", "bool"):  # indices and flags keep their dtype
            xs.append(rng.integers(-1, 9, size=shape).astype(np.int32) if ob.type.dtype != "bool"
                      else rng.random(shape) < 0.5)
            if ob.type.dtype == "int8":
                xs[-1] = xs[-1].astype(np.int8)
            continue
        x = rng.standard_normal(shape)
        if special and x.size and ch.boolean(0.6):
            flat = x.reshape(-1)
            for _ in range(ch.integer(1, 3)):
                flat[ch.integer(0, flat.size - 1)] = ch.choice(SPECIAL)
            if x.ndim >= 2 and ch.boolean(0.3):  # a whole row of −∞ (a fully masked row)
                x[ch.integer(0, x.shape[0] - 1)] = -math.inf
        if special and x.size and ch.boolean(0.2):  # ±1 in turn along the last axis: chunks
            # summing to 0 exactly (in float64, in any order), so that a product with ±∞
            # factored out of a sum (±∞ · 0) would show; not in the float32 kernel checks,
            # where sums of such terms in another order leave rounding beside an exact 0
            last = x.shape[-1] if x.ndim else 1
            x[...] = np.where(np.arange(last) % 2, -1.0, 1.0) if x.ndim else 1.0
            if ch.boolean(0.7):
                x.reshape(-1)[ch.integer(0, x.size - 1)] = ch.choice((math.inf, -math.inf))
        if x.size and ch.boolean(0.3):  # a row of zeros: what a padding mask reads as "masked"
            x[ch.integer(0, x.shape[0] - 1) if x.ndim else ...] = 0.0
        xs.append(x)
    return xs


def evaluate(program, env, xs):
    import jax
    from napkin.core.semantics import evaluate as meaning
    with jax.enable_x64(True):
        y = jax.jit(meaning(program, env, exact=True))(*xs)
    return [np.asarray(v, np.float64) for v in (y if isinstance(y, tuple) else (y,))]


def compare(got, want, rtol: float = RTOL) -> str | None:
    """Why ``got`` is not ``want`` (None when it is): the same shapes, finite
    exactly where ``want`` is finite, there within ``rtol`` of the largest finite
    magnitude of ``want``, and the same non-finite value where it is not (NaN where
    NaN, ±∞ where ±∞: a contraction forms its products before its sums, so a stream's
    chunks cannot turn −∞·Σ a into Σ −∞·a)."""
    if len(got) != len(want):
        return f"{len(got)} outputs, the algorithm has {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            return f"output {i}: shape {a.shape}, the algorithm gives {b.shape}"
        fa, fb = np.isfinite(a), np.isfinite(b)
        if not np.array_equal(fa, fb):
            at = np.argwhere(fa != fb)[0]
            return (f"output {i} at {tuple(int(j) for j in at)}: {a[tuple(at)]} where the "
                    f"algorithm gives {b[tuple(at)]}")
        if not np.array_equal(a[~fb], b[~fb], equal_nan=True):
            at = np.argwhere(~fb & ~((a == b) | (np.isnan(a) & np.isnan(b))))[0]
            return (f"output {i} at {tuple(int(j) for j in at)}: {a[tuple(at)]} where the "
                    f"algorithm gives {b[tuple(at)]}")
        if fb.any():
            scale = max(float(np.max(np.abs(b[fb]))), 1e-300)
            err = float(np.max(np.abs(a[fb] - b[fb]))) / scale
            if err > rtol:
                return f"output {i}: relative error {err:.2e} > {rtol:g}"
    return None


def check_chain(alg: Algorithm, programs, chain, ch: Chooser, special: bool = True,
                every_step: bool = False) -> list[Finding]:
    """Evaluate the algorithm and the rewritten programs at one random instance."""
    from napkin.certify.certificate import size_symbols
    if not programs:
        return []
    sizes = {n: ch.choice(SIZES) for n in sorted(size_symbols(alg.diagram))}
    xs = random_inputs(alg.diagram, sizes, ch, special)
    targets = list(enumerate(programs, 1)) if every_step else [(len(programs), programs[-1])]
    try:
        want = evaluate(alg.diagram, sizes, xs)
    except Exception as e:  # noqa: BLE001 - the generator made an algorithm that does not run
        return [Finding("evaluate", f"the algorithm itself fails: {type(e).__name__}: {e}", [])]
    findings = []
    for k, program in targets:
        env = {**sizes, **tile_values(program, sizes, ch)}
        try:
            got = evaluate(program, env, xs)
        except Exception as e:  # noqa: BLE001 - a rewritten program must evaluate
            findings.append(Finding("evaluate", f"after step {k}: {type(e).__name__}: {e} "
                                                f"(sizes {env})", chain[:k]))
            continue
        why = compare(got, want)
        if why:
            findings.append(Finding("mismatch", f"after step {k}, at {env}: {why}", chain[:k]))
    return findings


def describe(alg: Algorithm, chain) -> str:
    steps = "; ".join(f"{r} {dict(p)} at {s}" for r, s, p in chain)
    return f"algorithm [{', '.join(alg.description)}] chain [{steps}]"


# ----------------------------------------------------------------------------- kernels
KERNEL_TILES = (1, 2, 4, 8, 16, 64)  # powers of two (Triton's blocks); above an axis at times
KERNEL_RTOL = 1e-4                   # an f32 kernel against the float64 meaning


def check_kernel(alg: Algorithm, program, chain, ch: Chooser, sizes: dict | None = None,
                 tiles: dict | None = None, stats: dict | None = None) -> list[Finding]:
    """Lower ``program`` (Triton, interpret mode, f32) at small ragged sizes and random
    power-of-two tiles — some larger than their axis — and compare the kernel with the
    algorithm's float64 meaning on finite inputs (or, where float32 cannot represent the
    way there, with the program's own float32 meaning).  A lowering may refuse (one line, a
    NapkinError; ``stats["refused"]`` collects the lines); it may never be silently wrong: a
    kernel that runs must agree."""
    import jax
    from napkin.certify.certificate import size_symbols
    from napkin.lower import lower
    sizes = sizes or {n: ch.choice(SIZES + (6, 9, 12)) for n in sorted(size_symbols(alg.diagram))}
    tiles = tiles or {name: ch.choice(KERNEL_TILES)
                      for name in tile_values(program, sizes, ch)}
    xs = random_inputs(alg.diagram, sizes, ch, special=False)
    try:
        want = evaluate(alg.diagram, sizes, xs)
    except Exception as e:  # noqa: BLE001 - the generator made an algorithm that does not run
        return [Finding("evaluate", f"the algorithm itself fails: {type(e).__name__}: {e}", [])]
    where = f"at sizes {sizes}, tiles {tiles}"
    try:
        kernel = lower(program, tiles, backend="triton", interpret=True, dtype="f32")
        got = kernel(*[np.asarray(x, np.float32) if np.asarray(x).dtype.kind == "f" else x
                       for x in xs])
    except NapkinError as e:
        if stats is not None:
            stats.setdefault("refused", []).append(str(e))
        return []  # refused in one line: allowed
    except Exception as e:  # noqa: BLE001 - never a traceback from inside JAX
        return [Finding("kernel", f"{where}: {type(e).__name__}: {str(e)[:300]}", chain)]
    if stats is not None:
        stats["ran"] = stats.get("ran", 0) + 1
    got = [np.asarray(jax.device_get(g), np.float64)
           for g in (got if isinstance(got, tuple) else (got,))]
    why = compare(got, want, KERNEL_RTOL)
    if why:  # f32 may not reach the float64 answer: a mask's fill of −1e30 squared overflows
        f32 = _in_f32(program, {**sizes, **tiles}, xs)
        if compare(got, f32, KERNEL_RTOL) is None or compare(
                got, _beyond_f32(got, want, f32), KERNEL_RTOL) is None:
            why = None
    return [Finding("kernel", f"{where}: {why}", chain)] if why else []


def _beyond_f32(got, want, f32):
    """``want`` with the entries float32 cannot reach (the program's own f32 meaning is
    not finite there, float64's is) taken from ``got``: no f32 kernel can be held to them,
    and every other entry still must agree with float64."""
    return [np.where(np.isfinite(w) & ~np.isfinite(f), g, w) for g, w, f in zip(got, want, f32)]


def _in_f32(diagram, sizes, xs):
    """The meaning evaluated in float32 (what f32 arithmetic can give at best)."""
    import jax
    from napkin.core.semantics import evaluate as meaning
    y = jax.jit(meaning(diagram, sizes))(*[np.asarray(x, np.float32)
                                          if np.asarray(x).dtype.kind == "f" else x for x in xs])
    return [np.asarray(v, np.float64) for v in (y if isinstance(y, tuple) else (y,))]


SEARCH_SIZES = (64, 256, 1024)


def check_searched(alg: Algorithm, ch: Chooser, max_states: int = 300,
                   stats: dict | None = None) -> list[Finding]:
    """The search's own program for ``alg`` at large sizes, shrunk by ``Optimized.fit`` to
    small ragged ones and lowered (:func:`check_kernel`): what a user runs after a search."""
    from napkin.certify.certificate import size_symbols
    from napkin.pipeline import optimize
    names = sorted(size_symbols(alg.diagram))
    big = {n: ch.choice(SEARCH_SIZES) for n in names}
    try:
        found = optimize(alg.diagram, sizes=big, dtype="f32", max_states=max_states,
                         max_seconds=20.0)
    except NapkinError as e:
        if stats is not None:
            stats.setdefault("unsearched", []).append(str(e))
        return []
    small = found.fit({n: ch.choice(SIZES + (6, 9, 12)) for n in names})
    chain = [(m.rule, m.site, m.params_dict) for m in found.chain]
    return check_kernel(alg, small.program, chain, ch, sizes=small.sizes, tiles=small.tiles,
                        stats=stats)
