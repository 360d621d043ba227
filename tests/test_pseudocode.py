"""Looped pseudocode: its listed loads/stores and declared buffers ARE the cost model."""
import re

import pytest
import sympy

from napkin.cost import cost
from napkin.core.errors import NapkinError
from napkin.hardware import get_hardware
from napkin.core.ir import ops, to_graph
from napkin.frontend.library import get
from napkin.views.pseudocode import expand, listed_memory, listed_transfers, pseudocode
from napkin.core.region import Site, body_at
from rewrites import RULES

H100 = get_hardware("h100")          # gmem > l2 > smem > registers
H100_2 = H100.two_level()            # gmem > smem (the search's default)
FP8 = {"Q": "fp8", "K": "fp8", "V": "f16"}

CHAINS = {
    "attention": (("group_partition", (), {"axis": "q"}),
                  ("stream_partition", (0,), {"axis": "x"})),
    "unpartitioned attention": (),
    "gqa": (("group_partition", (), {"axis": "q"}), ("stream_partition", (0,), {"axis": "x"}),
            ("group_partition", (), {"axis": "k"})),
    "matmul": (("group_partition", (), {"axis": "a"}), ("group_partition", (0,), {"axis": "c"}),
               ("stream_partition", (0, 0), {"axis": "b"})),
    "cross_entropy": (("group_partition", (), {"axis": "n"}),
                      ("stream_partition", (0,), {"axis": "v"})),
    "linear_cross_entropy": (("group_partition", (), {"axis": "n"}),
                             ("stream_partition", (0,), {"axis": "v"})),
    # a group at L2 holding a group at SMEM: staged inputs, transfers at two levels
    "two-level attention": (("group_partition", (), {"axis": "q", "level": "l2"}),
                            ("group_partition", (0,), {"axis": "q", "size": "w_q",
                                                       "level": "smem"}),
                            ("stream_partition", (0, 0), {"axis": "x"})),
    "register attention": (("group_partition", (), {"axis": "q"}),
                           ("group_partition", (0,), {"axis": "q", "size": "w_q",
                                                      "level": "registers"}),
                           ("stream_partition", (0, 0), {"axis": "x"})),
}
ALGO = {"unpartitioned attention": "attention", "two-level attention": "attention",
        "register attention": "attention"}
SIZES = {"q": 1024, "x": 2048, "d": 128, "a": 512, "b": 1024, "c": 256, "k": 2, "r": 4,
         "n": 256, "v": 4096, "g_q": 64, "w_q": 32, "s_x": 32, "g_a": 64, "g_c": 128,
         "s_b": 32, "g_n": 32, "s_v": 64, "g_k": 1}
_CACHE = {}


def program(name):
    if name not in _CACHE:
        D = get(ALGO.get(name, name)).diagram("bf16")
        for rule, path, params in CHAINS[name]:
            n_ops = len(ops(to_graph(body_at(D, path))))
            D = RULES[rule].apply(D, Site(path, tuple(range(n_ops))), dict(params))
        _CACHE[name] = D
    return _CACHE[name]


CASES = [(name, hw, dt) for name in CHAINS for hw in (H100, H100_2)
         for dt in ("bf16", None, FP8)]


@pytest.mark.parametrize("name,hw,dt", CASES,
                         ids=[f"{n}-{len(h.levels)}lv-{d if isinstance(d, str) or d is None else 'fp8'}"
                              for n, h, d in CASES])
def test_listing_is_the_cost_model(name, hw, dt):
    P = program(name)
    block = expand(P, hw, dt)
    c = cost(P, hw, dt)
    # transfers: Σ listed loads/stores × loop trips == cost transfers, symbolically, per level
    for bytes_ in (False, True):
        got = listed_transfers(block, bytes=bytes_)
        want = c.transfers_bytes if bytes_ else c.transfers
        for lv in c.levels[1:]:
            assert sympy.expand(got[lv] - want[lv]) == 0, (lv, got[lv], want[lv])
    # peak declared memory per level == cost memory, evaluated (values and bytes)
    ev = c.evaluate(SIZES)
    assert listed_memory(block, SIZES) == pytest.approx(ev["memory"])
    assert listed_memory(block, SIZES, bytes=True) == pytest.approx(ev["memory_bytes"])


def _parse(text):
    """Σ (values of each listed load/store) × (iterations of its enclosing loops), read back
    from the printed text alone."""
    total, stack = 0.0, []   # stack of (indent, iterations)
    for line in text.splitlines():
        if not line.strip() or line.startswith("# totals"):
            if line.startswith("# totals"):
                break
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        body = line.strip()
        m = re.search(r"# .*: ([\d,]+) (groups|steps)$", line)
        if body.startswith("for ") and m:
            stack.append((indent, int(m.group(1).replace(",", ""))))
        elif body.startswith("kernel "):
            stack.append((indent, 1))
        elif body.startswith(("load ", "store ")):
            n = int(re.search(r"# ([\d,]+) values", line).group(1).replace(",", ""))
            mult = 1
            for _, it in stack:
                mult *= it
            total += n * mult
    return total


@pytest.mark.parametrize("name", ["attention", "gqa", "matmul", "cross_entropy",
                                  "unpartitioned attention"])
