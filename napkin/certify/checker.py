"""The certificate checker: an independent re-verification of a derivation.

It trusts nothing in a certificate but its *claims*, and re-establishes each
one from the rules and the semantics alone (it imports no search code):

0. the source: the algorithm is rebuilt (library name or ``FILE:NAME``) and its
   fingerprint compared with the recorded ``source``; every symbolic axis size
   must have a positive value in ``sizes``;
1. every step, in order: the rule exists; its premises hold at the recorded
   site with the recorded parameters (``rule.check``); the rule is applied;
   every tile size it introduces is bound in ``tiles`` to a positive integer;
   the fingerprint of the new program equals the recorded one;
2. the final fingerprint equals the recorded ``result``, the program's free
   size symbols equal ``symbolic``, and no tile in ``tiles`` is unused;
3. numerically, on random inputs at instances the checker chooses itself
   (:func:`check_cases`: the certificate's own sizes and tiles, then every size
   1, distinct primes with tiles below their axis that divide none, and a
   seeded random draw): the final program, the original diagram and the
   library's plain-jnp reference agree over the reals (float64, casts between
   floating dtypes as the identity, relative error <= 1e-9); and the final
   program run at its wires' dtypes stays within :data:`DTYPE_RTOL` of the
   algorithm's exact value on the same rounded inputs.  If the exact comparison
   fails, every intermediate program is evaluated to name the first step that
   broke it.  Groups and streams evaluate as one vmap and one loop, so the
   check costs O(chunks) folds without tracing Python once per chunk.

A failure is a :class:`CheckReport` naming the step (1-based; 0 = the source,
None = the certificate as a whole) and the reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin.certify.certificate import (Certificate, CertificateError, fingerprint, load_algorithm,
                                        size_symbols, spec_label)
from napkin.core.errors import NapkinError
from napkin.core.arrays import narrowest_of
from napkin.core.primitives import JNP_DTYPES
from napkin.frontend.sampling import sample
from napkin.core.semantics import evaluate
from rewrites import RULES

RTOL = 1e-9
# The check runs each program once per size set: compile for speed of compiling.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class CheckFailure(NapkinError):
    """A certificate does not verify: ``step`` (1-based; 0 the source, None the whole)."""

    def __init__(self, step, reason, rule=None, line=None):
        where = "certificate" if step is None else "source" if step == 0 else f"step {step}"
        super().__init__(line or f"{where}{f' ({rule})' if rule and step else ''}: {reason}")
        self.step, self.reason, self.rule, self.line = step, reason, rule, line


@dataclass
class CheckReport:
    ok: bool
    name: str = ""                   # what was checked (a file name, or the algorithm)
    step: int | None = None          # failing step, 1-based; 0 = the source; None = whole
    rule: str | None = None
    reason: str = ""
    n_steps: int = 0
    max_error: float | None = None   # worst relative error of the exact numeric check
    dtype_error: float | None = None  # ... and of the run at the wires' dtypes
    dtype: str = ""                  # the narrowest floating dtype of the algorithm's wires
    seconds: float = 0.0
    line: str | None = None          # the whole message, where it names its place itself

    @property
    def where(self) -> str:
        if self.step is None:
            return "certificate"
        if self.step == 0:
            return "source"
        return f"step {self.step}" + (f" ({self.rule})" if self.rule else "")

    def __str__(self):
        if self.ok:
            err = (f"; numeric max rel err {self.max_error:.1e}" if self.max_error is not None
                   else "; numeric check skipped")
            if self.dtype_error is not None and self.dtype != "f64":
                err += f", {self.dtype_error:.1e} at {self.dtype} wires"
            return (f"verified: {self.n_steps} step(s) replayed{err} "
                    f"({self.seconds:.1f} s)")
        return self.line or f"{self.where}: {self.reason}"


# ----------------------------------------------------------------------------- helpers
def _short(digest: str) -> str:
    return digest[:12] + ".." if len(digest) > 12 else digest


def _tile_ok(name, tiles):
    v = tiles.get(name)
    if v is None:
        return f"tile size {name} is not bound in the certificate's tiles"
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        return f"tile size {name} = {v!r} is not a positive integer"
    return None


# ----------------------------------------------------------------------------- check instances
@dataclass
class Case:
    """One numeric instance: a value for every axis size and every tile."""
    what: str
    sizes: dict
    tiles: dict

    @property
    def env(self) -> dict:
        return {**self.sizes, **self.tiles}


PRIMES = (5, 7, 11, 13)
RANDOM_MAX = 12


def partitions(program) -> list[tuple]:
    """``(tile, extent)`` of every group and stream, outer ones first: the tile (an
    int or a symbol) and the size of the axis where the partition sees it."""
    found = []

    def walk(d):
        for box in d.boxes:
            spec = getattr(box, "spec", None)
            kind = getattr(spec, "kind", None)
            if kind not in ("group", "stream"):
                continue
            extent = next(ob.type.axis(spec.axis).size for ob in box.dom.inside
                          if ob.type.has(spec.axis))
            found.append((spec.size if kind == "group" else spec.chunk, extent))
            for body in spec.bodies:
                walk(body)
    walk(program)
    return found


def _value(expr, values: dict) -> int:
    if isinstance(expr, int):
        return expr
    expr = sympy.sympify(expr)
    return int(expr.xreplace({s: values[str(s)] for s in expr.free_symbols}))


def _draw(what, sizes: dict, parts, pick) -> Case:
    """A case with these axis sizes, each tile picked (outer first) by
    ``pick(extent)`` from the size of the axis it partitions."""
    tiles = {}
    for tile, extent in parts:
        if isinstance(tile, sympy.Symbol) and tile.name not in tiles:
            tiles[tile.name] = max(1, int(pick(_value(extent, {**sizes, **tiles}))))
    return Case(what, sizes, tiles)


def _no_divisor(extent: int) -> int:
    """The smallest tile >= 2 below ``extent`` that does not divide it (so the last
    piece is partial and there are several), else 1."""
    return next((t for t in range(2, extent) if extent % t), 1)


def check_cases(cert, programs) -> list[Case]:
    """The instances the numeric check runs: the certificate's own, then the
    checker's — every size 1; distinct primes with tiles smaller than their axis
    that divide none of them; random sizes and tiles (seeded by the certificate's
    result, so a verdict is reproducible)."""
    axes = sorted(cert.sizes)
    parts = [p for prog in programs for p in partitions(prog)]
    seed = int(cert.result[:16], 16) if all(c in "0123456789abcdef" for c in cert.result[:16]) \
        else 0
    rng = np.random.default_rng(seed)
    return [
        Case("the certificate's instance", dict(cert.sizes), dict(cert.tiles)),
        _draw("size 1", {a: 1 for a in axes}, parts, lambda e: 1),
        _draw("prime sizes, tiles dividing none", {a: PRIMES[i % len(PRIMES)]
                                                   for i, a in enumerate(axes)}, parts, _no_divisor),
        _draw("random sizes and tiles", {a: int(rng.integers(1, RANDOM_MAX + 1)) for a in axes},
              parts, lambda e: rng.integers(1, e + 1)),
    ]


# Relative error allowed when a program runs at its wires' dtypes, against the exact
# (float64) value of the algorithm on the same rounded inputs: a few roundings of the
# narrowest dtype a wire of the algorithm has.
DTYPE_RTOL = {"f64": RTOL, "f32": 1e-5, "bf16": 6e-2, "f16": 1e-2, "fp8": 0.25}


def narrowest(diagram) -> str:
    """The floating dtype with the fewest bits among the wires of ``diagram``."""
    found = set()

    def walk(d):
        found.update(ob.type.dtype for ob in (*d.dom.inside, *d.cod.inside))
        for box in d.boxes:
            found.update(ob.type.dtype for ob in (*box.dom.inside, *box.cod.inside))
            for body in getattr(getattr(box, "spec", None), "bodies", ()):
                walk(body)
    walk(diagram)
    return narrowest_of(found, "f64")


def _run(program, env, xs, exact=True):
    """The program's meaning (the semantics functor) on ``xs``, traced once
    and compiled as one XLA program (op-by-op dispatch would compile every
    primitive at every shape, which is slower by an order of magnitude)."""
    return jax.jit(evaluate(program, env, exact=exact), compiler_options=_FAST_COMPILE)(*xs)


def _run_all(original, final, reference, cases):
    """For each case ``(env, inputs, the same inputs at the wires' dtypes, use_reference)``,
    the float64 inputs being the rounded ones: (original exact, final exact, reference or
    None, final at the wires' dtypes), all cases in one compiled program."""
    fns = [(evaluate(original, env, exact=True), evaluate(final, env, exact=True),
            evaluate(final, env)) for env, _, _, _ in cases]
    flat = [x for _, xs, low, _ in cases for x in (*xs, *low)]
    cuts = np.cumsum([0] + [2 * len(xs) for _, xs, _, _ in cases])
    refs = [reference if use else None for _, _, _, use in cases]

    def split(args):
        out = []
        for i in range(len(cases)):
            part = args[cuts[i]:cuts[i + 1]]
            out.append((part[:len(part) // 2], part[len(part) // 2:]))
        return out

    def napkin_side(*args):
        return [(w(*xs), o(*xs), d(*low)) for (w, o, d), (xs, low) in zip(fns, split(args))]

    def everything(*args):
        return [(w, o, ref(*xs) if ref is not None else None, dl)
                for (w, o, dl), (xs, _), ref in zip(napkin_side(*args), split(args), refs)]
    try:
        return jax.jit(everything, compiler_options=_FAST_COMPILE)(*flat)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
        # a reference that needs concrete values (numpy, Python control flow): run it as is
        sides = jax.jit(napkin_side, compiler_options=_FAST_COMPILE)(*flat)
        return [(w, o, ref(*xs) if ref is not None else None, dl)
                for (w, o, dl), (xs, _), ref in zip(sides, split(flat), refs)]


def _inputs(original, case, rng, sampler, in_dtypes):
    """The case's inputs (float64 values of the rounded ones; integer and bool inputs keep
    their dtype) and the same inputs at the wires' dtypes."""
    xs = sampler(rng, case.sizes) if sampler else sample(original, case.sizes, rng)
    low = [jnp.asarray(np.asarray(x, np.float64), dt) for x, dt in zip(xs, in_dtypes)]
    return [np.asarray(x, np.float64) if jnp.issubdtype(x.dtype, jnp.floating)
            else np.asarray(x) for x in low], low


def reference_runs(cert, src, original) -> list:
    """Where a ``from`` file runs (never where it is judged): for each case the checker
    will run, the inputs the file's own sampler draws and its reference's outputs on them
    — ``[(case index, inputs, outputs or None)]``.  The judge evaluates the diagram it
    rebuilt on these too and compares it with the outputs; it trusts them for nothing
    else (its own random inputs decide whether the program equals the diagram)."""
    if src.reference is None and src.sample is None:
        return []
    _, programs = replay(cert, src)
    in_dtypes = [JNP_DTYPES[ob.type.dtype] for ob in original.dom.inside]
    out = []
    with jax.enable_x64(True):
        for i, case in enumerate(check_cases(cert, programs)):
            xs, _ = _inputs(original, case, np.random.default_rng(i), src.sample, in_dtypes)
            ref = src.reference(*xs) if src.reference is not None else None
            out.append((i, xs, None if ref is None else _outputs(ref)))
    return out


def _outputs(y):
    return [np.asarray(v, dtype=np.float64) for v in (y if isinstance(y, tuple) else (y,))]


def _rel_error(got, want) -> float:
    """Worst |got − want| over the largest |want|, per output; a non-finite entry
    must be the same non-finite value on both sides (NaN where NaN, ±∞ where ±∞)."""
    got, want = _outputs(got), _outputs(want)
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return float("inf")
        finite = np.isfinite(b)
        if not np.array_equal(np.isfinite(a), finite) or \
                not np.array_equal(a[~finite], b[~finite], equal_nan=True):
            return float("inf")
        a, b = a[finite], b[finite]
        scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-300)
        worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)) / scale)
    return worst


# ----------------------------------------------------------------------------- the checker
def replay(cert: Certificate, src=None):
    """Stages 0-2: the algorithm rebuilt, every step re-checked and re-applied, every
    fingerprint compared; returns (original, [program after each step]) or raises
    :class:`CheckFailure`.  ``src``: the loaded algorithm (loaded here by default)."""
    if src is None:
        try:
            src = load_algorithm(cert.algorithm, cert.origin)
        except NapkinError as e:
            raise CheckFailure(0, f"algorithm: {e}") from None
    try:
        original = src.build(cert.dtype)
    except NapkinError as e:
        raise CheckFailure(0, f"cannot build the algorithm: {e}") from None
    got = fingerprint(original)
    if got != cert.source:
        raise CheckFailure(0, f"source fingerprint mismatch: the algorithm {_label(cert)} "
                              f"({cert.dtype}) is not the one the certificate was made from "
                              f"(recorded {_short(cert.source)}, rebuilt {_short(got)})")
    stale = dtype_disagreement(original, cert.dtype)
    if stale:
        raise CheckFailure(0, stale)
    axes = size_symbols(original)
    for name in sorted(axes):
        v = cert.sizes.get(name)
        if v is None:
            raise CheckFailure(0, f"sizes: no value for the symbolic size {name}")
        if v <= 0:
            raise CheckFailure(0, f"sizes: {name} = {v} is not positive")
    extra = sorted(set(cert.sizes) - axes)
    if extra:
        raise CheckFailure(0, f"sizes: {', '.join(extra)} is not a size of the algorithm")

    program, programs, seen = original, [], set(axes)
    for i, step in enumerate(cert.steps, 1):
        rule = RULES.get(step.rule)
        if rule is None:
            reason = f"unknown rule {step.rule!r} (known: {', '.join(sorted(RULES))})"
            raise CheckFailure(i, reason, line=f"unknown rule {step.rule!r} at step {i} "
                                               f"(known: {', '.join(sorted(RULES))})")
        try:
            rule.check(program, step.site, dict(step.params))
            program = rule.apply(program, step.site, dict(step.params))
        except NapkinError as e:
            raise CheckFailure(i, f"premise failed: {e}", step.rule) from None
        except Exception as e:  # noqa: BLE001 - a rule that crashes does not apply
            raise CheckFailure(i, f"the rule failed on this site and parameters: "
                                  f"{type(e).__name__}: {e}", step.rule) from None
        now = size_symbols(program)
        for name in sorted(now - seen):
            why = _tile_ok(name, cert.tiles)
            if why:
                raise CheckFailure(i, f"premise failed: {why}", step.rule)
        seen |= now
        got = fingerprint(program)
        if got != step.result:
            raise CheckFailure(i, f"result fingerprint mismatch (recorded {_short(step.result)}, "
                                  f"replayed {_short(got)})", step.rule)
        programs.append(program)

    got = fingerprint(program)
    if got != cert.result:
        raise CheckFailure(None, f"final result fingerprint mismatch (recorded "
                                 f"{_short(cert.result)}, replayed {_short(got)})")
    final_syms = size_symbols(program)
    if sorted(cert.symbolic) != sorted(final_syms):
        raise CheckFailure(None, f"symbolic sizes {sorted(cert.symbolic)} are not those of the "
                                 f"final program {sorted(final_syms)}")
    unused = sorted(set(cert.tiles) - (seen - axes))
    if unused:
        raise CheckFailure(None, f"tiles: {', '.join(unused)} is bound but no step introduces it")
    return original, programs


def dtype_disagreement(diagram, dtype: str) -> str:
    """Why a certificate's ``dtype`` is not the one its algorithm's diagram is at ("" when
    it is): the narrowest floating input must be at that dtype (a builder that ignores the
    dtype it is asked for makes the same diagram at every dtype, so the fingerprint alone
    cannot tell an edited dtype)."""
    narrowest_in = narrowest_of(ob.type.dtype for ob in diagram.dom.inside)
    if narrowest_in is None or narrowest_in == dtype:
        return ""
    return (f"dtype: the certificate says {dtype}, but its algorithm's diagram takes "
            f"{narrowest_in} inputs (a certificate is checked at the dtype it was derived at)")


def _label(cert):
    return spec_label(cert.algorithm)


def _numeric(cert, src, original, programs, given=()):
    """Stage 3; returns the worst relative errors (exact, at the wires' dtypes).  ``given``:
    :func:`reference_runs` from the process that ran a ``from`` file, checked besides."""
    final = programs[-1] if programs else original
    cases = check_cases(cert, programs)
    in_dtypes = [JNP_DTYPES[ob.type.dtype] for ob in original.dom.inside]
    low_rtol = DTYPE_RTOL.get(narrowest(original), RTOL)
    worst = worst_low = 0.0
    with jax.enable_x64(True):
        runs, at_case, given_refs = [], [], []
        try:
            for i, case in enumerate(cases):
                xs, low = _inputs(original, case, np.random.default_rng(i), src.sample,
                                  in_dtypes)
                runs.append((case.env, xs, low, src.reference is not None))
                at_case.append(case)
                given_refs.append(None)
            for i, xs, ref in _given_runs(given, cases, original, in_dtypes):
                low = [jnp.asarray(x, dt) for x, dt in zip(xs, in_dtypes)]
                runs.append((cases[i].env, xs, low, False))
                at_case.append(cases[i])
                given_refs.append(ref)
            results = _run_all(original, final, src.reference, runs)
        except CheckFailure:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to evaluate is a failed check
            raise CheckFailure(None, f"numeric check: evaluation failed at "
                                     f"{'; '.join(f'{c.what} {c.env}' for c in cases)}: "
                                     f"{type(e).__name__}: {_first_line(e)}") from None
        results = [(w, o, ref if ref is not None else g, dl) for (w, o, ref, dl), g
                   in zip(results, given_refs)]
        for case, (env, xs, _, _), (want, got, ref, got_low) in zip(at_case, runs, results):
            at = f"{case.what} {case.env}"
            err = _rel_error(got, want)
            if err > RTOL:
                step, rule = _first_bad_step(cert, programs, want, xs, env)
                raise CheckFailure(step, f"numeric check failed at {at}: the program after this "
                                         f"step differs from the algorithm's diagram (relative "
                                         f"error {err:.2e} > {RTOL:g})", rule)
            worst = max(worst, err)
            if ref is not None:
                err = _rel_error(got, ref)
                if err > RTOL:
                    ref_err = _rel_error(want, ref)
                    whose = ("the algorithm's diagram itself disagrees with its reference "
                             f"(relative error {ref_err:.2e})" if ref_err > RTOL else
                             "the final program")
                    raise CheckFailure(None, f"numeric check failed at {at}: the final program "
                                             f"differs from the reference (relative error "
                                             f"{err:.2e} > {RTOL:g}); {whose}")
                worst = max(worst, err)
            err = _rel_error(got_low, want)
            if err > low_rtol:
                raise CheckFailure(None, f"numeric check at the wires' dtypes failed at {at}: "
                                         f"the final program, run at its dtypes, is off the "
                                         f"algorithm's exact value by relative error {err:.2e} "
                                         f"> {low_rtol:g} (the tolerance for "
                                         f"{narrowest(original)})")
            worst_low = max(worst_low, err)
    return worst, worst_low


def _given_runs(given, cases, original, in_dtypes):
    """The runs another process handed back, each checked to be inputs of the right shapes
    and kinds for one of the checker's own cases (anything else fails the check)."""
    for i, xs, ref in given:
        if not (type(i) is int and 0 <= i < len(cases)) or len(xs) != len(in_dtypes):
            raise CheckFailure(None, "numeric check: the process that ran the algorithm's "
                                     "file handed back inputs for no case the checker runs")
        want = sample(original, cases[i].sizes, np.random.default_rng(0))
        for x, w in zip(xs, want):
            if x.shape != w.shape or x.dtype.kind not in "biuf" or \
                    (x.dtype.kind == "f") != (w.dtype.kind == "f"):
                raise CheckFailure(None, f"numeric check: the algorithm's own sampler gave an "
                                         f"input of shape {x.shape} ({x.dtype}) where the "
                                         f"diagram takes {w.shape} ({w.dtype})")
        yield i, [np.asarray(x, np.float64) if x.dtype.kind == "f" else x for x in xs], ref


def _first_line(e) -> str:
    return " ".join(str(e).split("\n")[0].split())[:300]


def _first_bad_step(cert, programs, want, xs, env):
    for i, p in enumerate(programs, 1):
        try:
            err = _rel_error(_run(p, env, xs), want)
        except Exception:  # noqa: BLE001 - a program that does not evaluate is wrong
            err = float("inf")
        if err > RTOL:
            return i, cert.steps[i - 1].rule
    return None, None


def check_certificate(cert, *, numeric: bool = True, name: str = "", prebuilt=None,
                      given=()) -> CheckReport:
    """Re-verify a certificate (a :class:`Certificate`, a dict, JSON text or a path).

    In the calling process: a ``{"from": "FILE:NAME"}`` certificate runs FILE's
    code here, where it can change anything (rules, tolerances, later checks) —
    unless ``prebuilt`` holds its diagram as data, built elsewhere
    (napkin.certify.certificate.build_entry), with ``given`` that process's
    :func:`reference_runs`.  ``napkin check`` (napkin.certify.isolate) does so: the
    file runs in a process of its own, and the judging one never imports it."""
    t0 = time.perf_counter()
    try:
        if isinstance(cert, Path) or (isinstance(cert, str) and not cert.lstrip().startswith("{")):
            name = name or Path(cert).name
            cert = Certificate.load(cert)
        elif isinstance(cert, str):
            cert = Certificate.from_json(cert)
        elif isinstance(cert, dict):
            cert = Certificate.from_dict(cert)
    except (CertificateError, OSError) as e:
        return CheckReport(False, name, getattr(e, "step", None), None,
                           f"malformed certificate: {e}", seconds=time.perf_counter() - t0)
    name = name or _label(cert)
    report = CheckReport(False, name, n_steps=len(cert.steps))
    try:
        try:
            src = load_algorithm(cert.algorithm, cert.origin, prebuilt)
        except NapkinError as e:
            raise CheckFailure(0, f"algorithm: {e}") from None
        original, programs = replay(cert, src)
        if numeric:
            report.max_error, report.dtype_error = _numeric(cert, src, original, programs,
                                                            given)
            report.dtype = narrowest(original)
        report.ok = True
    except CheckFailure as f:
        report.step, report.rule, report.reason, report.line = f.step, f.rule, f.reason, f.line
    except Exception as e:  # noqa: BLE001 - a checker reports, it does not crash
        report.reason = f"internal error while checking: {type(e).__name__}: {e}"
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["CheckReport", "DTYPE_RTOL", "RTOL", "check_cases", "check_certificate",
           "reference_runs"]
