"""Kernel backends: each spells a :class:`napkin.lower.plan.KernelPlan` in one kernel language.

A backend is a module here holding a ``BACKEND`` object with

* ``name`` and ``rules`` (:class:`~napkin.lower.plan.BlockRules`: what its blocks need);
* ``launch`` — its launch parameters' defaults (``LoweredKernel(..., **launch)`` overrides;
  "auto" lets the backend choose per kernel, and :class:`Written` says what it chose), and
  ``check_launch(launch)``, which refuses values it cannot take in one line;
* ``write(kernel, plan)`` → :class:`Written` (the module's source and its callables);
* ``loads`` / ``stores`` — the jaxpr primitives its kernels move HBM data with (what
  ``napkin.lower.traffic`` counts);
* ``export(kernel, shapes, device_kind)`` → the CUDA module's MLIR text, on any machine.

A new backend is its module and one line in :data:`BACKENDS`; nothing else changes.
``auto`` (the default) is a chooser, not a spelling: Mosaic GPU on a Hopper GPU when it takes
the kernel, else Triton, with the reason in the kernel's notes.
"""
from __future__ import annotations

import importlib
import itertools
import linecache
from dataclasses import dataclass, field

from napkin.core.errors import NapkinError

# Every written module defines this (its header): inside ``jax.shard_map`` (check_vma) a
# kernel's outputs must say how they vary over the manual mesh axes — as the inputs that
# vary most (outside shard_map every input's is empty, and the field is not read).
VARYING = [
    "def _varying(*xs):",
    '    """How the outputs vary over a shard_map\'s mesh axes: as the most varying input."""',
    "    return max((jax.typeof(x).mat for x in xs), key=lambda m: len(m.varying))",
]



def forward_params(args: str) -> str:
    """A written kernel's ``forward`` parameters: its inputs (a kernel of none — positions
    made on chip, a bucket index — takes only ``interpret``), then ``interpret``."""
    return f"{args}, *, interpret=False" if args else "*, interpret=False"


def varying_of(args: str) -> str:
    """An output's ``manual_axis_type`` argument: as its most varying input (none for a
    kernel of no inputs: its outputs vary over no mesh axis)."""
    return f", manual_axis_type=_varying({args})" if args else ""


BACKENDS = {
    "triton": "napkin.lower.backends.triton",
    "mosaic": "napkin.lower.backends.mosaic_gpu",
    "auto": "napkin.lower.backends.auto",  # Mosaic GPU on Hopper when it takes the kernel
}
DEFAULT = "auto"


@dataclass
class Written:
    """A plan spelled: the module's source, ``forward`` and its jitted calls per interpret mode."""
    source: str
    forward: object
    calls: dict = field(repr=False)
    launch: dict = field(default_factory=dict)  # the launch parameters it was written with
    notes: list = field(default_factory=list)
    definitions: str = ""   # the source less its module header (a program's modules join)
    backend: str = ""       # the backend that wrote it ("triton", "mosaic")
    smem: dict = field(default_factory=dict)  # shared memory by purpose, where the backend
    # lays it out itself (Mosaic GPU), bytes
    copies: tuple | None = None  # (reads, writes): HBM bytes per array, where the backend
    # counts its own copies (Mosaic GPU's TMA) instead of napkin.lower.traffic walking them
    turns: bool = False     # its consumer warpgroups take turns on the tensor cores (Mosaic)
    deferred: bool = False  # a product of its stream's step runs a step late (Mosaic)


def get_backend(name: str | None = None):
    name = DEFAULT if name is None else name
    if name not in BACKENDS:
        raise NapkinError(f"unknown kernel backend {name!r} (known: {', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[name]).BACKEND


_counter = itertools.count()


def load_module(source: str, kernel, backend: str, interpret_options: dict | None = None):
    """Run a written module (its lines shown in tracebacks) and return its ``forward`` and one
    jit of it per interpret mode, so eager calls reuse the compiled kernel."""
    import jax
    from napkin.lower.emit import identifier
    filename = f"<napkin-kernel-{next(_counter)}-{kernel.name}-{backend}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": f"napkin_kernel_{identifier(kernel.name)}"}
    exec(compile(source, filename, "exec"), namespace)
    forward = namespace[kernel.symbol("forward")]
    calls = {False: jax.jit(forward, static_argnames=("interpret",)),
             True: jax.jit(forward, static_argnames=("interpret",),
                           compiler_options=interpret_options)}
    return forward, calls
