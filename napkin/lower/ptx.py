"""Compile a lowered kernel's Triton IR to PTX on any machine (optional).

``export_cuda`` stops at the Triton IR that XLA would compile on a GPU.  With
the ``triton`` package installed (``pip install triton``: it bundles ptxas, no
GPU needed) :func:`compile_ptx` takes that IR through Triton's own pipeline for
an sm_90 target — layouts, shared-memory allocation, PTX — so errors that only
the Triton compiler sees (unsupported tensor shapes, too much shared memory)
show up on a CPU too.  XLA builds its own Triton, so this is an estimate of
the GPU's compiler, not the same binary.
"""
from __future__ import annotations

import os
import tempfile

from napkin.errors import NapkinError

SHARED_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use


def triton_modules(mlir_text: str) -> list[bytes]:
    """The Triton IR (MLIR bytecode) of every ``__gpu$xla.gpu.triton`` call."""
    out, key, i = [], 'ir = "', 0
    while (j := mlir_text.find(key, i)) >= 0:
        k, buf = j + len(key), bytearray()
        while mlir_text[k] != '"':
            c = mlir_text[k]
            if c != "\\":
                buf += c.encode("utf-8")
                k += 1
                continue
            n = mlir_text[k + 1]
            if n in '\\"':
                buf.append(ord(n))
                k += 2
            elif n in "nt":
                buf.append(10 if n == "n" else 9)
                k += 2
            else:
                buf.append(int(mlir_text[k + 1:k + 3], 16))
                k += 3
        out.append(bytes(buf))
        i = k
    return out


def compile_ptx(kernel, shapes, arch: int = 90, device_kind: str = "NVIDIA H100") -> list[dict]:
    """Compile the kernel for ``sm_{arch}`` with the ``triton`` package.

    Returns one dict per Triton call: ``shared`` (bytes of shared memory),
    ``num_warps``, ``num_stages`` and ``ptx`` (text).  Raises NapkinError when
    triton is missing, compilation fails, or shared memory exceeds the limit.
    """
    try:
        import triton
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
    except ImportError:
        raise NapkinError("compile_ptx needs the triton package (pip install triton)") from None
    from napkin.lower.pallas import export_cuda
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, code in enumerate(triton_modules(export_cuda(kernel, shapes, device_kind))):
            bc = os.path.join(tmp, f"k{n}.mlirbc")
            with open(bc, "wb") as f:
                f.write(code)
            ctx = ir.context()
            ir.load_dialects(ctx)
            ttir = os.path.join(tmp, f"k{n}.ttir")
            with open(ttir, "w") as f:
                f.write(str(ir.parse_mlir_module(bc, ctx)))
            try:
                compiled = triton.compile(ttir, target=GPUTarget("cuda", arch, 32),
                                          options=dict(num_warps=kernel.num_warps,
                                                       num_stages=kernel.num_stages))
            except Exception as e:  # noqa: BLE001 — say which kernel, keep the reason
                raise NapkinError(f"Triton could not compile {kernel.name} for sm_{arch}: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                  ) from e
            shared = int(compiled.metadata.shared)
            if shared > SHARED_LIMIT:
                raise NapkinError(f"{kernel.name} needs {shared} bytes of shared memory per "
                                  f"block (limit {SHARED_LIMIT}): use smaller tiles")
            results.append(dict(shared=shared, num_warps=kernel.num_warps,
                                num_stages=kernel.num_stages, ptx=compiled.asm["ptx"]))
    return results
