"""Compile a lowered kernel's Triton IR to PTX on any machine (needs ``triton``).

``export_cuda`` stops at the Triton IR that XLA would compile on a GPU.  With
the ``triton`` package (a dev dependency: it bundles ptxas, no GPU needed)
:func:`compile_ptx` takes that IR through Triton's own pipeline for an sm_90
target — make_ttir's clean-up passes, layouts, shared-memory allocation, PTX,
ptxas — so errors that only the Triton compiler sees (unsupported shapes, too
much shared memory) show up on a CPU too, with the registers and spills ptxas
reports.  XLA builds its own Triton, so this is an estimate of the GPU's
compiler, not the same binary.

Only a matching pair parses: each jaxlib writes the Triton IR of the Triton it
was built with, and another Triton's MLIR parser rejects it ("expected
mlir::BoolAttr").  :func:`check_pair` says which triton to install instead.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import re
import tempfile
from dataclasses import dataclass

from napkin.core.errors import NapkinError

SHARED_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use
# jaxlib minor version -> the triton minor version whose parser reads its Triton IR (checked
# by hand: triton 3.9 rejects 0.11's IR, 3.8 rejects 0.12's, 3.6 rejects both)
TRITON_FOR_JAXLIB = {"0.11": "3.8", "0.12": "3.9"}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def versions() -> tuple[str, str | None]:
    """(jaxlib version, triton version or None when triton is not installed)."""
    try:
        import triton
    except ImportError:
        return importlib.metadata.version("jaxlib"), None
    return importlib.metadata.version("jaxlib"), triton.__version__


def check_pair(jaxlib: str, triton: str | None) -> None:
    """A NapkinError unless ``triton`` can read the Triton IR that ``jaxlib`` writes."""
    want = TRITON_FOR_JAXLIB.get(_minor(jaxlib))
    if want is None:
        known = ", ".join(f"jaxlib {j} with triton {t}" for j, t in TRITON_FOR_JAXLIB.items())
        raise NapkinError(f"jaxlib {jaxlib}: napkin does not know which triton reads its Triton "
                          f"IR (known pairs: {known}); install one of those jax versions")
    if triton is None:
        raise NapkinError(f"compiling to PTX needs triton {want} (it reads jaxlib {jaxlib}'s "
                          f"Triton IR): pip install 'triton=={want}.*'")
    if _minor(triton) != want:
        raise NapkinError(f"triton {triton} cannot read the Triton IR of jaxlib {jaxlib} (only "
                          f"triton {want} can): pip install 'triton=={want}.*'")


@dataclass(frozen=True)
class CompiledKernel:
    """What Triton and ptxas made of one ``__gpu$xla.gpu.triton`` call."""
    name: str
    arch: int
    shared: int        # bytes of shared memory per block (Triton's allocation)
    registers: int     # per thread (ptxas -v)
    spills: int        # bytes of spill stores per thread (ptxas -v)
    num_warps: int
    num_stages: int
    dots: int          # dots in the TTGIR
    fma_dots: int      # of which on CUDA cores: a tt.dot whose result has a #blocked layout
    ttgir: str
    ptx: str

    @property
    def tensor_cores(self) -> bool:
        """Every dot runs on tensor cores (wgmma / mma), none as FMAs."""
        return self.fma_dots == 0


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


def compile_ptx(kernel, shapes, arch: int = 90, device_kind: str = "NVIDIA H100", *,
                check_shared: bool = True) -> list[CompiledKernel]:
    """Compile the kernel for ``sm_{arch}`` with the ``triton`` package: one
    :class:`CompiledKernel` per Triton call.  Raises NapkinError when triton is
    missing or does not match jaxlib (before parsing anything), when compilation
    fails, or (``check_shared``) when shared memory exceeds :data:`SHARED_LIMIT`."""
    check_pair(*versions())
    parts = kernel.parts(shapes)
    if len(parts) > 1:  # a program of several kernels: each compiled on its own
        return [c for k, s in parts for c in compile_ptx(k, s, arch, device_kind,
                                                          check_shared=check_shared)]
    from napkin.lower.kernel import export_cuda
    try:
        mlir = export_cuda(kernel, shapes, device_kind)
    except NapkinError:
        raise
    except Exception as e:  # noqa: BLE001 — JAX's Triton lowering refused it: say so, keep why
        raise NapkinError(f"Pallas could not lower {kernel.name} for CUDA: {_first_line(e)}"
                          ) from e
    launch = kernel.plan(*shapes).launch  # as written ("auto" resolved)
    results = [_compile(code, kernel, arch, launch) for code in triton_modules(mlir)]
    over = [c.shared for c in results if c.shared > SHARED_LIMIT]
    if check_shared and over:
        raise NapkinError(f"{kernel.name} needs {over[0]} bytes of shared memory per block "
                          f"(limit {SHARED_LIMIT}): use smaller tiles")
    return results


def compile_exported(mlir_text: str, name: str, launch: dict, arch: int = 90
                     ) -> list[CompiledKernel]:
    """Compile every Triton call of a CUDA export made elsewhere (JAX's own Pallas ops,
    for a parity check) as :func:`compile_ptx` compiles napkin's: ``launch`` holds the
    num_warps and num_stages it was exported with."""
    check_pair(*versions())
    named = type("Exported", (), {"name": name})()
    return [_compile(code, named, arch, launch) for code in triton_modules(mlir_text)]


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _compile(code: bytes, kernel, arch: int, launch: dict) -> CompiledKernel:
    """Triton's whole pipeline from make_ttir on.  ``triton.compile`` of a ``.ttir`` file
    would start after make_ttir, skipping canonicalize/combine/CSE (which XLA runs), and
    overstate registers and spills; so the backend's own stages run here, in order, with
    the ptxas log of the last one kept."""
    from triton import knobs
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget, Language
    from triton.compiler.compiler import make_backend
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # FMA contraction on, as CUDA and every triton so far default to (3.9 warns when unset)
    options = backend.parse_options({"num_warps": launch["num_warps"],
                                     "num_stages": launch["num_stages"],
                                     "enable_fp_fusion": True})
    stages: dict = {}
    backend.add_stages(stages, options, Language.TRITON)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    metadata = {"target": target, **options.__dict__}
    asm, log, step = {}, io.StringIO(), "parse"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.mlirbc")
            with open(path, "wb") as f:
                f.write(code)
            module = ir.parse_mlir_module(path, ctx)
        module.context = ctx  # as triton.compile sets it on a parsed module: the passes need it
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # printed by the cubin stage
            for step, stage in stages.items():
                module = stage(module, metadata)
                # as text now: the next stage lowers an MLIR module in place
                asm[step] = module if isinstance(module, (str, bytes)) else str(module)
    except Exception as e:  # noqa: BLE001 — say which kernel and step, keep the reason
        raise NapkinError(f"Triton could not compile {kernel.name} for sm_{arch} ({step} "
                          f"step): {_first_line(e)}") from e
    ptxas = log.getvalue()
    regs = re.search(r"Used (\d+) registers", ptxas)
    if regs is None:
        raise NapkinError(f"no ptxas log for {kernel.name}: this triton's cubin stage does not "
                          f"print it (TRITON_DUMP_PTXAS_LOG); use the triton pinned in "
                          f"pyproject.toml's dev extra")
    spills = re.search(r"(\d+) bytes spill stores", ptxas)
    ttgir = asm["ttgir"]
    dots = re.findall(r"= (?:tt\.dot|ttng\.warp_group_dot) .*", ttgir)
    return CompiledKernel(
        name=kernel.name, arch=arch, shared=int(metadata["shared"]), registers=int(regs[1]),
        spills=int(spills[1]) if spills else 0, num_warps=int(metadata["num_warps"]),
        num_stages=int(metadata["num_stages"]), dots=len(dots),
        fma_dots=sum(bool(re.search(r"->\s*tensor<[^>]*#blocked", d)) for d in dots),
        ttgir=ttgir, ptx=asm["ptx"])
