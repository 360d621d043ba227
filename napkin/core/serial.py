"""A diagram as plain data, and back, with napkin's own primitives only.

:func:`to_data` writes a diagram as JSON-ready data — its input wires, its boxes in a
topological order (each a primitive spec by class name and fields, the wires it reads and
the wires it makes) and its output wires; nested diagrams (group and stream bodies) nest.
:func:`from_data` rebuilds it without running any code the data names: spec classes come
from napkin's own modules only (:data:`SPECS`), sympy sizes from a tree of a few known node
kinds (never ``sympify`` of text, which evaluates it), and every box is type-checked by its
spec as it is rebuilt (the types the data declares must be the ones the spec infers).

This is how ``napkin check`` judges a ``{"from": FILE}`` certificate: the file runs in a
process of its own that hands the diagram back as this data, and the judging process
rebuilds it here (napkin.certify.isolate).  Anything malformed is a :class:`SerialError`
naming where.
"""
from __future__ import annotations

import dataclasses

import sympy
from discopy import markov

from napkin.core import primitives, streamed
from napkin.core.arrays import ArrayOb, ArrayType, Axis
from napkin.core.diagram import is_diagram
from napkin.core.errors import NapkinError
from napkin.core.ir import GraphBuilder, ops, to_diagram, view
from napkin.core.op import Op

FORMAT = "napkin-diagram/1"
MAX_DEPTH = 64           # nested diagrams and values: data deeper than this is refused
MAX_BOXES = 100_000


class SerialError(NapkinError):
    """Data that is not a diagram napkin can rebuild."""


def _napkin_dataclasses() -> dict:
    found = {}
    for module in (primitives, streamed):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) \
                    and obj.__module__ == module.__name__ and name != "EvalContext":
                found[name] = obj
    return found


SPECS = _napkin_dataclasses()   # class name -> class: the only kinds data may name

# sympy node kinds a size may be built of (what axis sizes, tiles and constants use)
_SYMPY = {"Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow, "Max": sympy.Max,
          "Min": sympy.Min, "floor": sympy.floor, "ceiling": sympy.ceiling,
          "log": sympy.log, "exp": sympy.exp, "Abs": sympy.Abs, "Mod": sympy.Mod}
_ASSUMPTIONS = {"integer", "positive", "nonnegative", "real", "negative", "nonzero"}


# ----------------------------------------------------------------------------- writing
def to_data(diagram) -> dict:
    """``diagram`` as JSON-ready data (see the module doc)."""
    g = view(diagram)
    wire, obs = {}, []
    for v in g.graph["inputs"]:
        wire[v] = len(wire)
        obs.append(_ob(g.nodes[v]["ob"]))
    boxes = []
    for n in ops(g):
        node = g.nodes[n]
        box = node["box"]
        spec = getattr(box, "spec", None)
        if spec is None:
            raise SerialError(f"box {box.name!r} has no primitive spec")
        ins = [wire[v] for v in node["ins"]]
        for v in node["outs"]:
            wire[v] = len(wire)
        boxes.append({"name": box.name, "spec": _spec(spec), "ins": ins,
                      "outs": [_ob(g.nodes[v]["ob"]) for v in node["outs"]]})
    return {"format": FORMAT, "inputs": obs, "boxes": boxes,
            "outputs": [wire[v] for v in g.graph["outputs"]]}


def _ob(ob) -> dict:
    return {"name": ob.name, "type": _type(ob.type)}


def _type(t: ArrayType) -> dict:
    return {"axes": [[a.name, _value(a.size)] for a in t.axes], "dtype": t.dtype}


def _spec(spec) -> dict:
    name = type(spec).__name__
    if SPECS.get(name) is not type(spec):
        raise SerialError(f"{name} is not one of napkin's primitives")
    return {"kind": name, "fields": {f.name: _value(getattr(spec, f.name))
                                     for f in dataclasses.fields(spec)}}


