"""A kernel's memory as modelled and as allocated, side by side (``napkin lower --report``).

Modelled: the schedule (``napkin.schedule.build``, with the kernel's pipeline stages) at the
concrete sizes and tiles, per level — its peak bytes, and the buffers declared at that level
(read off the schedule's items: the Buffers it declares and the Steps' outputs) — and the
launch model's block (``napkin.cost.launch``): the shared memory it stages and the registers
of data per thread.  Allocated: what Triton and ptxas made of the lowered kernel
(:func:`napkin.lower.ptx.compile_ptx`) — shared memory beside the block's, with the ratio
allocated/modelled, and registers and spills beside the registers per thread.
Without a matching triton the allocated side is one line saying why.  A Mosaic GPU kernel
sets the schedule beside its CUDA export instead (:func:`mosaic_report`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from napkin.cost.model import value_at
from napkin.core.errors import NapkinError
from napkin.lower.ptx import SHARED_LIMIT, CompiledKernel, compile_ptx, versions
from napkin.schedule import Buffer, Schedule, Step


@dataclass
class Level:
    """One level of the schedule at concrete sizes: its peak and the buffers declared there."""
    name: str
    peak: int
    buffers: list = field(default_factory=list)  # (name, dtype[axis=n, ...], role, bytes)


def modelled(schedule: Schedule, env: dict) -> list[Level]:
    """The schedule's levels at ``env`` (axis and tile sizes by name), top first."""
    levels = {lv: Level(lv, int(max(value_at(b, env) for b in byts)))
              for lv, (_, byts) in schedule.memory.items()}
    seen: set = set()
    for item, _ in schedule.walk():
        bufs = [item] if isinstance(item, Buffer) else \
            [b for b in item.outs if b is not None] if isinstance(item, Step) else []
        for b in bufs:
            # a step's "next" output is its state's own buffer, updated in place
            if not b.declared or b.role == "next" or id(b) in seen:
                continue
            seen.add(id(b))
            shape = ", ".join(f"{a}={int(value_at(n, env))}" for a, n in b.axes)
            role = b.note or b.role
            if b.in_place_of is not None:
                role += f", in place of {b.in_place_of.name}"
            if b.stages > 1:
                role += f", {b.stages} stages"
            levels[b.level].buffers.append((b.name, f"{b.dtype}[{shape}]", role,
                                            int(value_at(b.bytes, env)) * b.stages))
    return list(levels.values())


def allocated(kernel, shapes) -> list[CompiledKernel] | str:
    """Triton's compilation of the kernel for sm_90, or one line saying why there is none."""
    try:
        return compile_ptx(kernel, shapes, check_shared=False)
    except NapkinError as e:
        return str(e)


def report(kernel, schedule: Schedule, sizes: dict, shapes) -> str:
    """The schedule's buffers per level beside what the compiler allocated for ``kernel``
    (a LoweredKernel of the schedule's program; ``shapes``: its input shapes)."""
    env = {**sizes, **{str(t): v for t, v in kernel.tiles.items()}}
    spec = kernel.plan(*shapes)
    if getattr(getattr(spec, "written", None), "backend", "") == "mosaic":
        return mosaic_report(kernel, schedule, env, shapes, spec)
    compiled = allocated(kernel, shapes)
    tiles = ", ".join(f"{t}={v}" for t, v in kernel.tiles.items()) or "none"
    lines = [f"{kernel.name}: tiles {tiles}; modelled by the schedule on "
             f"{schedule.hardware.name}, {schedule.dtype or 'own dtypes'}"]
    if isinstance(compiled, str):
        lines.append(f"allocated: not compiled: {compiled}")
        compiled = []
    else:
        lines.append(f"allocated by triton {versions()[1]} for sm_{compiled[0].arch}: "
                     + "; ".join(_launch(c) for c in compiled))
    rows = [("level", "buffer", "shape", "role", "modelled B", "allocated")]
    launch = launched(schedule, env, kernel.plan(*shapes).launch)
    for lv in modelled(schedule, env):
        rows.append((lv.name, "peak", "", "", f"{lv.peak:,}", ""))
        if lv.name == "smem" and launch:  # what a block stages, beside what Triton allocated
            rows.append(("", "per block", "", "staged for the tensor cores",
                         f"{launch['smem']:,}", "; ".join(_shared(launch['smem'], c)
                                                          for c in compiled)))
        rows += [("", name, shape, role, f"{nbytes:,}", "")
                 for name, shape, role, nbytes in lv.buffers]
    if launch:
        rows.append(("registers", "per thread", "", f"at {launch['warps']} warps",
                     f"{launch['registers']} regs", "; ".join(_registers(c) for c in compiled)))
    return "\n".join(lines + [_table(rows)])


