"""napkin: deep-learning algorithms as string diagrams, rewritten into streamed kernels.

Pipeline: diagrams (arrays, primitives, trace) → rules (rewrites/) → search →
certificates (checked) → lowering (Pallas), all in one call: ``napkin.optimize``.
This package root re-exports the user-facing core.
"""
from napkin.arrays import ArrayType, Axis, axes, wire
from napkin.diagram import Diagram, Id
from napkin.errors import CompositionError, NapkinError, RuleError, ShapeError
from napkin import ops  # noqa: F401  (the primitive operations; arithmetic on traced arrays)
from napkin.jaxpr import from_jax
from napkin.semantics import evaluate
from napkin.trace import Array, algorithm, trace
from napkin.weave import weave

__all__ = [
    "Array", "ArrayType", "Axis", "CompositionError", "Diagram", "Id", "NapkinError",
    "Optimized", "RuleError", "ShapeError", "algorithm", "axes", "evaluate", "from_jax",
    "optimize", "trace", "wire", "weave",
]


def __getattr__(name):
    """``napkin.optimize`` and ``napkin.Optimized`` (napkin.pipeline), imported when first
    used: the pipeline pulls in the search, the cost model and the lowering."""
    if name in ("optimize", "Optimized"):
        from napkin import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'napkin' has no attribute {name!r}")
