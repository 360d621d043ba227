"""Which library algorithms the Mosaic GPU backend writes, at the optimiser's own programs and
tiles (bf16, H200, the library's default sizes), and why not where it does not.

    python benchmarks/mosaic_coverage.py          # one line per algorithm, ~2 min

For each: optimise → plan → the backend's refusal or spelling → export for CUDA on this machine
(no GPU needed) → the Mosaic module's shared memory, wgmma and TMA counts, whether its
consumers take turns on the tensor cores, and its barrier arrivals and waits.  A program of
several kernels is checked kernel by kernel.  Written to run on a CPU: it needs no GPU.
"""
from __future__ import annotations

import sys
import time

import napkin
from napkin.core.arrays import array_types
from napkin.core.errors import NapkinError
from napkin.frontend.library import LIBRARY
from napkin.lower.mosaic_module import ModuleFacts, mosaic_module
from napkin.lower.kernel import export_cuda


def check(name: str) -> str:
    r = napkin.optimize(name, hardware="h200", dtype="bf16")
    k = r.kernel("mosaic")
    shapes = [tuple(r.sizes[a.name] for a in t.axes) for t in array_types(r.program.dom)]
    try:
        parts = [(part, s, part.plan(*s)) for part, s in k.parts(shapes)]
    except NapkinError as e:
        return f"refuses: {str(e).split('cannot write it: ', 1)[-1]}"
    lines = []
    for part, part_shapes, spec in parts:
        try:
            text = export_cuda(part, part_shapes, "NVIDIA H200")
        except NapkinError as e:
            lines.append(f"refuses: {str(e).split('does not lower the kernel: ', 1)[-1]}")
            continue
        facts = ModuleFacts.read(mosaic_module(text))
        exact = "=" if facts.shared_memory == sum(spec.written.smem.values()) else "!="
        lines.append(f"writes it ({spec.written.notes[0].split(': ', 1)[1]}): smem "
                     f"{facts.shared_memory:,} B ({exact} counted), {facts.wgmma} wgmma, "
                     f"{facts.tma_loads} TMA loads, setmaxnreg "
                     f"{' '.join('.'.join(x) for x in facts.setmaxnreg) or '-'}, "
                     f"{'turns' if spec.written.turns else 'no turns'}"
                     f" ({facts.arrivals} arrivals, {facts.waits} barrier waits, "
                     f"{facts.mma_waits} wgmma waits)")
    return " | ".join(lines)


def main(names):
    for name in names or sorted(LIBRARY):
        t = time.perf_counter()
        try:
            out = check(name)
        except NapkinError as e:
            out = f"(no program: {e})"
        print(f"{name:<26} {out}  [{time.perf_counter() - t:.1f} s]", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