def mosaic_report(kernel, schedule: Schedule, env: dict, shapes, spec) -> str:
    """A Mosaic GPU kernel: the schedule's levels beside the kernel Mosaic lowered (its CUDA
    export, read on this machine): shared memory as the backend lays it out and as exported,
    the consumer warpgroups' registers, the wgmma instructions and TMA copies."""
    from napkin.lower.kernel import export_cuda
    from napkin.lower.mosaic_module import ModuleFacts, mosaic_module
    tiles = ", ".join(f"{t}={v}" for t, v in kernel.tiles.items()) or "none"
    lines = [f"{kernel.name}: tiles {tiles}; modelled by the schedule on "
             f"{schedule.hardware.name}, {schedule.dtype or 'own dtypes'}; "
             f"written by Mosaic GPU: {'; '.join(spec.written.notes)}"]
    try:
        facts = ModuleFacts.read(mosaic_module(export_cuda(kernel, shapes,
                                                           "NVIDIA H200")))
    except NapkinError as e:
        facts = None
        lines.append(f"exported: not read: {e}")
    smem = spec.written.smem
    laid_out = ", ".join(f"{p} {b:,}" for p, b in smem.items() if b)
    rows = [("level", "buffer", "shape", "role", "modelled B", "Mosaic")]
    for lv in modelled(schedule, env):
        rows.append((lv.name, "peak", "", "", f"{lv.peak:,}", ""))
        if lv.name == "smem":
            shown = f"{facts.shared_memory:,} B exported" if facts else ""
            rows.append(("", "per block", "", "laid out by the backend",
                         f"{sum(smem.values()):,}", f"{shown} ({laid_out})"))
        rows += [("", name, shape, role, f"{nbytes:,}", "")
                 for name, shape, role, nbytes in lv.buffers]
    if facts:
        regs = ", ".join(f"{k} {n}" for k, n in facts.setmaxnreg) or "not set (no pipeline)"
        rows.append(("registers", "per thread", "", f"{facts.threads // 128} warpgroups",
                     "", f"setmaxnreg {regs}"))
        rows.append(("tensor cores", "wgmma", "", "", "", ", ".join(facts.wgmma_kinds)))
        rows.append(("TMA", "copies", "", "", "", f"{facts.tma_loads} loads, "
                                                  f"{facts.tma_stores} stores"))
    return "\n".join(lines + [_table(rows)])


def launched(schedule: Schedule, env: dict, launch: dict) -> dict:
    """The launch model's block at ``env`` for a kernel written with ``launch``: its shared
    memory (tiles and chunks a matrix product reads, a chunk per stage) and its registers
    of data per thread (``napkin.cost.launch``); {} for a program of several kernels."""
    from napkin.schedule.resources import kernels
    ks = kernels(schedule)
    if len(ks) != 1 or not isinstance(launch.get("num_warps"), int):
        return {}
    (k,) = ks
    ev = lambda e: value_at(e, env)  # noqa: E731
    warps = launch["num_warps"]
    return {"smem": int(k.smem_bytes(ev, int(launch.get("num_stages", 1)))), "warps": warps,
            "registers": math.ceil(k.registers_per_thread(ev, warps))}


def _launch(c: CompiledKernel) -> str:
    dots = f"{c.dots} dot{'s' * (c.dots != 1)}"
    where = ("none on tensor cores" if c.fma_dots == c.dots else "all on tensor cores"
             if c.tensor_cores else f"{c.dots - c.fma_dots} on tensor cores, {c.fma_dots} on "
             f"CUDA cores (FMA)")
    return f"{c.name}, {c.num_warps} warps, {c.num_stages} stages, {dots}: {where}"


def _shared(modelled: int, c: CompiledKernel) -> str:
    ratio = f" = {c.shared / modelled:.2f}x modelled" if modelled else ""
    over = f", over the {SHARED_LIMIT:,} B limit" if c.shared > SHARED_LIMIT else ""
    return f"shared {c.shared:,} B{ratio}{over}"


def _registers(c: CompiledKernel) -> str:
    per_block = c.registers * 4 * 32 * c.num_warps
    return f"{c.registers} registers/thread ({per_block:,} B per block), spills {c.spills:,} B/thread"


def _table(rows) -> str:
    """Aligned columns; the byte column right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i == 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)
