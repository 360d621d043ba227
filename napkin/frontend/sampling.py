"""Random inputs for a diagram: the one sampler that the checker, ``napkin run``, the
proofs and :meth:`napkin.frontend.library.Algorithm.sample` all draw from."""
from __future__ import annotations

import numpy as np
import sympy

from napkin.core.errors import NapkinError


def sample(diagram, sizes: dict, rng: np.random.Generator, *, kinds: dict | None = None,
           scale: float = 1.0, overrides: dict | None = None, dtype=np.float64) -> list:
    """One array per input of ``diagram``, its shape from ``sizes`` (axis size name or
    symbol -> int; a size may be an expression in them).

    ``kinds``: input name -> "normal" (the default: standard normal times ``scale``),
    "positive" (|normal| times ``scale``, plus 0.1), "onehot:AXIS" (one-hot along
    AXIS, e.g. labels) or "index:AXIS" (int32 integers in [0, size of AXIS): labels for
    take_along_axis; AXIS is an axis of another input).  ``overrides``: input name -> an
    array, or ``fn(shape, rng)``.  ``dtype`` is that of floating inputs: an input declared
    with an integer or bool dtype keeps it (an integer input of kind "normal" is the
    normal draw rounded)."""
    values = {str(k): v for k, v in sizes.items()}
    out = []
    for ob in diagram.dom.inside:
        shape = tuple(_extent(a, ob, values) for a in ob.type.axes)
        given = (overrides or {}).get(ob.name)
        kind = (kinds or {}).get(ob.name, "normal")
        own = _own_dtype(ob.type.dtype)
        if given is not None:
            out.append(np.asarray(given(shape, rng) if callable(given) else given,
                                  dtype=own or dtype))
        elif kind.startswith("index:"):
            n = _axis_extent(diagram, kind.split(":", 1)[1], ob, values)
            out.append(rng.integers(0, n, size=shape).astype(own or np.int32))
        elif own is not None:
            x = rng.standard_normal(shape) * scale
            if own == np.bool_:
                out.append(x > 0)
            else:
                lim = np.iinfo(own)
                out.append(np.clip(np.rint(x), lim.min, lim.max).astype(own))
        elif kind.startswith("onehot:"):
            ax = ob.type.names.index(kind.split(":", 1)[1])
            idx = rng.integers(0, shape[ax], size=[s for i, s in enumerate(shape) if i != ax])
            out.append(np.moveaxis(np.eye(shape[ax], dtype=dtype)[idx], -1, ax))
        elif kind == "positive":
            out.append(np.abs(rng.standard_normal(shape)).astype(dtype) * scale + 0.1)
        else:
            out.append((rng.standard_normal(shape) * scale).astype(dtype))
    return out


def _own_dtype(dtype: str):
    """The numpy dtype an input of this declared dtype keeps (None: a floating input,
    drawn at the sampler's dtype)."""
    return {"int32": np.int32, "int8": np.int8, "bool": np.bool_}.get(dtype)


def _axis_extent(diagram, name: str, ob, values: dict) -> int:
    """The size of axis ``name`` (an index input lacks the axis it indexes: another input
    carries it)."""
    for other in diagram.dom.inside:
        for a in other.type.axes:
            if a.name == name:
                return _extent(a, other, values)
    raise NapkinError(f"input {ob.name} is an index along axis {name}, which no input has")


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
