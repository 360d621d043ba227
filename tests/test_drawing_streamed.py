"""Pictures of streamed programs: groups and streams opened up as labelled frames."""
import re

import matplotlib
import pytest

from napkin.views.drawing_streamed import (
    LEVEL_COLORS, WireOb, draw_before_after, draw_streamed, flatten,
)
from napkin.core.errors import NapkinError
from napkin.core.ir import ops, to_graph
from napkin.frontend.library import get
from napkin.core.region import Site, body_at
from rewrites import RULES


def _program(name, steps):
    D = get(name).diagram("bf16")
    for rule, path, params in steps:
        n = len(ops(to_graph(body_at(D, path))))
        D = RULES[rule].apply(D, Site(path, tuple(range(n))), dict(params))
    return D


@pytest.fixture(scope="module")
def attention():
    return _program("attention", (("group_partition", (), {"axis": "q"}),
                                  ("stream_partition", (0,), {"axis": "x"})))


@pytest.fixture(scope="module")
def matmul():
    return _program("matmul", (("group_partition", (), {"axis": "a"}),
                               ("group_partition", (0,), {"axis": "c"}),
                               ("stream_partition", (0, 0), {"axis": "b"})))


def svg_texts(path):
    return re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text())


def test_flatten_frames_and_levels(attention):
    D, frames = flatten(attention, "h100")
    kinds = [f.kind for f in frames]
    assert kinds == ["group", "stream", "init", "update", "finalize"]
    assert frames[1].parent == frames[0].id and frames[3].parent == frames[1].id
    assert all(f.level == "smem" for f in frames)
    assert {ob.level for ob in D.dom.inside} == {"gmem"}
    labels = {str(ob): ob.level for box in D.boxes for ob in box.cod.inside
              if isinstance(ob, WireOb)}
    assert labels["Q[g_q,d]"] == "smem" and labels["K[s_x,d]"] == "smem"
    assert labels["O[q,d]"] == "gmem"
    assert {"mu[g_q]", "z[g_q]", "o[g_q,d]"} <= set(labels)
    names = {box.name for box in D.boxes}
    assert {"QK^T", "max_x", "fill(-inf)", "guard"} <= names
    assert frames[3].state == ("mu", "z", "o")  # what the update carries to the next chunk
    # an op follows what it reads as closely as it can (issue 31: mostly crossings): 22 -> 19
    assert sum(type(b).__name__ == "Swap" for b in D.boxes) <= 19
    # the init's boxes come before the update's first chunk enters (in their own section)
    kinds = [b.data.kind for b in D.boxes if getattr(b, "data", None) is not None]
    assert kinds.index("fill") < kinds.index("chunk")


def test_svg_shows_frames_tiles_state_and_levels(tmp_path, attention):
    import matplotlib.pyplot as plt
    out = draw_streamed(attention, tmp_path / "fa.svg", "h100", title="flash attention")
    texts = svg_texts(out)
    joined = "\n".join(texts)
    for label in ("Q[q,d]", "Q[g_q,d]", "K[s_x,d]", "V[s_x,d]", "S[g_q,s_x]", "mu[g_q]",
                  "z[g_q]", "o[g_q,d]", "O[q,d]"):
        assert label in texts, label
    for name in ("QK^T", "scale(1/sqrt(d))", "max_x", "exp", "fill(-inf)", "guard",
                 "init", "finalize", "flash attention"):
        assert name in texts, name
    assert "group q: g_q of q per SM, q/g_q groups @smem" in texts
    assert "stream x [softmax_contraction]" in texts
    assert "update: each chunk s_x of x" in texts
    assert "state mu, z, o: carried to the next chunk" in texts  # the loop back
    assert "gmem" in texts and "smem" in texts            # the legend
    svg = out.read_text().lower()
    assert LEVEL_COLORS["smem"].lower() in svg and LEVEL_COLORS["gmem"].lower() in svg
    assert "g_q" in joined and "s_x" in joined
    assert matplotlib.get_backend().lower() == "agg" and plt.get_fignums() == []


def test_png_with_tile_values_and_nested_groups(tmp_path, matmul):
    out = draw_streamed(matmul, tmp_path / "mm.png", "h100", tiles={"g_a": 128, "g_c": 256,
                                                                  "s_b": 64})
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    D, frames = flatten(matmul, "h100", tiles={"g_a": 128})
    assert [f.kind for f in frames][:2] == ["group", "group"]
    assert "A[g_a=128,s_b]" in {str(ob) for box in D.boxes for ob in box.cod.inside}


def test_before_after(tmp_path, attention):
    out = draw_before_after(get("attention").diagram("bf16"), attention, tmp_path / "ba.svg",
                            hardware="h100", tiles={"g_q": 128, "s_x": 64})
    texts = svg_texts(out)
    assert "softmax_x" in texts and "PV" in texts            # the algorithm
    assert "K[s_x=64,d]" in texts and "algorithm" in texts and "streamed program" in texts


def test_bad_path(tmp_path, attention):
    with pytest.raises(NapkinError, match="unsupported"):
        draw_streamed(attention, tmp_path / "x.jpg")
    with pytest.raises(NapkinError, match="does not exist"):
        draw_streamed(attention, tmp_path / "nope" / "x.png")
