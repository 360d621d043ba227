"""The graph to a napkin diagram: its live nodes, in order, applied as napkin ops inside a
trace over the arguments' types; JAX's dtype kept where napkin's promotion gives another."""
from __future__ import annotations

from napkin.core.arrays import ArrayType, Axis
from napkin.frontend.jaxpr.graph import C, Graph, Node, Uses
from napkin.frontend.jaxpr.naming import flat
from napkin.frontend.jaxpr.vocabulary import PATTERN_ONLY, SUPPORTED, fail
from napkin.core.primitives import (Cast, Compare, Contract, Fill, Map, Mask, Positions, Reduce,
                               Softmax, TakeAlong, Where, Zip)


def emit(graph: Graph, outs, invars, naming, argnames, label):
    """The diagram computing ``outs`` from the arguments ``invars`` (named ``argnames``)."""
    from napkin.frontend import ops
    from napkin.frontend.trace import trace
    if not outs:
        fail(f"{label} returns nothing")
    for i, o in enumerate(outs):
        if isinstance(o, C):
            fail(f"output {i} of {label} is a constant ({o.value}) that depends on no "
                 f"argument; napkin diagrams compute their outputs from their inputs")
    uses = Uses(graph, outs)
    for o in outs:  # a contraction only returned: give it the output's axis order itself
        n, want = o.node, tuple(flat(o.dims))
        if n.op == "contract" and uses.get(id(n)) == 1 and set(n.p["out"]) == set(want):
            n.p["out"] = want
    def axis(a):  # a part napkin named itself has the fixed size it has in fn
        return Axis(a, naming.new_axes.get(a, a))

    pairs = []
    for i, v in enumerate(invars):
        axes = tuple(axis(a) for a in flat(naming.dims(v)))
        pairs.append((argnames[i], ArrayType(axes, graph.inputs[i].dtype)))

    def body(*args):
        vals = {}
        for n in uses.live:
            vals[id(n)] = _node(n, [vals[id(a)] for a in n.args], args, graph, ops)
        results = []
        for o in outs:
            v = vals[id(o.node)]
            want = flat(o.dims)
            missing = [a for a in want if not v.type.has(a)]
            if missing:  # broadcast along axes the value lacks: materialise them
                t = ArrayType(tuple(axis(a) for a in missing), v.type.dtype)
                v = ops.apply(Zip("add"), v, ops.apply(Fill(0.0, t))[0])[0]
            if list(v.type.names) != want:
                v = ops.apply(Contract(tuple(want)), v)[0]
            results.append(v)
        return results if len(results) > 1 else results[0]
    return trace(body, pairs, label)


def _node(n: Node, args, inputs, graph, ops):
    """The napkin op for node ``n`` applied to ``args``."""
    op, p = n.op, n.p

    def one(spec, *xs):
        return ops.apply(spec, *xs)[0]
    if op == "input":
        v = inputs[p["index"]]
    elif op == "map":
        if p["fn"] in PATTERN_ONLY:
            fail(f"primitive {p['fn']} ({n.src}) has no napkin primitive (napkin reads it "
                 f"only inside gelu, x·(1 + erf(x/√2))/2, and logsumexp's shift); "
                 f"supported: {'; '.join(SUPPORTED)}")
        v = one(Map(p["fn"], p["param"]), args[0])
    elif op == "zip":
        v = one(Zip(p["fn"]), *args)
    elif op == "reduce":
        v = one(Reduce(p["fn"], p["axis"]), args[0])
    elif op == "contract":
        v = one(Contract(tuple(p["out"])), *args)
    elif op == "compare":
        v = one(Compare(p["fn"], p["const"]), *args)
    elif op == "where":
        v = one(Where(p["a"], p["b"]), *args)
    elif op == "and":  # a and b = where(a, b, a)
        v = one(Where(), args[0], args[1], args[0])
    elif op == "or":   # a or b = where(a, a, b)
        v = one(Where(), args[0], args[0], args[1])
    elif op == "not":
        v = one(Compare("eq", 0), args[0])
    elif op == "positions":
        v = one(Positions(p["axis"], graph.size(p["axis"]), n.dtype))
    elif op == "take":
        v = one(TakeAlong(p["axis"]), *args)
    elif op == "cast":
        v = args[0] if args[0].type.dtype == p["dtype"] else one(Cast(p["dtype"]), args[0])
    elif op == "softmax":
        v = one(Softmax(p["axis"]), args[0])
    elif op == "mask":
        v = one(Mask(p["kind"], p["q"], p["k"], width=p.get("width"), offset=p["offset"]),
                args[0])
    else:  # pragma: no cover — every node op is emitted above
        raise AssertionError(op)
    if op != "input" and v.type.dtype != n.dtype:
        v = one(Cast(n.dtype), v)  # keep JAX's dtype where napkin's promotion differs
    return v
