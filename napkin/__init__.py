"""napkin: deep-learning algorithms as string diagrams, rewritten into streamed kernels.

Pipeline: diagrams (arrays, primitives, trace) → rules (rewrites/) → search →
certificates (checked) → lowering (Pallas), all in one call: ``napkin.optimize``.
This package root re-exports the user-facing core.

Layout, down the pipeline: ``core`` (arrays, diagrams, primitives, semantics) ·
``frontend`` (trace, ops, weave, the library, from_jax) · rules and proofs (the top-level
packages ``rewrites`` and ``proofs``) · ``search`` · ``certify`` (certificates, the
checker) · ``schedule`` (the loop nest) · ``cost`` (a fold over it) · ``hardware`` ·
``lower`` (kernels) · ``views`` (pseudocode, drawings) · ``pipeline`` · ``cli``.
"""
from napkin.core.arrays import ArrayType, Axis, axes, wire
from napkin.core.diagram import Diagram, Id
from napkin.core.errors import CompositionError, NapkinError, RuleError, ShapeError
from napkin.core.semantics import evaluate
from napkin.frontend import ops  # noqa: F401  (napkin.ops: the primitive operations)
from napkin.frontend.grad import grad
from napkin.frontend.jaxpr import from_jax
from napkin.frontend.trace import Array, algorithm, trace
from napkin.frontend.weave import weave

__all__ = [
    "Array", "ArrayType", "Axis", "CompositionError", "Diagram", "Id", "NapkinError",
    "Optimized", "RuleError", "ShapeError", "algorithm", "axes", "evaluate", "from_jax", "grad",
    "jit", "optimize", "trace", "wire", "weave",
]


def __getattr__(name):
    """``napkin.optimize`` and ``napkin.Optimized`` (napkin.pipeline), and ``napkin.jit``
    (napkin.pipeline), imported when first used: the pipeline pulls in the search, the cost
    model and the lowering."""
    if name in ("optimize", "Optimized"):
        from napkin import pipeline
        return getattr(pipeline, name)
    if name == "jit":
        from napkin.pipeline import jit
        return jit
    raise AttributeError(f"module 'napkin' has no attribute {name!r}")
