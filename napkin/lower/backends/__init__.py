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
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from napkin.errors import NapkinError

BACKENDS = {
    "triton": "napkin.lower.backends.triton",
}
DEFAULT = "triton"


@dataclass
class Written:
    """A plan spelled: the module's source, ``forward`` and its jitted calls per interpret mode."""
    source: str
    forward: object
    calls: dict = field(repr=False)
    launch: dict = field(default_factory=dict)  # the launch parameters it was written with
    notes: list = field(default_factory=list)
    definitions: str = ""   # the source less its module header (a program's modules join)


def get_backend(name: str | None = None):
    name = DEFAULT if name is None else name
    if name not in BACKENDS:
        raise NapkinError(f"unknown kernel backend {name!r} (known: {', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[name]).BACKEND
