"""The tiles each backend writes a program at.

The search chooses a program's structure and its tiles under the profile's launch model,
which prices Triton's blocks (every warp holds data within a per-thread register budget).
Mosaic GPU runs a block otherwise — a producer warpgroup issuing TMA copies, consumer
warpgroups sharing the register file through setmaxnreg, a contraction's K in multiples of
the 128-B swizzle, TMA boxes of at most 256 — so its tiles are chosen again, for the same
program, under the backend's own profile (``backend.profile(hw)``): the best point its launch
model prices, else the next, up to the first the writer takes (its register and layout
checks stay the gate).  The structure (the chain) is not searched again: it is the
hardware's, not the backend's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from napkin.core.errors import NapkinError

TRIES = 6  # ranked points the writer is asked to take before the backend is said to refuse
# ranked points looked at, at most: one the backend refuses by its plan alone (rows no
# warpgroup layout takes, a block over a TMA box) costs no writing and is not a try
LOOKED_AT = 64


@dataclass(frozen=True)
class BackendTiles:
    """A backend's tiles for one program: ``tiles`` (every tile symbol), the launch the
    model chose with them (``launch``: each kernel's), its modelled ``time_s``, and
    ``refused``: why the backend takes no tiling ("" when it does); ``multiples``: each
    tile's least value on the backend's profile (what a smaller run's tiles keep to)."""
    backend: str
    tiles: dict
    launch: list
    time_s: float
    refused: str = ""
    multiples: dict = field(default_factory=dict)

    def describe(self) -> str:
        tiles = ", ".join(f"{k}={v}" for k, v in sorted(self.tiles.items()))
        if self.refused:
            return f"{self.backend}: refuses every tiling tried ({self.refused})"
        return f"{self.backend} at {tiles}: {self.time_s * 1e6:.2f} us modelled"


def choose(program, hardware, sizes: dict, dtype, backend: str, shapes, *,
           fixed: dict | None = None, constants: dict | None = None) -> BackendTiles:
    """``backend``'s tiles for ``program`` (its tiles named in ``fixed`` kept): the point of
    its launch model's ranking that its writer takes first, within :data:`TRIES`.
    ``constants``: sizes only a constant names (the kernel binds them as the search saw)."""
    from napkin.cost.grid import Grid
    from napkin.cost.model import cost as cost_of
    from napkin.lower.backends import get_backend
    own = get_backend(backend)
    hw = own.profile(hardware)
    c = cost_of(program, hw, dtype)
    at = {**sizes, **(fixed or {})}
    # the backend's own candidates: any multiple of the granules where it takes them (192
    # rows: three consumers), only those dividing their axis where it masks no tail
    grid = Grid(c, at, power_of_two=own.rules.pow2, divisors=not own.rules.tails)
    order, _ = grid.ranked()

    def point(i: int, refused: str = "") -> BackendTiles:
        return BackendTiles(backend, grid.values(i), grid.launches.at(i)
                            if grid.launches is not None else [], float(grid.time[i]),
                            refused=refused, multiples=dict(grid.mult))
    why, tries = "", 0
    for i in map(int, order[:LOOKED_AT]):
        refused = writer_refusal(program, grid.values(i), backend, dtype, c.schedule, shapes,
                                 constants, plan_only=True)
        if not refused:
            tries += 1
            refused = writer_refusal(program, grid.values(i), backend, dtype, c.schedule,
                                     shapes, constants)
            if not refused:
                return point(i)
        why = why or refused
        if tries == TRIES:
            break
    return point(int(order[0]), why)


def writer_refusal(program, tiles, backend, dtype, schedule, shapes, constants=None,
                   plan_only=False) -> str:
    """Why ``backend`` does not write ``program`` at ``tiles`` ("" when it does);
    ``plan_only``: why it refuses the plans, before writing any kernel."""
    from napkin.lower import lower
    try:
        k = lower(program, {**(constants or {}), **tiles}, backend=backend, dtype=dtype,
                  schedule=schedule)
        for part, s in k.parts(shapes):
            if plan_only:
                why = part.refusal(*s)
                if why:
                    return why
            else:
                part.plan(*s)
    except NapkinError as e:
        return str(e).split("cannot write it: ", 1)[-1]
    return ""
