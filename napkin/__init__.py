"""napkin: deep-learning algorithms as string diagrams, rewritten into streamed kernels.

Pipeline: diagrams (arrays, primitives, trace) → rules (rewrites/) → search →
certificates (checked) → lowering (Pallas).  This package root re-exports the
user-facing core.
"""
from napkin.arrays import ArrayType, Axis, axes, wire
from napkin.diagram import Diagram, Id
from napkin.errors import CompositionError, NapkinError, RuleError, ShapeError
from napkin.semantics import evaluate
from napkin.trace import Array, algorithm, trace
from napkin.weave import weave

__all__ = [
    "Array", "ArrayType", "Axis", "CompositionError", "Diagram", "Id", "NapkinError",
    "RuleError", "ShapeError", "algorithm", "axes", "evaluate", "trace", "wire", "weave",
]
