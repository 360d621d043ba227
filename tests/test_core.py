"""Diagram core: types, composition errors, primitives' roles, tracing."""
import numpy as np
import pytest
import sympy
from discopy import markov

import napkin as nk
from napkin import ops
from napkin.core.arrays import ArrayType, Axis, axes, wire
from napkin.core.diagram import Diagram, Id
from napkin.core.errors import CompositionError, NapkinError, ShapeError
from napkin.core.op import make_op
from napkin.core.primitives import Cast, Contract, Fill, Map, Mask, Reduce, Softmax, Zip, roles

q, x, k, d, h = axes("q x k d h")


def test_axis_sizes_int_or_symbol():
    assert Axis("q", 8).size == 8
    assert isinstance(Axis("q", "q").size, sympy.Symbol)
    with pytest.raises(NapkinError, match="positive"):
        Axis("q", 0)
    with pytest.raises(NapkinError, match="identifier"):
        Axis("1q", 3)
    with pytest.raises(NapkinError, match="repeats an axis"):
        ArrayType((q, q))
    with pytest.raises(NapkinError, match="unknown dtype"):
        ArrayType((q,), "f12")


def test_wires_compare_by_axes_not_by_name():
    assert wire("S", q, x) == wire("P", q, x)
    assert wire("S", q, x) != wire("S", x, q)
    assert wire("S", q, x) != wire("S", q, x, dtype="bf16")
    assert wire("S", Axis("q", 4)) != wire("S", Axis("q", 5))


def test_composition_error_names_both_sides():
    qk = make_op(Contract(("q", "x")), wire("Q", q, d) @ wire("K", x, d), ["S"], "QK^T")
    sm = make_op(Softmax("k"), wire("S", q, k), ["P"], "softmax")
    with pytest.raises(CompositionError) as e:
        qk >> sm
    assert str(e.value) == "cannot compose: QK^T outputs S[q,x] but softmax expects S[q,k]"


def test_composition_error_sizes_and_arity():
    a = make_op(Map("exp"), wire("S", Axis("q", 4)), ["S"], "exp")
    b = make_op(Map("exp"), wire("S", Axis("q", 5)), ["S"], "exp2")
    with pytest.raises(CompositionError, match=r"q=4.*q=5"):
        a >> b
    two = make_op(Zip("add"), wire("A", q) @ wire("B", q), ["C"], "add")
    with pytest.raises(CompositionError, match="outputs 1 array"):
        a.cod and make_op(Map("exp"), wire("A", q), ["A"], "e") >> two


def test_diagrams_stay_napkin_diagrams():
    f = make_op(Map("exp"), wire("S", q), ["S"], "exp")
    assert isinstance(f >> f, Diagram) and isinstance(f @ f, Diagram)
    assert isinstance(Diagram.copy(wire("S", q)), Diagram)
    assert isinstance(Id(wire("S", q)), Diagram)


ROLE_CASES = [
    # spec, input types, woven, reduced, broadcast
    (Contract(("q", "x")), [ArrayType((q, d)), ArrayType((x, d))], ["q", "x"], ["d"], {0: ["x"], 1: ["q"]}),
    (Contract(("q",)), [ArrayType((q, x))], ["q"], ["x"], {}),
    (Map("exp"), [ArrayType((q, x))], ["q", "x"], [], {}),
    (Map("scale", 0.5), [ArrayType((q,))], ["q"], [], {}),
    (Map("softcap", 30), [ArrayType((q,))], ["q"], [], {}),
    (Zip("add"), [ArrayType((q, x)), ArrayType((q,))], ["q", "x"], [], {1: ["x"]}),
    (Zip("max"), [ArrayType((q,)), ArrayType((x,))], ["q", "x"], [], {0: ["x"], 1: ["q"]}),
    (Reduce("sum", "x"), [ArrayType((q, x))], ["q"], ["x"], {}),
    (Reduce("max", "x"), [ArrayType((q, x))], ["q"], ["x"], {}),
    (Reduce("logsumexp", "x"), [ArrayType((q, x))], ["q"], ["x"], {}),
    (Reduce("mean", "q"), [ArrayType((q, x))], ["x"], ["q"], {}),
    (Softmax("x"), [ArrayType((q, x))], ["q", "x"], [], {}),
    (Mask("causal", "q", "x"), [ArrayType((q, x))], ["q", "x"], [], {}),
    (Mask("window", "q", "x", width=3), [ArrayType((q, x))], ["q", "x"], [], {}),
    (Mask("padding"), [ArrayType((q, x)), ArrayType((x,))], ["q", "x"], [], {1: ["q"]}),
    (Cast("bf16"), [ArrayType((q,))], ["q"], [], {}),
    (Fill(0.0, ArrayType((q,))), [], ["q"], [], {}),
]


