"""Round trip diagram -> networkx view -> diagram on random well-typed diagrams."""
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from napkin.core.arrays import ArrayType, Axis, array_types
from napkin.core.ir import ops, to_diagram, to_graph
from napkin.core.primitives import Contract, EvalContext, Map, Reduce, Softmax, Zip
from napkin.core.semantics import box_function, evaluate
from napkin.frontend.trace import Builder

jax.config.update("jax_enable_x64", True)

AXES = {n: Axis(n, s) for n, s in zip("abc", (2, 3, 4))}
MAPS = [Map("tanh"), Map("neg"), Map("sigmoid"), Map("abs"), Map("exp"),
        Map("scale", 0.5), Map("add_const", 1.25)]
ZIPS = ["add", "sub", "mul", "max", "min"]
REDUCES = ["sum", "max", "mean", "logsumexp"]
KINDS = ["map", "zip", "reduce", "contract", "softmax"]


@st.composite
def random_programs(draw, max_ops: int = 8):
    """A Builder holding a random DAG of ops, and the list of its outputs.

    Values are picked uniformly among all earlier values, so some are used
    zero times, some once and some several times (also twice by one op);
    outputs may be inputs, and may repeat."""
    b = Builder("random")
    vals = []
    for i in range(draw(st.integers(1, 3))):
        names = draw(st.lists(st.sampled_from("abc"), unique=True, max_size=3))
        vals.append(b.input(f"x{i}", ArrayType(tuple(AXES[n] for n in names), "f64")))
    for _ in range(draw(st.integers(0, max_ops))):
        kind = draw(st.sampled_from(KINDS))
        with_axes = [v for v in vals if v.type.axes]
        if kind in ("reduce", "softmax") and not with_axes:
            kind = "map"
        if kind == "map":
            spec, args = draw(st.sampled_from(MAPS)), [draw(st.sampled_from(vals))]
        elif kind == "zip":
            spec = Zip(draw(st.sampled_from(ZIPS)))
            args = [draw(st.sampled_from(vals)), draw(st.sampled_from(vals))]
        elif kind in ("reduce", "softmax"):
            x = draw(st.sampled_from(with_axes))
            axis = draw(st.sampled_from(x.type.names))
            spec = Reduce(draw(st.sampled_from(REDUCES)), axis) if kind == "reduce" else Softmax(axis)
            args = [x]
        else:
            args = draw(st.lists(st.sampled_from(vals), min_size=1, max_size=3))
            union = list(dict.fromkeys(n for a in args for n in a.type.names))
            perm = draw(st.permutations(union))
            spec = Contract(tuple(perm[:draw(st.integers(0, len(union)))]))
        vals += b.apply(spec, args)
    outputs = draw(st.lists(st.sampled_from(vals), min_size=1, max_size=4))
    return b, outputs


def random_inputs(diagram, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=tuple(int(s) for s in t.shape)) for t in array_types(diagram.dom)]


def run_graph(graph, xs):
    """Reference: evaluate the ir graph directly, op by op (no diagram involved)."""
    env = dict(zip(graph.graph["inputs"], xs))
    ctx = EvalContext()
    for n in ops(graph):
        node = graph.nodes[n]
        outs = box_function(node["box"], ctx)(*(env[v] for v in node["ins"]))
        env.update(zip(node["outs"], outs))
    return [env[v] for v in graph.graph["outputs"]]


def as_list(result, n):
    return [result] if n == 1 else list(result)


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs())
def test_random_diagram_round_trip(program):
    b, outputs = program
    graph = b.gb.finish([o.node for o in outputs])
    d = to_diagram(graph)
    n_ops = len(ops(graph))
    g1 = to_graph(d)
    d2 = to_diagram(g1)
    assert d2.dom == d.dom and d2.cod == d.cod
    assert len(d.dom) == len(graph.graph["inputs"]) and len(d.cod) == len(outputs)
    assert len(ops(g1)) == n_ops
    assert len(ops(to_graph(d2))) == n_ops
    xs = random_inputs(d)
    want = run_graph(graph, xs)
    assert_same(as_list(evaluate(d)(*xs), len(outputs)), want)
    assert_same(as_list(evaluate(d2)(*xs), len(outputs)), want)
    assert_same(run_graph(g1, xs), want)


def test_outputs_that_are_inputs_and_repeat():
    b = Builder("wires")
    x = b.input("x", ArrayType((AXES["a"], AXES["b"]), "f64"))
    y = b.input("y", ArrayType((AXES["b"],), "f64"))
    b.input("unused", ArrayType((AXES["c"],), "f64"))
    (s,) = b.apply(Zip("add"), [x, y])
    d = b.build([y, s, x, s, y])
    d2 = to_diagram(to_graph(d))
    assert d2.dom == d.dom and d2.cod == d.cod
    xs = random_inputs(d, 1)
    got = evaluate(d2)(*xs)
    assert_same(got, [xs[1], xs[0] + xs[1], xs[0], xs[0] + xs[1], xs[1]])
    assert len(ops(to_graph(d2))) == 1


def test_no_ops_only_wiring():
    b = Builder("swap")
    x = b.input("x", ArrayType((AXES["a"],), "f64"))
    y = b.input("y", ArrayType((AXES["b"],), "f64"))
    d = b.build([y, x, x])
    d2 = to_diagram(to_graph(d))
    assert d2.dom == d.dom and d2.cod == d.cod
    xs = random_inputs(d, 2)
    assert_same(evaluate(d2)(*xs), [xs[1], xs[0], xs[0]])


@pytest.mark.parametrize("n", [320])
def test_long_chain_round_trip(n):
    b = Builder("chain")
    x0 = b.input("x", ArrayType((AXES["a"], AXES["b"]), "f64"))
    x = x0
    for i in range(n // 2):
        (x,) = b.apply(Map("tanh"), [x])
        (x,) = b.apply(Zip("add"), [x, x0])  # x0 stays live along the whole chain
    d = b.build([x])
    assert sum(1 for box in d.boxes if hasattr(box, "spec")) == n
    g = to_graph(d)
    assert len(ops(g)) == n
    d2 = to_diagram(g)
    assert d2.dom == d.dom and d2.cod == d.cod
    (xs,) = random_inputs(d, 3)
    want = xs
    for _ in range(n // 2):
        want = np.tanh(want) + xs
    np.testing.assert_allclose(evaluate(d)(xs), want, rtol=1e-12)
    np.testing.assert_allclose(evaluate(d2)(xs), want, rtol=1e-12)


def test_malformed_graphs_are_one_line_graph_errors():
    """What cannot be emitted is a GraphError naming the wire, not a ValueError from inside."""
    from discopy import markov

    from napkin.core.arrays import ArrayOb
    from napkin.core.errors import GraphError, NapkinError
    from napkin.core.ir import GraphBuilder

    x = Axis("x", "x")
    b = GraphBuilder()
    v = b.input(ArrayOb("X", ArrayType((x,))))
    g = b.finish([v])
    g.graph["inputs"] = [v, v]
    with pytest.raises(GraphError, match=r"input X\[x\] is listed twice"):
        to_diagram(g)
    b = GraphBuilder()
    v = b.input(ArrayOb("X", ArrayType((x,))))
    stray = b.value(ArrayOb("Y", ArrayType((x,))))  # produced by no op, not an input
    with pytest.raises(GraphError, match="Y"):
        to_diagram(b.finish([v, stray]))
    ob = ArrayOb("X", ArrayType((x,)))
    merge = markov.Merge(markov.Ty(ob), 2)
    with pytest.raises(GraphError, match="merge"):
        to_graph(merge)
    assert issubclass(GraphError, NapkinError)