def _value(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return {"int": str(v)}   # exact at any width (JSON readers may round big ints)
    if isinstance(v, float):
        return {"float": repr(v)}  # inf and nan included
    if isinstance(v, sympy.Basic):
        return {"sym": _sym(v)}
    if isinstance(v, ArrayType):
        return {"array": _type(v)}
    if isinstance(v, tuple):
        return {"tuple": [_value(x) for x in v]}
    if isinstance(v, list):
        return {"list": [_value(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[str(k), _value(x)] for k, x in v.items()]}
    if is_diagram(v):
        return {"diagram": to_data(v)}
    if dataclasses.is_dataclass(v):
        return {"spec": _spec(v)}
    raise SerialError(f"cannot write a {type(v).__name__} as data: {v!r}")


def _sym(e) -> dict:
    if isinstance(e, sympy.Symbol):
        return {"symbol": e.name, "assume": {k: bool(x) for k, x in
                                             sorted(e._assumptions_orig.items())}}
    if isinstance(e, sympy.Integer):
        return {"integer": str(int(e))}
    if isinstance(e, sympy.Rational):
        return {"rational": [str(e.p), str(e.q)]}
    if isinstance(e, sympy.Float):
        return {"float": sympy.srepr(e)[len("Float('"):].split("'")[0], "prec": e._prec}
    for name, cls in _SYMPY.items():
        if e.func is cls:
            return {"f": name, "args": [_sym(a) for a in e.args]}
    if e in (sympy.pi, sympy.E, sympy.oo, -sympy.oo, sympy.nan):
        return {"const": str(e)}
    raise SerialError(f"cannot write the size expression {e} as data")


# ----------------------------------------------------------------------------- reading
def from_data(data, depth: int = 0):
    """The diagram ``data`` describes, rebuilt from napkin's primitives (SerialError when
    it is malformed, names something napkin does not know, or does not type-check)."""
    _need(depth < MAX_DEPTH, "diagram", "nests too deep")
    _need(isinstance(data, dict) and data.get("format") == FORMAT, "diagram",
          f"is not {FORMAT!r} data")
    _need(set(data) == {"format", "inputs", "boxes", "outputs"}, "diagram",
          f"has fields {sorted(map(str, data))} (want format, inputs, boxes, outputs)")
    inputs, boxes, outputs = data["inputs"], data["boxes"], data["outputs"]
    for what, x in (("inputs", inputs), ("boxes", boxes), ("outputs", outputs)):
        _need(isinstance(x, list), what, "is not a list")
    _need(len(boxes) <= MAX_BOXES, "boxes", f"more than {MAX_BOXES:,}")
    b = GraphBuilder()
    wires = [b.input(_read_ob(ob, f"input {i}", depth)) for i, ob in enumerate(inputs)]
    for i, box in enumerate(boxes):
        where = f"box {i}"
        _need(isinstance(box, dict) and set(box) == {"name", "spec", "ins", "outs"}, where,
              "wants exactly name, spec, ins, outs")
        _need(isinstance(box["name"], str), where, "name is not text")
        ins = [_wire(w, len(wires), where) for w in _list(box["ins"], where)]
        spec = _read_spec(box["spec"], where, depth)
        dom = markov.Ty(*(b.graph.nodes[wires[w]]["ob"] for w in ins))
        declared = [_read_ob(ob, where, depth) for ob in _list(box["outs"], where)]
        try:
            inferred = spec.infer(tuple(ob.type for ob in dom.inside))
        except Exception as e:  # noqa: BLE001 - data that does not type-check
            raise SerialError(f"{where} ({box['name']}): its spec does not type-check on its "
                              f"inputs: {e}") from None
        _need(list(inferred) == [ob.type for ob in declared], where,
              f"declares outputs {[str(ob.type) for ob in declared]} but its spec makes "
              f"{[str(t) for t in inferred]}")
        op = Op(box["name"], dom, markov.Ty(*declared), data=spec)
        wires += b.op(op, [wires[w] for w in ins])
    outs = [wires[_wire(w, len(wires), "outputs")] for w in outputs]
    try:
        return to_diagram(b.finish(outs))
    except NapkinError as e:
        raise SerialError(f"the data's wiring is no diagram: {e}") from None


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise SerialError(f"diagram data: {where} {what}")


def _list(x, where):
    _need(isinstance(x, list), where, "wants a list")
    return x


def _wire(w, n: int, where: str) -> int:
    _need(type(w) is int and 0 <= w < n, where, f"reads wire {w!r}, which is not made "
                                                f"before it (0..{n - 1})")
    return w


def _read_ob(ob, where, depth):
    _need(isinstance(ob, dict) and set(ob) == {"name", "type"} and isinstance(ob["name"], str),
          where, "has a wire that is not {name, type}")
    return ArrayOb(ob["name"], _read_type(ob["type"], where, depth))


def _read_type(t, where, depth):
    _need(isinstance(t, dict) and set(t) == {"axes", "dtype"} and isinstance(t["dtype"], str),
          where, "has an array type that is not {axes, dtype}")
    try:
        axes = []
        for a in _list(t["axes"], where):
            _need(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str), where,
                  "has an axis that is not [name, size]")
            axes.append(Axis(a[0], _read_value(a[1], where, depth)))
        return ArrayType(tuple(axes), t["dtype"])
    except SerialError:
        raise
    except NapkinError as e:
        raise SerialError(f"diagram data: {where}: {e}") from None


def _read_spec(s, where, depth):
    _need(isinstance(s, dict) and set(s) == {"kind", "fields"} and isinstance(s["fields"], dict),
          where, "has a spec that is not {kind, fields}")
    cls = SPECS.get(s["kind"]) if isinstance(s["kind"], str) else None
    _need(cls is not None, where, f"names {s['kind']!r}, which is not one of napkin's "
                                  f"primitives ({', '.join(sorted(SPECS))})")
    names = {f.name for f in dataclasses.fields(cls)}
    _need(set(s["fields"]) <= names, where,
          f"gives {s['kind']} fields it does not have: {sorted(set(s['fields']) - names)}")
    fields = {k: _read_value(v, where, depth + 1) for k, v in s["fields"].items()}
    try:
        return cls(**fields)
    except Exception as e:  # noqa: BLE001 - fields a spec refuses
        raise SerialError(f"diagram data: {where}: {s['kind']}({', '.join(sorted(fields))}) "
                          f"refused: {type(e).__name__}: {e}") from None


def _read_value(v, where, depth):
    _need(depth < MAX_DEPTH, where, "nests too deep")
    if v is None or isinstance(v, (bool, str)):
        return v
    _need(isinstance(v, dict) and len(v) == 1, where, f"has a value {str(v)[:60]!r} that is "
                                                      f"not tagged data")
    (tag, x), = v.items()
    if tag == "int":
        return _int(x, where)
    if tag == "float":
        _need(isinstance(x, str), where, "has a float that is not text")
        try:
            return float(x)
        except ValueError:
            raise SerialError(f"diagram data: {where}: {x[:40]!r} is not a float") from None
    if tag == "sym":
        return _read_sym(x, where, depth + 1)
    if tag == "array":
        return _read_type(x, where, depth + 1)
    if tag in ("tuple", "list"):
        items = [_read_value(y, where, depth + 1) for y in _list(x, where)]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict":
        out = {}
        for kv in _list(x, where):
            _need(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str), where,
                  "has a dict entry that is not [key, value]")
            out[kv[0]] = _read_value(kv[1], where, depth + 1)
        return out
    if tag == "diagram":
        return from_data(x, depth + 1)
    if tag == "spec":
        return _read_spec(x, where, depth + 1)
    raise SerialError(f"diagram data: {where} has a value tagged {tag!r} (known: int, float, "
                      f"sym, array, tuple, list, dict, diagram, spec)")


