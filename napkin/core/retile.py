"""Renaming tiles: the symbol a partition binds is a bound variable (alpha-conversion).

A group's size or a stream's chunk is a name that evaluation binds to each piece's length
(napkin.core.streamed); the boxes inside the partition see it in their wires' types and
their own fields.  Renaming it consistently everywhere inside a box that binds it leaves
the box's meaning unchanged, so two kernels that share a tile name by convention (one
name per axis) can be given one each and tiled independently.

:func:`renamed` substitutes symbols in a diagram at every depth, generically: every sympy
value, array type and nested diagram a box's spec holds (no spec needs to say how).
:func:`untied` gives each top-level box its own names for the tiles it shares with another.
"""
from __future__ import annotations

import dataclasses

import sympy
from discopy import markov

from napkin.core.arrays import ArrayOb, ArrayType, Axis
from napkin.core.diagram import is_diagram
from napkin.core.ir import GraphBuilder, ops as op_order, to_diagram, view
from napkin.core.memo import IdentityMemo
from napkin.core.op import make_op
from napkin.core.streamed import names, tiles_within

_RENAMED, _BOXES = IdentityMemo(20000), IdentityMemo(20000)


def renamed(diagram, mapping: dict):
    """``diagram`` with every symbol ``old`` of ``mapping`` (sympy symbols) replaced by its
    ``new`` at every depth; the same object where nothing changes (memoised: the search
    renames the same kernels from state after state)."""
    return _RENAMED.get((diagram,), lambda: _rebuilt(
        diagram, lambda ob: _ob(ob, mapping), lambda i, box, dom: _box(box, dom, mapping)),
        _key(mapping))


def _key(mapping: dict) -> tuple:
    return tuple(sorted((str(a), str(b)) for a, b in mapping.items()))


def _rebuilt(diagram, ob_of, box_of):
    """``diagram`` with each input wire ``ob_of(ob)`` and each op ``box_of(index, box,
    dom)`` on its new wires; ``diagram`` itself where nothing changed."""
    g = view(diagram)
    b, changed, env = GraphBuilder(), False, {}
    for v in g.graph["inputs"]:
        ob = ob_of(g.nodes[v]["ob"])
        changed |= ob is not g.nodes[v]["ob"]
        env[v] = b.input(ob)
    for i, n in enumerate(op_order(g)):
        node = g.nodes[n]
        box = node["box"]
        new = box_of(i, box, markov.Ty(*(b.graph.nodes[env[v]]["ob"] for v in node["ins"])))
        changed |= new is not box
        for v, w in zip(node["outs"], b.op(new, [env[v] for v in node["ins"]])):
            env[v] = w
    return to_diagram(b.finish([env[v] for v in g.graph["outputs"]])) if changed else diagram


def _box(box, dom, mapping):
    """``box`` on the wires ``dom`` with the symbols renamed (``box`` where none occurs);
    memoised: the same kernel renamed alike in state after state is one object, so the
    schedule's and the launch model's memos recognise it."""
    def make():
        spec = _value(box.spec, mapping)
        if spec is box.spec and dom == box.dom:
            return box
        return make_op(spec, dom, [ob.name for ob in box.cod.inside], box.name)
    return _BOXES.get((box,), make, (_key(mapping), dom))


def _ob(ob, mapping):
    t = _value(ob.type, mapping)
    return ob if t is ob.type else ArrayOb(ob.name, t)


def _value(v, mapping):
    """``v`` with the symbols renamed; ``v`` itself where none occurs."""
    if isinstance(v, sympy.Basic):
        return v.xreplace(mapping)  # (itself where nothing is replaced)
    if isinstance(v, ArrayType):
        sizes = [_value(a.size, mapping) for a in v.axes]
        if all(s is a.size for s, a in zip(sizes, v.axes)):
            return v
        return ArrayType(tuple(Axis(a.name, s) for a, s in zip(v.axes, sizes)), v.dtype)
    if isinstance(v, (tuple, list)):
        items = [_value(w, mapping) for w in v]
        return v if all(a is b for a, b in zip(items, v)) else type(v)(items)
    if is_diagram(v):
        return renamed(v, mapping)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = {f.name: _value(getattr(v, f.name), mapping)
                  for f in dataclasses.fields(v) if f.init}
        if all(fields[k] is getattr(v, k) for k in fields):
            return v
        return dataclasses.replace(v, **fields)
    return v


def untied(program) -> tuple:
    """(program, renames): each top-level box that uses a tile name an earlier top-level
    box (in op order) also uses gets a fresh name for it (``g_t`` → ``g_t_2``), so every
    kernel's tiles are its own; ``renames`` is {op index: {old name: new name}} (empty,
    and the same program, when no two boxes share a tile)."""
    g = view(program)
    order = op_order(g)
    known = names(program)
    taken = set(known.axes) | set(known.sizes) | set(known.tiles)
    seen: set = set()
    renames: dict = {}
    for i, n in enumerate(order):
        own = sorted({use.name for use in tiles_within([g.nodes[n]["box"]])})
        clash = [t for t in own if t in seen]
        seen.update(own)
        if not clash:
            continue
        mapping = {}
        for t in clash:
            k = 2
            while f"{t}_{k}" in taken:
                k += 1
            taken.add(f"{t}_{k}")
            mapping[t] = f"{t}_{k}"
        renames[i] = mapping
    if not renames:
        return program, {}
    return retiled(program, renames), renames


def retiled(program, renames: dict):
    """``program`` with top-level op ``i``'s tiles renamed by ``renames[i]`` ({old: new},
    names)."""
    return _rebuilt(program, lambda ob: ob, lambda i, box, dom: _box(
        box, dom, symbols(renames[i])) if i in renames else box)


def symbols(mapping: dict) -> dict:
    """{name: name} as tile symbols (the positive integers a rule names)."""
    return {sympy.Symbol(a, integer=True, positive=True): sympy.Symbol(b, integer=True,
                                                                       positive=True)
            for a, b in mapping.items()}

