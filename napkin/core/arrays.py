"""Axes, array types and the wires that carry them.

An axis is a name with a size (an int, or a sympy symbol so that everything
downstream stays shape-generic).  An array type is a tuple of distinct named
axes plus a storage dtype.  One DisCoPy wire carries one array: the atomic
object of the wire is an :class:`ArrayOb` holding the :class:`ArrayType`.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
from discopy import cat, markov

from napkin.core.errors import NapkinError

Size = int | sympy.Expr

# Storage dtypes known to the whole system (cost, lowering, semantics).
DTYPES = ("f64", "f32", "bf16", "f16", "fp8", "int32", "int8", "bool")
DTYPE_ALIASES = {
    "float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
    "e4m3": "fp8", "float8_e4m3fn": "fp8", "int": "int32",
}


# Floating dtypes, narrowest first.
BY_WIDTH = ("fp8", "bf16", "f16", "f32", "f64")


def narrowest_of(dtypes, default=None) -> str | None:
    """The floating dtype with the fewest bits among ``dtypes`` (``default`` if none is)."""
    return min((d for d in dtypes if d in BY_WIDTH), key=BY_WIDTH.index, default=default)


def canonical_dtype(dtype: str) -> str:
    name = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name not in DTYPES:
        raise NapkinError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return name


def as_size(size) -> Size:
    """An int stays an int; a string becomes a positive integer symbol."""
    if isinstance(size, bool):
        raise NapkinError(f"axis size must be an int or a symbol, not {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise NapkinError(f"axis size must be positive, got {size}")
        return size
    if isinstance(size, str):
        return sympy.Symbol(size, integer=True, positive=True)
    if isinstance(size, sympy.Expr):
        if size.is_Integer:
            return as_size(int(size))
        return size
    raise NapkinError(f"axis size must be an int or a sympy expression, not {size!r}")


@dataclass(frozen=True)
class Axis:
    """A named axis.  Two axes are the same axis when name and size agree."""
    name: str
    size: Size

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise NapkinError(f"axis name must be an identifier, got {self.name!r}")
        object.__setattr__(self, "size", as_size(self.size))

    def resized(self, size) -> Axis:
        return Axis(self.name, size)

    def __str__(self):
        return self.name


def axes(spec: str, sizes: dict | None = None) -> tuple[Axis, ...]:
    """``axes("q x d")`` -> three axes with symbolic sizes named like the axes."""
    sizes = sizes or {}
    return tuple(Axis(n, sizes.get(n, n)) for n in spec.split())


@dataclass(frozen=True)
class ArrayType:
    axes: tuple[Axis, ...]
    dtype: str = "f32"

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        names = tuple(a.name for a in self.axes)
        if len(set(names)) != len(names):
            raise NapkinError(f"array type repeats an axis: [{','.join(names)}]")
        object.__setattr__(self, "_names", names)  # not a field: asked for constantly

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> tuple[Size, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def numel(self) -> Size:
        return sympy.Mul(*self.shape) if self.axes else sympy.Integer(1)

    def axis(self, name: str) -> Axis:
        for a in self.axes:
            if a.name == name:
                return a
        raise NapkinError(f"array [{','.join(self.names)}] has no axis {name!r}")

    def has(self, name: str) -> bool:
        return name in self.names

    def without(self, name: str) -> ArrayType:
        return ArrayType(tuple(a for a in self.axes if a.name != name), self.dtype)

    def with_axis(self, axis: Axis, front: bool = True) -> ArrayType:
        if self.has(axis.name):
            return self
        new = (axis, *self.axes) if front else (*self.axes, axis)
        return ArrayType(new, self.dtype)

    def with_dtype(self, dtype: str) -> ArrayType:
        return ArrayType(self.axes, dtype)

    def resize(self, name: str, size) -> ArrayType:
        return ArrayType(tuple(a.resized(size) if a.name == name else a for a in self.axes),
                         self.dtype)

    def __str__(self):
        return f"[{','.join(self.names)}]"


class ArrayOb(cat.Ob):
    """The atomic object of a wire: a named array of a given :class:`ArrayType`.

    Equality is structural (axes, sizes, dtype); the name is only a label, so
    ``S[q,x]`` composes with a box expecting ``P[q,x]``.
    """

    def __init__(self, name: str, type: ArrayType):
        super().__init__(name)
        self.type = type

    def __eq__(self, other):
        return isinstance(other, ArrayOb) and self.type == other.type

    def __hash__(self):
        return hash(self.type)

    def __repr__(self):
        return f"ArrayOb({self.name!r}, {self.type!r})"

    def __str__(self):
        if getattr(self, "_label", None) is None:
            self._label = label(self.name, self.type)
        return self._label


def label(name: str, t: ArrayType) -> str:
    return f"{name}[{','.join(t.names)}]"


def wire(name: str, *axes_: Axis, dtype: str = "f32") -> markov.Ty:
    """The type of one wire carrying array ``name`` with the given axes."""
    return markov.Ty(ArrayOb(name, ArrayType(axes_, dtype)))


def array_types(ty: markov.Ty) -> list[ArrayType]:
    return [ob.type for ob in ty.inside]


def describe(ty: markov.Ty) -> str:
    return " @ ".join(str(ob) for ob in ty.inside) or "()"
