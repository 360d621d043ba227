"""A diagram as data (napkin.core.serial): what `napkin check` judges a `from` file by.

Every diagram napkin makes comes back with the same fingerprint; data that names
something napkin does not know, or that does not type-check, is refused in one line."""
from __future__ import annotations

import copy
import json

import pytest

from napkin.certify.certificate import fingerprint
from napkin.core.serial import SerialError, from_data, to_data
from napkin.frontend.grad import grad
from napkin.frontend.library import LIBRARY, get


def _round_trip(d):
    return from_data(json.loads(json.dumps(to_data(d))))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_every_library_diagram_and_its_backward_round_trips(dtype):
    for name in LIBRARY:
        d = get(name).diagram(dtype)
        for x in (d, grad(d)):
            assert fingerprint(_round_trip(x)) == fingerprint(x), name


def test_a_streamed_program_round_trips():
    """Group and stream boxes hold diagrams (bodies, accumulators): they nest as data."""
    import napkin
    program = napkin.optimize("attention").program
    assert fingerprint(_round_trip(program)) == fingerprint(program)


def _attention_data():
    return json.loads(json.dumps(to_data(get("attention").diagram("f32"))))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["boxes"][0]["spec"].update(kind="os.system"), "not one of napkin's primitives"),
    (lambda d: d["boxes"][0]["spec"].update(kind="EvalContext"), "not one of napkin's"),
    (lambda d: d["boxes"][1].update(ins=[99]), "reads wire 99"),
    (lambda d: d["boxes"][0]["outs"][0]["type"]["axes"].pop(), "declares outputs"),
    (lambda d: d["inputs"][0]["type"]["axes"][0].__setitem__(
        1, {"sym": {"f": "__import__", "args": []}}), "made with '__import__'"),
    (lambda d: d["inputs"][0]["type"].update(dtype="object"), "unknown dtype"),
    (lambda d: d["boxes"][0]["spec"]["fields"].update(evil={"int": "1"}), "fields it does not"),
    (lambda d: d.update(format="pickle"), "is not 'napkin-diagram/1'"),
    (lambda d: d["boxes"][0]["spec"]["fields"].update(out={"code": "print(1)"}), "tagged 'code'"),
])
def test_malformed_data_is_refused_in_one_line(edit, message):
    data = _attention_data()
    edit(data)
    with pytest.raises(SerialError, match=message) as e:
        from_data(data)
    assert "\n" not in str(e.value)


def test_deep_nesting_is_refused():
    value = {"int": "1"}
    for _ in range(200):
        value = {"tuple": [value]}
    data = _attention_data()
    data["boxes"][0]["spec"]["fields"]["out"] = value
    with pytest.raises(SerialError, match="nests too deep"):
        from_data(copy.deepcopy(data))


def test_a_streams_merge_travels_with_it():
    """The merge a stream keeps (what a parallel split folds with) is part of the data and
    of the fingerprint: rebuilt from JSON it is the same diagram; dropped, the program is
    another one."""
    import dataclasses
    from napkin.core.ir import view
    from napkin.core.streamed import Stream
    from proofs._core import stream_rule, with_stream
    from proofs.softmax_contraction import generic
    st = stream_rule(generic(), "x")
    assert st.spec.merge is not None
    assert [o.name for o in st.spec.merge.dom.inside] == ["mu", "z", "o", "mu_y", "z_y", "o_y"]
    back = from_data(json.loads(json.dumps(to_data(st.rewritten))))
    assert fingerprint(back) == fingerprint(st.rewritten)
    (box,) = [view(back).nodes[n]["box"] for n in view(back).nodes
              if view(back).nodes[n]["kind"] == "op"]
    assert isinstance(box.spec, Stream) and box.spec.merge is not None
    without = with_stream(st, dataclasses.replace(st.spec, merge=None))
    assert without.spec.merge is None
    assert fingerprint(without.rewritten) != fingerprint(st.rewritten)
