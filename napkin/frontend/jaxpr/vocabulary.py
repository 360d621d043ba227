"""What napkin reads of a jaxpr: the primitives by kind, the dtypes, the gathers it knows, and
the one-line refusal for anything else."""
from __future__ import annotations

import numpy as np

from napkin.core.errors import NapkinError

# jaxpr primitives that call another jaxpr: inlined (their body is the meaning)
INLINE = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint", "named_call"}
WIRING = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "tile"}
IDENTITY = {"stop_gradient", "copy", "copy_p", "optimization_barrier"}
UNARY = {"exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid", "neg": "neg",
         "abs": "abs", "sqrt": "sqrt", "rsqrt": "rsqrt", "square": "square",
         # read only inside patterns (gelu, finite_or_zero); alone they are refused
         "erf": "erf", "erfc": "erfc", "is_finite": "is_finite"}
BINARY = {"add", "sub", "mul", "div", "max", "min", "pow"}
COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
LOGIC = {"and", "or", "not"}
REDUCE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
OTHER = {"dot_general", "select_n", "iota", "convert_element_type", "integer_pow", "exp2",
         "clamp", "gather", "dim_as_value"}
KNOWN = WIRING | IDENTITY | set(UNARY) | BINARY | COMPARE | LOGIC | set(REDUCE) | OTHER
ELEMENTWISE = set(UNARY) | BINARY | COMPARE | LOGIC | IDENTITY | {
    "select_n", "convert_element_type", "integer_pow", "exp2", "clamp"}
# map functions that only patterns may use: no napkin primitive computes them alone
PATTERN_ONLY = {"erf", "erfc", "is_finite"}

# what the error for anything else lists (the user's names, not the internal ones)
SUPPORTED = ("jit/pjit, custom_jvp_call, custom_vjp_call (inlined)", "dot_general",
             "exp log tanh logistic neg abs sqrt rsqrt square integer_pow pow exp2",
             "add sub mul div max min clamp", "lt le gt ge eq ne and or not", "select_n",
             "reduce_sum reduce_max reduce_min", "broadcast_in_dim expand_dims squeeze "
             "transpose", "reshape (a merge or split of axes: read as their product)",
             "tile, repeat", "convert_element_type",
             "stop_gradient", "iota", "gather (take_along_axis; x[:, index] along one axis)",
             "erf (inside gelu)")

# numpy dtype names -> napkin's.  int64 (jax with x64) is read as napkin's int32: exact while
# its values fit in 32 bits.  Unsigned and 16-bit integers wrap around differently from int32:
# refused rather than read as it.
DTYPES = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
          "float8_e4m3fn": "fp8", "int32": "int32", "int8": "int8", "bool": "bool",
          "int64": "int32"}
FLOAT = ("f64", "f32", "bf16", "f16", "fp8")
NUMPY = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16",
         "fp8": "float8_e4m3fn"}


def fail(msg: str):
    raise NapkinError(f"from_jax: {msg}")


def napkin_dtype(dt, where="") -> str:
    name = np.dtype(dt).name
    if name not in DTYPES:
        fail(f"dtype {name} ({where}) has no napkin dtype; napkin's: f64 f32 bf16 f16 fp8 "
             f"int32 int8 bool")
    return DTYPES[name]


def rounded(value, dtype: str) -> float:
    """``value`` (a number or a closed sympy constant) rounded to the float dtype ``dtype``."""
    import jax.numpy as jnp
    return float(np.asarray(float(value), dtype=jnp.dtype(NUMPY[dtype])))


# what to write instead of a slice, a concatenation, a reversal of a named axis
RANGES = ("a slice x[..., :n] of a named axis has none: napkin arrays have named axes, not "
          "ranges — pass the pieces as arguments of their own, or write a rotation such as "
          "RoPE's rotate-half as a product with a constant matrix argument, x @ R")
