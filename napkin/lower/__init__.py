"""Lowering streamed programs to JAX Pallas kernels: a backend-neutral plan, spelled by a backend.

``lower(program, tiles)`` → :class:`LoweredKernel` (a JAX function: jit, vmap,
interpret mode on a CPU); ``export_cuda`` lowers it for an H100/H200 on any
machine; ``hbm_bytes`` counts the bytes it moves through HBM, read off the
kernel's own jaxpr; ``compile_ptx`` (needs the ``triton`` of the dev extra)
compiles it to PTX for sm_90 on any machine, and ``napkin.lower.report`` sets
what Triton allocated beside the schedule's buffers.  See napkin/lower/kernel.py for the scheme,
napkin/lower/plan.py for the plan and napkin/lower/backends/ for the backends (triton).
"""
# imported when first used (PEP 562): the command line reads the backends' names without JAX
_WHERE = {"LoweredKernel": "kernel", "export_cuda": "kernel", "LoweredProgram": "program",
          "lower": "program", "KernelPlan": "plan", "CompiledKernel": "ptx",
          "compile_ptx": "ptx", "Traffic": "traffic", "hbm_bytes": "traffic",
          "traffic": "traffic"}

__all__ = ["CompiledKernel", "KernelPlan", "LoweredKernel", "LoweredProgram", "Traffic", "compile_ptx",
           "export_cuda", "hbm_bytes", "lower", "traffic"]


def __getattr__(name):
    import importlib
    if name in _WHERE:
        return getattr(importlib.import_module(f"napkin.lower.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'napkin.lower' has no attribute {name!r}")
