"""Tile names are fresh: a group size or stream chunk never renames something else.

Evaluation binds a tile symbol to each piece's length (napkin.core.streamed), so a tile
named like an axis size (``d``), a size symbol of the algorithm, or the tile of an
enclosing or enclosed partition would silently change what the program computes.
A rule therefore refuses such a name (:func:`clash`), and the names rules choose
by default (:func:`fresh`) are never taken.

One reuse is allowed: partitions of the same kind over the same axis in disjoint
parts of the program (one per layer of a stack) may share a tile — it is the same
tile size, chosen once — because neither binds it inside the other.
"""
from __future__ import annotations

import sympy

from napkin.core.errors import RuleError
from napkin.core.streamed import TileUse, names, tile_of, tiles_within
from rewrites.base import size_param


def tiles_around(program, path) -> set[TileUse]:
    """The tiles of the groups a site at ``path`` sits in."""
    from napkin.core.ir import ops as op_order, view
    found, d = set(), program
    for i in path:
        g = view(d)
        spec = g.nodes[op_order(g)[i]]["box"].spec
        tile = tile_of(spec)
        if tile is not None:
            found.add(tile)
        d = spec.body
    return found


def clash(program, path, boxes, size, kind: str, axis: str) -> str | None:
    """Why ``size`` cannot name a new ``kind`` partition of ``axis`` over ``boxes`` at
    ``path`` (None when it can).  Integers are always fine."""
    if not isinstance(size, sympy.Symbol):
        return None
    name, known = size.name, names(program)
    if name in known.axes:
        return f"tile name {name} is already the name of an axis (choose a fresh name)"
    if name in known.sizes:
        return f"tile name {name} is already a size symbol of the program (choose a fresh name)"
    for where, found in (("encloses this site", tiles_around(program, path)),
                         ("lies inside the region", tiles_within(boxes))):
        for use in found:
            if use.name == name:
                return (f"tile name {name} is already the tile of the {use.kind} over "
                        f"{use.axis} that {where} (choose a fresh name)")
    for use in known.tiles.get(name, ()):
        if (use.kind, use.axis) != (kind, axis):
            return (f"tile name {name} is already the tile of a {use.kind} over {use.axis} "
                    f"(choose a fresh name)")
    return None


def fresh(program, path, boxes, kind: str, axis: str, base: str) -> sympy.Symbol:
    """``base`` (e.g. g_q, s_x), or the first of ``base_2``, ``base_3``, ... that
    :func:`clash` accepts."""
    for i in range(1, 10000):
        name = base if i == 1 else f"{base}_{i}"
        symbol = sympy.Symbol(name, integer=True, positive=True)
        if clash(program, path, boxes, symbol, kind, axis) is None:
            return symbol
    raise AssertionError("no fresh tile name")  # pragma: no cover - 10^4 names all taken


def choose(program, path, boxes, given, kind: str, axis: str, base: str, what: str):
    """The tile of a new partition: ``given`` (a JSON parameter: an int or a name,
    refused with a RuleError saying ``what`` when it clashes), else a fresh name
    from ``base``."""
    if given is None:
        return fresh(program, path, boxes, kind, axis, base)
    size = size_param(given, f"{kind}_partition {'size' if kind == 'group' else 'chunk'}")
    why = clash(program, path, boxes, size, kind, axis)
    if why:
        raise RuleError(f"{what}: {why}")
    return size
