"""What each kernel of a schedule asks of a GPU: its grid, its sequential steps, its shared
memory and its registers, read off the one loop nest.

The two-level model (the paper's) puts everything on chip in one memory M.  A GPU splits it:
tiles moved in from HBM for a contraction to read (and a stream's chunks of them, once per
pipeline stage) are staged in shared memory, budgeted per block; values computed on chip (a
stream's state, the score tile, dot results) and tiles only elementwise boxes read live in
registers, budgeted per thread.  Both come from the schedule's liveness
(:meth:`napkin.schedule.nest.Loop.peaks` with ``part="staged"`` / ``"held"``), so they are
the same buffers the cost model and the pseudocode show.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

import sympy

from napkin.hardware import resolve_level
from napkin.core.memo import IdentityMemo
from napkin.core.primitives import matmul_sides
from napkin.schedule.nest import ONE, ZERO, Loop, Schedule, Step, prune


_MEMO = IdentityMemo(20000)


@dataclass(frozen=True)
class KernelResources:
    """One kernel of a program (a top-level box), per launch.

    ``launches``: how many times it is launched (sequential GMEM groups around it).
    ``ctas``: thread blocks per launch (the product of its grid's groups).
    ``steps``: sequential stream steps one block runs.
    ``smem``: candidate bytes of shared memory per block with one chunk per stream (the
    peak is their max); ``stage``: bytes each further pipeline stage adds (one more chunk of
    every streamed input).  ``registers``: candidate counts of register-resident values per
    block (state and computed temporaries; values, since a kernel computes them in f32
    whatever dtype the schedule stores them in).
    """
    loop: Loop
    name: str
    launches: sympy.Expr
    ctas: sympy.Expr
    steps: sympy.Expr
    smem: tuple
    stage: sympy.Expr
    registers: tuple
    streams: int
    rows: sympy.Expr | None    # the fewest rows (M) of its matrix products; None: it has none
    # whether a stream's step may run part of its work during the next (Loop.overlap: its
    # product a step late, beside the next step's softmax)
    overlapped: bool = False
    # bytes a software pipeline of 2 or more stages adds once: the chunks only elementwise
    # boxes read into a product, one buffer each (Loop.pipelined; the largest stream's)
    pipelined: sympy.Expr = ZERO

    # ``ev``: an expression's value (a number, or numpy arrays over a grid of tile points)
    def smem_bytes(self, ev, stages=1):
        """Shared memory per block with ``stages`` chunk buffers per stream."""
        return at_stages(functools.reduce(np.maximum, (ev(b) for b in self.smem)),
                         ev(self.stage), ev(self.pipelined), stages)

    def registers_per_thread(self, ev, warps):
        """Registers of data per thread at ``warps`` warps: the held values, one 4-byte
        register each (a kernel computes them in f32)."""
        return functools.reduce(np.maximum, (ev(v) for v in self.registers)) / (32 * warps)


def at_stages(one, stage, pipelined, stages):
    """Shared memory at ``stages`` pipeline stages (a number or arrays) from its parts: the
    bytes at one stage, each further stage's chunks, and what a pipeline of two or more
    copies ahead once (``KernelResources.pipelined``)."""
    return one + (np.asarray(stages) - 1) * stage + np.where(np.asarray(stages) >= 2,
                                                             pipelined, 0)


def kernels(schedule: Schedule) -> list[KernelResources]:
    """Every kernel of ``schedule``, in program order.  A block is one instance of the
    profile's per-SM level ("smem"): groups at it or above spread blocks over the chip,
    levels at it or below are the block's own memory."""
    levels = list(schedule.levels)
    block = block_level(levels)
    out = []
    for k, launches in _kernel_loops(schedule.root, ONE):
        # a kernel's loop is shared by every program that holds it: analysed once
        r = _MEMO.get((k,), lambda: _resources(k, ONE, schedule.stages, levels, block),
                      (schedule.stages, tuple(levels)))
        out.append(r if launches == ONE else dataclasses.replace(r, launches=launches))
    return out


def block_level(levels) -> int:
    """The index of the level one thread block's memory is (the per-SM level, "smem")."""
    return resolve_level(list(levels), "smem")


def _kernel_loops(loop: Loop, launches):
    for it in loop.items:
        if not isinstance(it, Loop):
            continue
        if it.kind == "use":
            yield from _kernel_loops(it, launches)
        elif it.merge_only:  # a GMEM group: its body's kernels, launched once per group
            yield from _kernel_loops(it, launches * it.trips)
        else:
            yield it, launches


def _resources(k: Loop, launches, stages: int, levels: list, block: int) -> KernelResources:
    streams = [s for s, _ in _loops(k) if s.kind == "stream"]
    spread = lambda loop: (loop.kind == "group" and loop.parallel  # noqa: E731
                           and levels.index(loop.level) <= block)
    # bytes one more stage adds: the largest stream's chunks (streams run one after another)
    stage = max((s.staged[1] / stages for s in streams), key=_sample, default=ZERO)
    return KernelResources(
        loop=k, name=k.name or f"group {k.axis}", launches=launches, ctas=_ctas(k, spread),
        steps=_steps(k, spread), smem=tuple(prune([b - (stages - 1) * stage for b in
                                                   _in_block(k.peaks("staged"), block)])),
        stage=sympy.expand(stage),
        registers=tuple(prune(_in_block(k.peaks("held"), block, values=True))),
        streams=len(streams), rows=_rows(k), overlapped=any(s.overlap for s in streams),
        pipelined=max((s.pipelined for s in streams), key=_sample, default=ZERO))


def _rows(k: Loop):
    """The M extent of the kernel's largest matrix product: the first operand's output axes
    the second lacks.  A tensor-core instruction takes a fixed number of rows per warp
    group, so the largest product's rows bound how many warp groups the kernel can use;
    the compiler splits a smaller product's columns over the warp groups instead (Triton
    writes a 64-row dot at 8 warps as two warp groups of half the columns: a dK, dV
    kernel's key tile of 64 beside its query chunk of 128, 241 registers, no spills)."""
    rows = []
    for it, _ in k.walk():
        sides = matmul_sides(it.box) if isinstance(it, Step) else None
        if sides:
            rows.append(sympy.Mul(*(n for _, n in sides["M"])))
    return sympy.Max(*dict.fromkeys(rows)) if rows else None


def _loops(loop: Loop):
    for it, m in loop.walk():
        if isinstance(it, Loop):
            yield it, m


def _in_block(peaks: dict, block: int, values: bool = False) -> list:
    """One block's bytes (or values): the sum of the peaks of the block's level and the
    levels below it (their instances all sit in the block)."""
    total = [ZERO]
    for i, pk in peaks.items():
        cands = pk.vals if values else pk.byts
        if i >= block and cands:
            total = [a + b for a in total for b in cands]
    return total


def _ctas(k: Loop, spread):
    """Blocks per launch: the trips of the groups that spread the kernel over the chip (the
    largest product where sibling groups do so)."""
    if not spread(k):
        return ONE  # a box outside every group: one block holds the whole arrays
    inner = [_ctas(g, spread) for g in k.items if isinstance(g, Loop) and spread(g)]
    return k.trips * max(inner, key=_sample, default=ONE)


def _steps(loop: Loop, spread):
    """Sequential steps of one block: each stream's trips (times the steps inside it),
    summed over the streams one after another; grid groups add none of their own."""
    total = ZERO
    for it in loop.items:
        if not isinstance(it, Loop):
            continue
        inner = _steps(it, spread)
        if it.kind == "stream":
            total += it.trips * (inner if inner != 0 else ONE)
        elif spread(it):
            total += inner  # more blocks of the grid: they run side by side
        elif it.kind == "group" and not it.parallel:  # a loop inside the block
            total += it.trips * (inner if inner != 0 else ONE)
        else:
            total += inner
    return sympy.expand(total)


def _sample(e) -> float:
    """A size-independent order of expressions: their value with every size at 1024."""
    e = sympy.sympify(e)
    return float(e.xreplace({s: 1024 for s in e.free_symbols}))
