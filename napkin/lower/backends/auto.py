"""``backend="auto"`` (the default): Mosaic GPU on a Hopper GPU when it takes the kernel, else
Triton — with the one-line reason in the kernel's notes.

The choice is made per plan (per set of shapes), since what Mosaic takes depends on them
(sizes its tiles divide, shared memory): :meth:`Auto.write` asks the Mosaic GPU backend first
on an sm_90 device and falls back to Triton on its refusal.  Without a Hopper GPU (a CPU, where
kernels run in interpret mode, or another GPU) it writes Triton.  Launch parameters are
Triton's (``num_warps``, ``num_stages``); Mosaic reads ``num_stages`` as its pipeline's
``max_concurrent_steps``.
"""
from __future__ import annotations

import jax

from napkin.core.errors import NapkinError
from napkin.lower.backends.mosaic_gpu import MOSAIC
from napkin.lower.backends.triton import TRITON


def hopper_here() -> str:
    """Why the default device is not a Hopper GPU ("" when it is: compute capability 9.x)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return f"no GPU here ({dev.platform}; interpret mode runs Triton's kernels)"
    cc = str(getattr(dev, "compute_capability", ""))
    if not cc.startswith("9."):
        return f"{dev.device_kind} is not a Hopper GPU (sm_90)"
    return ""


def lowers(written, plan) -> None:
    """Lower a Mosaic kernel for this GPU now (a NapkinError if Mosaic refuses it), so that
    the default backend falls back to Triton here rather than fail at the first call."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in plan.inputs]
    try:
        written.calls[False].trace(*structs, interpret=False).lower(
            lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - Mosaic's own refusal, as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NapkinError(f"Mosaic GPU does not lower it: {first}") from None


class Auto:
    name = "auto"
    rules = TRITON.rules  # Mosaic's block rules are the same (powers of two)
    launch = dict(TRITON.launch)
    loads = TRITON.loads | MOSAIC.loads
    stores = TRITON.stores | MOSAIC.stores

    def check_launch(self, launch: dict) -> None:
        TRITON.check_launch(launch)

    def write(self, kernel, plan):
        why = hopper_here() or MOSAIC.refusal(plan)
        if not why:
            try:
                written = MOSAIC.write(kernel, plan)
                lowers(written, plan)
                written.notes.append("backend: Mosaic GPU (Hopper)")
                return written
            except NapkinError as e:
                why = str(e)
        written = TRITON.write(kernel, plan)
        written.notes.append(f"backend: Triton (Mosaic GPU: {why})")
        return written

    def export(self, kernel, structs, device_kind: str = "NVIDIA H100") -> str:
        """The CUDA export of the backend this machine writes (Triton without a Hopper GPU;
        pass backend="mosaic" to export Mosaic's on a CPU)."""
        spec = kernel.plan(*structs)
        backend = MOSAIC if spec.written.backend == "mosaic" else TRITON
        return backend.export(kernel, structs, device_kind)


AUTO = BACKEND = Auto()
