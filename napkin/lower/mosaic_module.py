"""Reading a Mosaic GPU kernel's CUDA export on any machine (the Mosaic counterpart of
``napkin.lower.ptx``): the module inside the ``mosaic_gpu_v2`` custom call, as MLIR text, and
what it does on the GPU — its dynamic shared memory, wgmma instructions, TMA copies,
``setmaxnreg`` and threads (:class:`ModuleFacts`).  Mosaic lowers a kernel fully when it is
exported, so these are the GPU's facts, read on a CPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from napkin.core.errors import NapkinError


def mosaic_module(mlir_text: str) -> str:
    """The Mosaic GPU module (as MLIR text) inside an exported program's ``mosaic_gpu_v2``
    custom call: the kernel as it goes to ptxas, with its wgmma, TMA and setmaxnreg."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir, passmanager
    ctx = jmlir.make_ir_context()
    mosaic_gpu_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()  # (gpu, nvvm, llvm: jax 0.11 loads them lazily)
    with ctx:
        ctx.allow_unregistered_dialects = True
        outer = ir.Module.parse(mlir_text)
        blobs = []

        def visit(op):
            if op.name == "stablehlo.custom_call" and \
                    ir.StringAttr(op.attributes["call_target_name"]).value == "mosaic_gpu_v2":
                config = ir.DictAttr(op.attributes["mhlo.backend_config"])
                blobs.append(ir.StringAttr(config["module"]).value_bytes)
            return ir.WalkResult.ADVANCE
        outer.operation.walk(visit)
        if not blobs:
            raise NapkinError("the CUDA export holds no Mosaic GPU kernel")
        texts = []
        for blob in blobs:
            try:
                inner = ir.Module.parse(blob)
            except ir.MLIRError as e:  # jaxlib 0.11's bindings do not read their own gpu attrs
                import jaxlib
                raise NapkinError(f"cannot read the Mosaic GPU module with jaxlib "
                                  f"{jaxlib.__version__} ({str(e).splitlines()[1].strip()}); "
                                  f"jaxlib 0.12 reads it") from None
            passmanager.PassManager.parse(
                "builtin.module(mosaic_gpu-serde{serialize=false})").run(inner.operation)
            texts.append(str(inner))
    return "\n".join(texts)


@dataclass(frozen=True)
class ModuleFacts:
    """What an exported Mosaic GPU kernel does on the GPU, read from its module."""
    shared_memory: int        # dynamic shared memory per block, bytes
    wgmma: int                # wgmma.mma_async instructions
    tma_loads: int            # cp.async.bulk.tensor global -> shared copies
    tma_stores: int           # cp.async.bulk.tensor shared -> global copies
    setmaxnreg: tuple         # the register counts set (("dec", "40"), ("inc", "232"))
    threads: int
    wgmma_kinds: tuple = ()   # the distinct wgmma instructions (shape and operand types)
    approx_exp: int = 0       # ex2.approx: exp2 on the special-function unit (approx_math)
    arrivals: int = 0         # plain barrier arrivals (no TMA byte count): consumers' signals
    waits: int = 0            # barrier waits (mbarrier.try_wait)
    mma_waits: int = 0        # wgmma.wait_group: where a consumer waits for its products
    wait_groups: tuple = ()   # each wait_group's N (at most N groups left in flight), in order

    @classmethod
    def read(cls, module: str) -> ModuleFacts:
        smem = re.findall(r"dynamic_shared_memory_size %c(\d+)_i32", module)
        threads = re.findall(r"threads\([^)]*\) in \(%\w+ = %c(\d+)", module)
        return cls(int(smem[0]) if smem else 0,
                   len(re.findall(r"wgmma\.mma_async", module)),
                   # TMA: tensor copies (cp.async.bulk.tensor.Nd) and 1-D bulk copies
                   len(re.findall(r"cp\.async\.bulk\.(?:tensor\.\dd\.)?shared::(?:cta|cluster)"
                                  r"\.global", module)),
                   len(re.findall(r"cp\.async\.bulk\.(?:tensor\.(?:\dd\.)?)?global\.shared",
                                  module)),
                   tuple(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)", module)),
                   int(threads[0]) if threads else 0,
                   tuple(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)",
                                               module)))),
                   len(re.findall(r"ex2\.approx", module)),
                   len(re.findall(r"mbarrier\.arrive\.release", module)),
                   len(re.findall(r"mbarrier\.try_wait", module)),
                   len(re.findall(r"wgmma\.wait_group", module)),
                   tuple(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)",
                                                    module)))
