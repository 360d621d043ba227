"""Which library algorithms the Mosaic GPU backend writes, at the optimiser's programs and the
tiles Mosaic's own launch model chooses (bf16, H200, the library's default sizes), and why
not where it does not.

    python benchmarks/mosaic_coverage.py          # one line per algorithm, ~1 min
    python benchmarks/mosaic_coverage.py --ranking  # Mosaic's launch model over attention's tiles

For each: optimise → plan → the backend's refusal or spelling → export for CUDA on this machine
(no GPU needed) → the Mosaic module's shared memory, wgmma and TMA counts, whether its
consumers take turns on the tensor cores, whether a product of its step runs a step late
(intra-warpgroup pipelining), its barrier arrivals and waits, and each wgmma.wait_group's N
(at most N products left in flight: 1 then 0 a step where P·V runs a step late).  A program of
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
        tiles = ",".join(f"{t}={v}" for t, v in part.tiles.items() if not str(t).isdigit())
        persistent = "persistent, " if any(n.startswith("persistent") for n in
                                           spec.written.notes) else ""
        lines.append(f"writes it at {tiles} ({spec.written.notes[0].split(': ', 1)[1]}; "
                     f"{persistent}{spec.written.launch['num_stages']} stages): smem "
                     f"{facts.shared_memory:,} B ({exact} counted), {facts.wgmma} wgmma, "
                     f"{facts.tma_loads} TMA loads, setmaxnreg "
                     f"{' '.join('.'.join(x) for x in facts.setmaxnreg) or '-'}, "
                     f"{'turns' if spec.written.turns else 'no turns'}, "
                     f"{'a product a step late' if spec.written.deferred else 'none late'}"
                     f" ({facts.arrivals} arrivals, {facts.waits} barrier waits, wgmma "
                     f"wait_group {','.join(map(str, facts.wait_groups)) or '-'})")
    return " | ".join(lines)


def ranking(d: int) -> None:
    """Multi-head attention at head dimension ``d`` (H100, bf16, the library's sizes): every
    (rows, chunk) point Mosaic GPU's launch model prices, best first, with what the writer
    says of it."""
    from napkin.cost.grid import Grid
    from napkin.cost.launch import register_budget
    from napkin.cost.model import cost
    from napkin.lower.backends.mosaic_gpu import profile
    from napkin.lower.tiles import writer_refusal
    r = napkin.optimize("mha", hardware="h100", sizes={"d": d}, dtype="bf16")
    c = cost(r.program, profile(r.hardware), r.dtype)
    g = Grid(c, r.sizes)
    order = {int(i): k for k, i in enumerate(g.ranked()[0])}
    print(f"mha d={d} ({', '.join(f'{k}={v}' for k, v in r.sizes.items())}); the search's "
          f"(Triton's) tiles {r.tiles}")
    print("| rank | g_q × s_x | consumers | data registers / budget | smem B | modelled us | "
          "the writer |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for i in range(g.n):
        v = g.values(i)
        if v.get("g_h", 1) != 1:
            continue
        (lh,) = g.launches.at(i)
        (kl,) = g.launches.point(g, i)
        budget = float(register_budget(c.hardware, kl.warps)[0])
        why = writer_refusal(r.program, v, "mosaic", r.dtype, c.schedule, r.input_shapes())
        rows.append((order.get(i, 10 ** 6), v, lh, budget, float(g.time[i]), why))
    for rank, v, lh, budget, t, why in sorted(rows, key=lambda x: x[0]):
        print(f"| {rank + 1 if rank < 10 ** 6 else '-'} | {v['g_q']} × {v['s_x']} | "
              f"{lh['num_warps'] // 4} | {lh['registers_per_thread']} / {budget:.0f}"
              f"{' (spills)' if lh['spilled_bytes'] else ''} | {lh['smem_bytes']:,} | "
              f"{t * 1e6:.1f} | {'takes it' if not why else why[:60]} |")


def main(names):
    if names == ["--ranking"]:
        for d in (64, 128):
            ranking(d)
        return
    for name in names or sorted(LIBRARY):
        t = time.perf_counter()
        try:
            out = check(name)
        except NapkinError as e:
            out = f"(no program: {e})"
        print(f"{name:<26} {out}  [{time.perf_counter() - t:.1f} s]", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
