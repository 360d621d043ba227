"""Proofs of the rewrite rules: one module per rule, named by the rule's
``proof`` attribute (``rewrites.RULES`` and ``rewrites.STREAMABILITY``).

Each module's docstring is the human-readable proof (the statement, and the
argument that carries its finite checks to every size); its ``prove()``
returns a :class:`ProofResult` listing the obligations it checked (symbolic,
with the SYMPY backend on the rule's own diagrams; numeric, through
``napkin.core.semantics.evaluate``; premises enforced).

* :func:`prove_all` — one result per rule; a rule whose proof module is
  missing, or lacks ``prove``, or whose proof raises, is a failed result.
* :func:`prove_derivatives` — every primitive's reverse derivative (``Spec.vjp``,
  proofs/vjp.py), one result per primitive and configuration.
* :func:`prove_wrong` — wrong accumulators (softmax without the rescale, max
  with a sum accumulator) and wrong recognitions (a softmax whose max and sum
  reduce different axes, a logsumexp without the + m, …) run through the same
  checkers: all must fail.

Modules are imported by package name only (``importlib``), so this works from
an installed package in any folder.
"""
from __future__ import annotations

import importlib
import time

from proofs._core import Obligation, ProofResult, format_results

__all__ = ["Obligation", "ProofResult", "all_rules", "format_results", "prove_all",
           "prove_derivatives", "prove_rule", "prove_wrong"]


def all_rules() -> list:
    """Every rule that needs a proof: the rewrites, then the accumulators."""
    from rewrites import RULES, STREAMABILITY
    return list(RULES.values()) + list(STREAMABILITY)


def _failure(rule_name: str, module: str, description: str, detail: str,
             seconds: float = 0.0) -> ProofResult:
    return ProofResult(rule_name, [Obligation(description, False, detail, "structure")], module,
                       "", round(seconds, 3))


def _prove_module(module: str, rule_name: str) -> ProofResult:
    t = time.perf_counter()
    if not isinstance(module, str) or not module.startswith("proofs.") or module == "proofs.":
        return _failure(rule_name, str(module), "the rule names a proof module under proofs/",
                        f"proof attribute is {module!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) == module
        return _failure(rule_name, module, f"proof module {module} exists",
                        (f"no module {module}" if missing else
                         f"{module} fails to import: {type(e).__name__}: {e}"),
                        time.perf_counter() - t)
    except Exception as e:
        return _failure(rule_name, module, f"proof module {module} imports",
                        f"{type(e).__name__}: {e}", time.perf_counter() - t)
    prove = getattr(mod, "prove", None)
    if not callable(prove):
        return _failure(rule_name, module, f"{module} defines prove()", "no prove() function",
                        time.perf_counter() - t)
    try:
        result = prove()
    except Exception as e:
        return _failure(rule_name, module, f"{module}.prove() runs",
                        f"{type(e).__name__}: {e}", time.perf_counter() - t)
    if not isinstance(result, ProofResult):
        return _failure(rule_name, module, f"{module}.prove() returns a ProofResult",
                        f"got {type(result).__name__}", time.perf_counter() - t)
    return result


def prove_rule(rule, cache: dict | None = None) -> ProofResult:
    """The proof of one rule (any object with ``name`` and ``proof``)."""
    module = getattr(rule, "proof", "")
    name = getattr(rule, "name", "") or type(rule).__name__
    cache = {} if cache is None else cache
    if module not in cache:
        cache[module] = _prove_module(module, name)
    base = cache[module]
    return ProofResult(name, list(base.obligations), base.module or str(module), base.statement,
                       base.seconds)


def prove_all(rules=None) -> list[ProofResult]:
    """One ProofResult per rule (default: every rule of ``rewrites``); a
    module shared by several rules (head_grouping uses group_partition's)
    runs once."""
    cache: dict = {}
    return [prove_rule(r, cache) for r in (all_rules() if rules is None else rules)]


def prove_derivatives() -> list[ProofResult]:
    """One ProofResult per primitive configuration: its vjp against sympy's derivative and
    jax.vjp (proofs/vjp.py)."""
    from proofs.vjp import prove_each
    return prove_each()


def prove_wrong() -> list[ProofResult]:
    """The negative checks: every result must be not ok (the wrong accumulators, the
    wrong recognition entries of proofs.recognize, the wrong derivatives of proofs.vjp)."""
    from proofs.recognize import prove_wrong as recognitions
    from proofs.vjp import prove_wrong as derivatives
    from proofs.wrong_variants import prove_wrong as run
    return run() + recognitions() + derivatives()