@pytest.mark.parametrize("spec,ins,woven,reduced,broadcast", ROLE_CASES,
                         ids=[c[0].label() for c in ROLE_CASES])
def test_every_primitive_declares_roles(spec, ins, woven, reduced, broadcast):
    outs = spec.infer(tuple(ins))
    r = roles(tuple(ins), outs)
    assert r["woven"] == woven and r["reduced"] == reduced and r["broadcast"] == broadcast


@pytest.mark.parametrize("spec,ins,msg", [
    (Contract(("q", "z")), [ArrayType((q, d))], "output axis z is in no input"),
    (Contract(("q",)), [ArrayType((q, Axis("d", 4))), ArrayType((Axis("d", 5),))], "axis d has size"),
    (Reduce("sum", "x"), [ArrayType((q,))], "has no axis 'x'"),
    (Softmax("x"), [ArrayType((q,))], "has no axis 'x'"),
    (Map("exp"), [ArrayType((q,)), ArrayType((q,))], "takes 1 input"),
    (Zip("add"), [ArrayType((q,))], "takes 2 input"),
    (Mask("causal", "q", "k"), [ArrayType((q, x))], "key axis 'k'"),
    (Mask("padding"), [ArrayType((q,)), ArrayType((x,))], "padding mask has axis x"),
])
def test_type_errors_are_named(spec, ins, msg):
    with pytest.raises(NapkinError, match=msg):
        spec.infer(tuple(ins))


@pytest.mark.parametrize("bad", [lambda: Map("expp"), lambda: Map("scale"), lambda: Map("exp", 2),
                                 lambda: Zip("pow"), lambda: Reduce("prod", "x"),
                                 lambda: Mask("diag", "q", "x"), lambda: Mask("window", "q", "x", width=0)])
def test_bad_primitive_parameters(bad):
    with pytest.raises(NapkinError):
        bad()


def test_tracer_builds_copies_and_discards():
    @nk.algorithm(X=(q, x))
    def f(X):
        m = ops.max_(X, x)
        return ops.sub(X, m), ops.exp(X)  # X used three times
    assert len(f.dom) == 1 and len(f.cod) == 2
    assert any(isinstance(b, markov.Copy) for b in f.boxes)
    y = np.random.default_rng(0).standard_normal((3, 4))
    a, b = nk.evaluate(f)(y)
    np.testing.assert_allclose(a, y - y.max(1, keepdims=True))
    np.testing.assert_allclose(b, np.exp(y))


def test_tracer_errors():
    with pytest.raises(NapkinError, match="inside an @algorithm"):
        ops.exp(None)
    with pytest.raises(NapkinError, match="exp: .*takes|expected a traced array"):
        nk.trace(lambda X: ops.exp(3), {"X": (q,)})
    with pytest.raises(NapkinError, match="axis d has size"):
        nk.trace(lambda A, B: ops.contract(A, B, out="q"),
                 {"A": (q, Axis("d", 3)), "B": (Axis("d", 4),)})


def test_operators_and_constants():
    @nk.algorithm(A=(q,), B=(q,))
    def f(A, B):
        return (A + B) * 2.0 - A / B, -A
    a, b = np.arange(1.0, 4.0), np.arange(2.0, 5.0)
    u, v = nk.evaluate(f)(a, b)
    np.testing.assert_allclose(u, (a + b) * 2 - a / b)
    np.testing.assert_allclose(v, -a)


def test_shape_errors_name_input_and_axis():
    from napkin.frontend.library import get
    f = nk.evaluate(get("attention").diagram())
    Q, K = np.zeros((3, 4)), np.zeros((5, 4))
    with pytest.raises(ShapeError, match=r"K\[x,d\]: axis d should have size 4, got 6"):
        f(Q, np.zeros((5, 6)), K)
    with pytest.raises(ShapeError, match="expected 3 input arrays"):
        f(Q, K)
    with pytest.raises(ShapeError, match="expected 2 axes"):
        f(Q, K, np.zeros(5))


def test_weave_marks_new_axis_woven_and_broadcast():
    from napkin.frontend.library import get
    g = get("mqa").diagram()  # attention woven over h for Q only
    qk = next(b for b in g.boxes if getattr(b, "name", "") == "QK^T")
    r = qk.roles()
    assert "h" in r["woven"] and r["broadcast"][1] == ["h", "q"]
    with pytest.raises(NapkinError, match="no input named"):
        nk.weave(get("attention").diagram(), h, inputs=["Z"])
    with pytest.raises(NapkinError, match="already has an axis"):
        nk.weave(get("mha").diagram(), h)