SLICING = {"slice", "dynamic_slice", "concatenate", "pad", "rev", "split"}


def unsupported(e, what=None):
    hint = ""
    if e.prim == "gather":
        hint = (" (napkin reads only jnp.take_along_axis's gather, one index per position of "
                "the other axes along one axis, x[:, index] with one integer index array "
                f"along one axis, and indexing of a dimension of size 1; {RANGES})")
    elif e.prim in SLICING and np.issubdtype(np.dtype(e.outs[0].dtype), np.floating):
        hint = f" ({RANGES})"  # (an integer concatenation is JAX building a gather's index)
    fail(f"{what or 'primitive ' + e.prim} ({e.at()}) has no napkin primitive{hint}; "
         f"supported: {'; '.join(SUPPORTED)}")


# -- the gathers napkin reads
def unit(d) -> bool:
    """A dimension of size 1 (no axis: napkin broadcasts by name)."""
    return isinstance(d, int) and d == 1


def gather_mode(e) -> str:
    """``fill`` (an index out of range gives the fill, NaN by default), ``clip`` (it is
    clamped into range) or ``promise`` (the caller promises none is)."""
    mode = str(e.params.get("mode", "")).upper()
    if "CLIP" in mode:
        return "clip"
    return "promise" if "PROMISE" in mode else "fill"


def unit_pick(e) -> bool:
    """A gather that picks the one entry of unit dimensions and keeps every other dimension
    whole (``jnp.take(x, i, axis=1)`` on a dimension of size 1)."""
    try:
        dn, ss = e.params["dimension_numbers"], e.params["slice_sizes"]
        x, idx, o = e.ins[0], e.ins[1], e.outs[0]
        coll = tuple(dn.collapsed_slice_dims)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError):
        return False
    r = len(x.shape)
    return bool(hasattr(x, "shape") and coll and all(unit(x.shape[j]) for j in coll)
                and not tuple(dn.operand_batching_dims) and len(getattr(idx, "shape", ())) <= 1
                and tuple(dn.offset_dims) == tuple(range(r - len(coll)))
                == tuple(range(len(o.shape)))
                and all(ss[j] == x.shape[j] for j in range(r) if j not in coll))


def take_along(e):
    """The axis of a gather of ``jnp.take_along_axis``'s shape (one index per position of
    the other axes, along one axis), else None."""
    try:
        dn, ss = e.params["dimension_numbers"], e.params["slice_sizes"]
        x, idx = e.ins
        r = len(x.shape)
        (axis,) = dn.collapsed_slice_dims
        ok = (tuple(dn.offset_dims) == () and tuple(dn.start_index_map) == (axis,)
              and sorted((*dn.operand_batching_dims, axis)) == list(range(r))
              and all(unit(n) for n in ss) and len(idx.shape) == r + 1 and unit(idx.shape[-1])
              and sorted(dn.start_indices_batching_dims) == list(range(r - 1)))
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    return axis if ok else None


def take_at(e):
    """The axis of a gather of one integer index array along one axis, every other
    dimension whole (``table[:, bucket]``: out = the kept dimensions at ``offset_dims``, the
    index's at the others), else None."""
    try:
        dn, ss = e.params["dimension_numbers"], e.params["slice_sizes"]
        x, idx, o = e.ins[0], e.ins[1], e.outs[0]
        r = len(x.shape)
        (axis,) = dn.collapsed_slice_dims
        kept = [j for j in range(r) if j != axis]
        ok = (tuple(dn.start_index_map) == (axis,) and not tuple(dn.operand_batching_dims)
              and not tuple(dn.start_indices_batching_dims) and unit(ss[axis])
              and all(ss[j] == x.shape[j] for j in kept) and len(idx.shape) >= 1
              and unit(idx.shape[-1]) and len(dn.offset_dims) == len(kept)
              and len(o.shape) == len(kept) + len(idx.shape) - 1)
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    return axis if ok else None