def test_printed_text_adds_up_to_the_cost_model(name):
    P = program(name)
    text = pseudocode(P, H100_2, SIZES, None, "bf16", title=name)
    assert "napkin.cost folds this same schedule" in text
    want = cost(P, H100_2, "bf16").evaluate(SIZES)["transfers"]["smem"]
    assert _parse(text) == pytest.approx(want)


def test_attention_listing_reads_like_the_paper():
    text = pseudocode(program("attention"), "h100", {"q": 4096, "x": 4096, "d": 128},
                      {"g_q": 128, "s_x": 64}, "bf16")
    for snippet in (
            "for q0 in range(0, q, g_q):", "grid, parallel over 132 SMs: 32 groups",
            "Q_blk: bf16[g_q, d] @smem", "load Q[q0:q0+g_q, :] -> Q_blk",
            "mu: bf16[g_q] @smem = full(-inf)", "o: bf16[g_q, d] @smem = full(0)",
            "for x0 in range(0, x, s_x):", "stream x [softmax_contraction], sequential: 64 steps",
            "load K[x0:x0+s_x, :] -> K_blk", "K_blk: bf16[s_x, d] @smem",
            "S: bf16[g_q, s_x] @smem = scale(einsum('qd,xd->qx', Q_blk, K_blk), 1/sqrt(d))",
            "mu' = max(mu, max_x(S))", "shift: bf16[g_q] @smem = finite_or_zero(mu')",
            "delta: bf16[g_q] @smem = exp(mu - shift)", "p: bf16[g_q, s_x] @smem = exp(S - shift)",
            "z' = z * delta + sum_x(p)",
            "mu, z, o = mu', z', o'", "O_blk: bf16[g_q, d] @smem = bf16(o * guard(recip(z), mu))",
            "store O_blk -> O[q0:q0+g_q, :]", "QK^T", "16,384 values (32 KiB)"):
        assert snippet in text, snippet
    # the value product folds into the state (p may first be cast to V's dtype)
    assert re.search(r"o' = o \* delta \+ einsum\('qx,xd->qd', p\w*, V_blk\)", text)
    # the group's peak SMEM (113 KiB: 112.75 and the shift's 256 B) is printed and matches
    # napkin.cost
    assert "= 113 KiB" in text
    # the totals are napkin.cost's, level by level
    c = cost(program("attention"), "h100", "bf16").evaluate({"q": 4096, "x": 4096, "d": 128,
                                                            "g_q": 128, "s_x": 64})
    assert f"smem       transfers {int(c['transfers']['smem']):,} values" in text


def test_nested_levels_slice_staged_copies():
    text = pseudocode(program("two-level attention"), H100, SIZES, None, FP8)
    assert "Q_l2: fp8[g_q, d] @l2" in text
    assert "load Q_l2[q1:q1+w_q, :] -> Q_blk" in text       # from the staged copy
    assert "load K_l2[x0:x0+s_x, :] -> K_blk" in text
    assert "store O_blk -> O[q0+q1:q0+q1+w_q, :]" in text    # straight to GMEM


def test_markdown_and_symbolic():
    md = pseudocode(program("matmul"), H100_2, fmt="markdown", title="matmul")
    assert md.startswith("### matmul") and "```python" in md
    assert "| smem |" in md and "napkin.cost folds this same schedule" in md
    assert "acc_C' = acc_C + einsum('ab,bc->ac', A_blk, B_blk)" in md
    assert "a*b*c/g_c + a*b*c/g_a + a*c" in md.replace(" ", "") or "a*b*c/g_a" in md
    with pytest.raises(NapkinError, match="format"):
        pseudocode(program("matmul"), H100_2, fmt="html")


def test_accepts_search_tiles():
    from napkin.search import search
    r = search(get("matmul").diagram("bf16"), "h100", {"a": 1024, "b": 1024, "c": 1024},
               "bf16", max_seconds=20)
    text = pseudocode(r.best.program, "h100", {"a": 1024, "b": 1024, "c": 1024}, r.best.tiles)
    for k, v in r.best.tiles.values.items():
        assert f"{k}={v}" in text.splitlines()[0]


def test_a_stream_states_what_of_its_step_may_run_during_the_next():
    """The schedule states a stream's overlap, read off its step's dataflow: attention's
    o = E(o) + p·V (p computed without reading o, V a chunk) lets p·V run a step late; the
    searched matmul's product reads two loaded chunks (nothing in its step to run beside),
    and a step whose state another output reads (logsumexp's μ, read by z's update) states
    none.  The pseudocode prints the statement under the stream's loop."""
    import napkin
    from napkin.schedule.nest import Loop

    def streams(name):
        r = napkin.optimize(name, hardware="h100", dtype="bf16")
        s = expand(r.program, r.hardware, r.dtype)
        found = [it for it, _ in s.root.walk() if isinstance(it, Loop) and it.kind == "stream"]
        assert found, name
        return r, found
    r, (attention,) = streams("attention")
    assert attention.overlap.startswith("p·V may run a step late") and "read o" in \
        attention.overlap
    text = pseudocode(r.program, r.hardware, r.sizes, r.tiles, r.dtype)
    assert f"# overlap: {attention.overlap}" in text
    _, matmul = streams("matmul")
    assert all(lp.overlap == "" for lp in matmul)
    _, lse = streams("logsumexp")
    assert all(lp.overlap == "" for lp in lse)
