"""A share of an axis that starts elsewhere than 0 (a device's, napkin.devices): the boxes
that read positions along it read them from a base it is handed.

A causal or window mask compares global positions, positions are global, a take along an
axis finds the global position its index names (napkin's semantics: ``EvalContext.offsets``).
Cut over devices, each device holds positions [base, base + share) of the axis; the
algorithm's block on that device is the same diagram with every position along the axis
shifted by the base — :func:`with_bases` writes it with one int32 scalar input per axis
(``<axis>_base``, after the algorithm's inputs):

* ``causal`` / ``window`` mask over (q, k) — the keep condition written out on shifted
  positions, ``k + k_base <= q + q_base + offset`` (and ``> … − width``), applied as a
  padding mask with the same fill: its meaning is the mask's, entry for entry;
* ``positions`` along the axis — plus the base;
* ``take`` along the axis — at ``index − base`` (its local position).

Only primitives napkin already streams and lowers are used; a padding mask is skipped by
its data (a chunk none of whose entries is kept is not folded), not by tile arithmetic.
"""
from __future__ import annotations

from napkin.core.errors import NapkinError


def base_name(axis: str) -> str:
    return f"{axis}_base"


def position_readers(diagram, axis: str) -> list:
    """The primitive boxes whose meaning depends on where along ``axis`` their entries are."""
    from napkin.core.ir import primitive_boxes
    out = []
    for b in primitive_boxes(diagram):
        spec = b.spec
        kind = getattr(spec, "kind", None)
        if kind == "mask" and axis in (spec.q, spec.k):
            out.append(b)
        elif kind in ("positions", "take") and spec.axis == axis:
            out.append(b)
    return out


def kept_band(diagram, q: str, k: str):
    """(low, high): the causal and window masks between ``q`` and ``k`` keep an entry only
    where low ≤ k − q ≤ high (low None: unbounded below); None where no such mask bounds them
    (every entry may be kept).  What a block of queries against a block of keys keeps
    nothing of is read off it (napkin.devices.plan prices a ring's steps by it)."""
    from napkin.core.ir import primitive_boxes
    low, high, found = None, None, False
    for b in primitive_boxes(diagram):
        spec = b.spec
        if getattr(spec, "kind", None) != "mask" or spec.kind_ not in ("causal", "window") \
                or (spec.q, spec.k) != (q, k):
            continue
        found = True
        high = spec.offset if high is None else min(high, spec.offset)
        if spec.kind_ == "window":
            lo = spec.offset - spec.width + 1
            low = lo if low is None else max(low, lo)
    return (low, high) if found else None


def keeps_any(band, rows: tuple, cols: tuple) -> bool:
    """Whether the queries [rows[0], rows[1]) against the keys [cols[0], cols[1]) keep an
    entry under ``band`` (:func:`kept_band`; None keeps everything)."""
    if band is None:
        return True
    low, high = band
    least, most = cols[0] - (rows[1] - 1), (cols[1] - 1) - rows[0]  # the range of k − q
    return least <= high and (low is None or most >= low)


def with_bases(diagram, axes: tuple):
    """``diagram`` with the positions along each of ``axes`` shifted by a scalar input of its
    own, in order after the inputs (the block of the algorithm a device holds)."""
    from napkin.core.arrays import ArrayType
    from napkin.core.ir import ops as op_order, to_graph
    from napkin.frontend import ops
    from napkin.frontend.trace import trace
    g = to_graph(diagram)
    n_in = len(diagram.dom.inside)
    pairs = [(ob.name, ob.type) for ob in diagram.dom.inside]
    pairs += [(base_name(a), ArrayType((), "int32")) for a in axes]

    def body(*args):
        vals = dict(zip(g.graph["inputs"], args[:n_in]))
        bases = dict(zip(axes, args[n_in:]))
        for n in op_order(g):
            node = g.nodes[n]
            box = node["box"]
            xs = [vals[v] for v in node["ins"]]
            names = [ob.name for ob in box.cod.inside]
            outs = _rebased(box, xs, bases, ops, names)
            vals.update(zip(node["outs"], outs))
        return [vals[v] for v in g.graph["outputs"]]
    label = getattr(diagram, "name", None) or "algorithm"
    return trace(body, pairs, str(label))


def _rebased(box, xs, bases, ops, names):
    from napkin.core.primitives import Compare, Mask, Positions, TakeAlong, Where, Zip
    spec = box.spec
    kind = getattr(spec, "kind", None)

    def position(axis, like):
        size = like.type.axis(axis).size
        p = ops.apply(Positions(axis, size, "int32"))[0]
        return ops.apply(Zip("add"), p, bases[axis])[0] if axis in bases else p
    if kind == "mask" and spec.kind_ in ("causal", "window") and (spec.q in bases
                                                                   or spec.k in bases):
        x = xs[0]
        gap = ops.apply(Zip("sub"), position(spec.k, x), position(spec.q, x))[0]  # k − q
        keep = ops.apply(Compare("le", spec.offset), gap)[0]
        if spec.kind_ == "window":
            after = ops.apply(Compare("gt", spec.offset - spec.width), gap)[0]
            keep = ops.apply(Where(), keep, after, keep)[0]  # keep and after
        return ops.apply(Mask("padding", fill=spec.fill), x, keep, name=box.name,
                         out_names=names)
    if kind == "positions" and spec.axis in bases:
        p = ops.apply(spec)[0]
        return ops.apply(Zip("add"), p, bases[spec.axis], name=box.name, out_names=names)
    if kind == "take" and spec.axis in bases:
        x, index = xs
        local = ops.apply(Zip("sub"), index, bases[spec.axis])[0]
        return ops.apply(TakeAlong(spec.axis), x, local, name=box.name, out_names=names)
    if kind in ("group", "stream"):
        raise NapkinError(f"{box.name}: the device level cuts an algorithm, not a streamed "
                          f"program")
    return ops.apply(spec, *xs, name=box.name, out_names=names)