def _int(x, where) -> int:
    _need(isinstance(x, str) and len(x) <= 4000 and x.lstrip("-").isdigit(), where,
          f"has an integer {str(x)[:40]!r} that is not decimal text")
    return int(x)


def _read_sym(s, where, depth):
    _need(depth < MAX_DEPTH and isinstance(s, dict), where, "has a size that is not data")
    if set(s) == {"symbol", "assume"}:
        assume = s["assume"]
        _need(isinstance(s["symbol"], str) and isinstance(assume, dict)
              and set(assume) <= _ASSUMPTIONS and all(isinstance(x, bool) for x in assume.values()),
              where, f"has a symbol with assumptions outside {sorted(_ASSUMPTIONS)}")
        return sympy.Symbol(s["symbol"], **assume)
    if set(s) == {"integer"}:
        return sympy.Integer(_int(s["integer"], where))
    if set(s) == {"rational"}:
        p, q = _list(s["rational"], where)
        return sympy.Rational(_int(p, where), _int(q, where))
    if set(s) == {"float", "prec"}:
        _need(isinstance(s["float"], str) and type(s["prec"]) is int and 1 <= s["prec"] <= 4096,
              where, "has a malformed float")
        try:
            return sympy.Float(s["float"], precision=s["prec"])
        except (ValueError, TypeError):
            raise SerialError(f"diagram data: {where}: {s['float'][:40]!r} is no float") from None
    if set(s) == {"const"}:
        consts = {str(c): c for c in (sympy.pi, sympy.E, sympy.oo, -sympy.oo, sympy.nan)}
        _need(s["const"] in consts, where, f"names an unknown constant {s['const']!r}")
        return consts[s["const"]]
    if set(s) == {"f", "args"}:
        f = _SYMPY.get(s["f"]) if isinstance(s["f"], str) else None
        _need(f is not None, where, f"has a size made with {s['f']!r} (known: "
                                    f"{', '.join(_SYMPY)})")
        return f(*(_read_sym(a, where, depth + 1) for a in _list(s["args"], where)))
    raise SerialError(f"diagram data: {where} has a size that is not a known form")


__all__ = ["FORMAT", "SPECS", "SerialError", "from_data", "to_data"]
