"""Random inputs for a diagram: the one sampler that the checker, ``napkin run``, the
proofs and :meth:`napkin.library.Algorithm.sample` all draw from."""
from __future__ import annotations

import numpy as np
import sympy

from napkin.errors import NapkinError


def sample(diagram, sizes: dict, rng: np.random.Generator, *, kinds: dict | None = None,
           scale: float = 1.0, overrides: dict | None = None, dtype=np.float64) -> list:
    """One array per input of ``diagram``, its shape from ``sizes`` (axis size name or
    symbol -> int; a size may be an expression in them).

    ``kinds``: input name -> "normal" (the default: standard normal times ``scale``),
    "positive" (|normal| times ``scale``, plus 0.1) or "onehot:AXIS" (one-hot along
    AXIS, e.g. labels).  ``overrides``: input name -> an array, or ``fn(shape, rng)``."""
    values = {str(k): v for k, v in sizes.items()}
    out = []
    for ob in diagram.dom.inside:
        shape = tuple(_extent(a, ob, values) for a in ob.type.axes)
        given = (overrides or {}).get(ob.name)
        kind = (kinds or {}).get(ob.name, "normal")
        if given is not None:
            out.append(np.asarray(given(shape, rng) if callable(given) else given, dtype=dtype))
        elif kind.startswith("onehot:"):
            ax = ob.type.names.index(kind.split(":", 1)[1])
            idx = rng.integers(0, shape[ax], size=[s for i, s in enumerate(shape) if i != ax])
            out.append(np.moveaxis(np.eye(shape[ax], dtype=dtype)[idx], -1, ax))
        elif kind == "positive":
            out.append(np.abs(rng.standard_normal(shape)).astype(dtype) * scale + 0.1)
        else:
            out.append((rng.standard_normal(shape) * scale).astype(dtype))
    return out


def _extent(axis, ob, values: dict) -> int:
    if isinstance(axis.size, int):
        return axis.size
    expr = sympy.sympify(axis.size)
    missing = sorted(str(s) for s in expr.free_symbols if str(s) not in values)
    if missing:
        raise NapkinError(f"no size given for axis {axis.name} of input {ob.name} "
                          f"(sizes lack {', '.join(missing)})")
    return int(expr.xreplace({s: values[str(s)] for s in expr.free_symbols}))


__all__ = ["sample"]
