"""Lowering streamed programs to JAX Pallas kernels: a backend-neutral plan, spelled by a backend.

``lower(program, tiles)`` → :class:`LoweredKernel` (a JAX function: jit, vmap,
interpret mode on a CPU); ``export_cuda`` lowers it for an H100/H200 on any
machine; ``hbm_bytes`` counts the bytes it moves through HBM, read off the
kernel's own jaxpr; ``compile_ptx`` (needs the ``triton`` of the dev extra)
compiles it to PTX for sm_90 on any machine, and ``napkin.lower.report`` sets
what Triton allocated beside the schedule's buffers.  See napkin/lower/kernel.py for the scheme,
napkin/lower/plan.py for the plan and napkin/lower/backends/ for the backends (triton).
"""
from napkin.lower.kernel import LoweredKernel, export_cuda
from napkin.lower.program import LoweredProgram, lower
from napkin.lower.plan import KernelPlan
from napkin.lower.ptx import CompiledKernel, compile_ptx
from napkin.lower.traffic import Traffic, hbm_bytes, traffic

__all__ = ["CompiledKernel", "KernelPlan", "LoweredKernel", "LoweredProgram", "Traffic", "compile_ptx",
           "export_cuda", "hbm_bytes", "lower", "traffic"]
