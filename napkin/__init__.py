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
from napkin.core.errors import CompositionError, NapkinError, RuleError, ShapeError

# Everything else is imported when first used (PEP 562): ``import napkin`` — and the command
# line, whose Ctrl-C is then one line from the start — costs no DisCoPy, JAX or sympy.
_WHERE = {
    "ArrayType": "napkin.core.arrays", "Axis": "napkin.core.arrays", "axes": "napkin.core.arrays",
    "wire": "napkin.core.arrays", "Diagram": "napkin.core.diagram", "Id": "napkin.core.diagram",
    "evaluate": "napkin.core.semantics", "grad": "napkin.frontend.grad",
    "from_jax": "napkin.frontend.jaxpr", "Array": "napkin.frontend.trace",
    "algorithm": "napkin.frontend.trace", "trace": "napkin.frontend.trace",
    "weave": "napkin.frontend.weave", "optimize": "napkin.pipeline",
    "Optimized": "napkin.pipeline", "jit": "napkin.pipeline",
}

__all__ = [
    "Array", "ArrayType", "Axis", "CompositionError", "Diagram", "Id", "NapkinError",
    "Optimized", "RuleError", "ShapeError", "algorithm", "axes", "evaluate", "from_jax", "grad",
    "jit", "ops", "optimize", "trace", "wire", "weave",
]


def __getattr__(name):
    import importlib
    if name == "ops":  # napkin.ops: the primitive operations
        return importlib.import_module("napkin.frontend.ops")
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'napkin' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE) | {"ops"})
