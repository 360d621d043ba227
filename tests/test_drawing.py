"""Pictures: PNG/SVG by suffix, labelled wires and boxes, sizes that grow."""
import re
import struct

import matplotlib
import pytest

from napkin import ops
from napkin.core.arrays import axes
from napkin.views.drawing import FORMATS, draw, draw_side_by_side, pretty
from napkin.core.errors import NapkinError
from napkin.frontend.library import get
from napkin.frontend.trace import Array, trace


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def svg_texts(path):
    return re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text())


@pytest.fixture(scope="module")
def attention():
    return get("attention").diagram()


def test_headless_and_no_figures_left(tmp_path, attention):
    import matplotlib.pyplot as plt
    draw(attention, tmp_path / "a.png")
    assert matplotlib.get_backend().lower() == "agg"
    assert plt.get_fignums() == []


def test_png_written(tmp_path, attention):
    out = draw(attention, tmp_path / "attention.png", title="attention")
    assert out == tmp_path / "attention.png"
    assert out.stat().st_size > 5000
    w, h = png_size(out)
    assert w > 300 and h > 500  # 7 layers, 3 wires


def test_svg_has_wire_labels_and_box_names(tmp_path, attention):
    texts = svg_texts(draw(attention, tmp_path / "attention.svg", title="my title"))
    for label in ("Q[q,d]", "K[x,d]", "V[x,d]", "S[q,x]", "P[q,x]", "O[q,d]"):
        assert label in texts
    for name in ("QK^T", "scale(1/sqrt(d))", "softmax_x", "PV"):
        assert name in texts
    assert "my title" in texts


def test_suffix_is_case_insensitive(tmp_path, attention):
    assert draw(attention, tmp_path / "a.SVG").read_text().lstrip().startswith("<?xml")


def test_woven_axes_in_labels(tmp_path):
    texts = svg_texts(draw(get("gqa").diagram(), tmp_path / "gqa.svg"))
    assert {"Q[k,r,q,d]", "K[k,x,d]", "O[k,r,q,d]"} <= set(texts)


def test_box_names_are_tidied(tmp_path):
    assert pretty("softcap(30.0000000000000)") == "softcap(30)"
    assert pretty("add_const(0.00000100000000000000)") == "add_const(1e-06)"
    assert pretty("scale(1/sqrt(d))") == "scale(1/sqrt(d))"
    texts = svg_texts(draw(get("softcap_attention").diagram(), tmp_path / "s.svg"))
    assert "softcap(30)" in texts


@pytest.mark.parametrize("name", ["a.pdf", "a.jpg", "a"])
def test_bad_suffix(tmp_path, attention, name):
    with pytest.raises(NapkinError) as e:
        draw(attention, tmp_path / name)
    msg = str(e.value)
    assert "\n" not in msg
    assert all(s in msg for s in FORMATS)
    if "." in name:
        assert name.split(".")[1] in msg


def test_missing_directory(tmp_path, attention):
    with pytest.raises(NapkinError, match="does not exist"):
        draw(attention, tmp_path / "nope" / "a.png")


def test_not_a_diagram(tmp_path):
    with pytest.raises(NapkinError, match="diagram"):
        draw("attention", tmp_path / "a.png")


def test_copy_and_discard(tmp_path):
    n, d = axes("n d")
    diagram = trace(lambda X, Y: ops.mul(X, ops.exp(X, as_="E"), as_="Z"),
                    {"X": Array(n, d), "Y": Array(d)})
    kinds = {type(b).__name__ for b in diagram.boxes}
    assert {"Copy", "Discard"} <= kinds
    texts = svg_texts(draw(diagram, tmp_path / "cd.svg"))
    assert {"X[n,d]", "Y[d]", "E[n,d]", "Z[n,d]", "exp", "mul"} <= set(texts)


def big_diagram(k=10):
    n, d = axes("n d")

    def f(X, Y):
        a, b = X, Y
        for _ in range(k):
            a, b = ops.mul(a, b, as_="A"), ops.exp(a, as_="B")
        return a
    return trace(f, {"X": Array(n, d), "Y": Array(n, d)}, "big")


def svg_height(path):
    return float(re.search(r'<svg[^>]*\sheight="([\d.]+)pt"', path.read_text()).group(1))


def test_big_diagram_grows(tmp_path, attention):
    big = big_diagram()
    assert len(big.boxes) >= 40
    out = draw(big, tmp_path / "big.svg")
    texts = svg_texts(out)
    assert texts.count("mul") == 10 and texts.count("exp") == 10 and "A[n,d]" in texts
    small = draw(attention, tmp_path / "small.svg")
    assert svg_height(out) > 4 * svg_height(small)  # a layer keeps its size


def test_figsize_override(tmp_path, attention):
    w, h = png_size(draw(attention, tmp_path / "a.png", figsize=(4, 3)))
    assert abs(w / h - 4 / 3) < 0.05


def test_side_by_side(tmp_path, attention):
    out = draw_side_by_side(attention, get("causal_attention").diagram(), tmp_path / "sbs.svg",
                            titles=("attention", "streamed"))
    texts = svg_texts(out)
    assert {"attention", "streamed", "→", "causal", "QK^T", "Q[q,d]"} <= set(texts)
    w, h = png_size(draw_side_by_side(attention, attention, tmp_path / "sbs.png"))
    assert w > h  # two pictures next to each other


def test_side_by_side_errors(tmp_path, attention):
    with pytest.raises(NapkinError, match="two titles"):
        draw_side_by_side(attention, attention, tmp_path / "x.png", titles=("a",))
    with pytest.raises(NapkinError, match=r"\.gif"):
        draw_side_by_side(attention, attention, tmp_path / "x.gif")
