"""The cost functor's conventions, one at a time (see the napkin.cost docstring)."""
import json
import math

import pytest
import sympy

from napkin.cost import (
    Cost, CostError, M_SYM, candidates, canonical_form, cost, optimize_tiles, optimum_curve,
    cost_json, plot_cost,
)
from napkin.core.flops import flops
from napkin.hardware import get_hardware
from napkin.core.ir import ops, to_graph
from napkin.frontend.library import get
from napkin.core.region import Site, body_at
from rewrites import RULES

S = lambda n: sympy.Symbol(n, integer=True, positive=True)  # noqa: E731
a, b, c, q, x, d, n, v = (S(s) for s in "a b c q x d n v".split())
g_a, g_c, s_b, g_q, s_x, g_n, s_v = (S(s) for s in "g_a g_c s_b g_q s_x g_n s_v".split())

MATMUL = (("group_partition", (), {"axis": "a"}), ("group_partition", (0,), {"axis": "c"}),
          ("stream_partition", (0, 0), {"axis": "b"}))
ATTENTION = (("group_partition", (), {"axis": "q"}), ("stream_partition", (0,), {"axis": "x"}))
H100_2 = get_hardware("h100").two_level()
_PROGRAMS = {}


def program(name, steps=()):
    key = (name, repr(steps))
    if key not in _PROGRAMS:
        D = get(name).diagram()
        for rule, path, params in steps:
            n_ops = len(ops(to_graph(body_at(D, path))))
            D = RULES[rule].apply(D, Site(path, tuple(range(n_ops))), dict(params))
        _PROGRAMS[key] = D
    return _PROGRAMS[key]


def same(e1, e2):
    diff = sympy.sympify(e1) - sympy.sympify(e2)
    return sympy.expand(diff) == 0 or sympy.simplify(diff) == 0


# ----------------------------------------------------------------------------- conventions
def test_unpartitioned_boxes_are_kernels_of_their_own():
    # top level: each box reads its inputs and writes its outputs once
    mm = cost(program("matmul"), H100_2)
    assert same(mm.transfers["smem"], a * b + b * c + a * c)
    assert same(mm.memory["smem"], a * b + b * c + a * c)      # the whole operands on chip
    assert same(mm.memory["gmem"], a * b + b * c + a * c)
    att = cost(program("attention"), H100_2)
    # Q,K read; S written, read, written (scale), read; P written, read; V read; O written
    assert same(att.transfers["smem"], 2 * q * d + 2 * x * d + 6 * q * x)
    assert att.tiles == {}
    cf = canonical_form(att)
    assert cf.terms == ((att.transfers["smem"], 0),)


def test_top_level_stream_keeps_state_on_chip():
    P = program("logsumexp", (("stream_partition", (), {"axis": "v"}),))
    cst = cost(P, H100_2)
    assert same(cst.transfers["smem"], n * v + n)               # L read once, l written once
    # state (mu, z) + the current chunk, which the exp tile is written over where it dies
    # (the x - mu tile is fused), + the chunk's row max
    assert same(cst.memory["smem"], 3 * n + n * s_v)
    assert same(cost(P, H100_2, intermediates=False).memory["smem"], 2 * n + n * s_v)


def test_all_groups_counted_and_broadcast_inputs_resent():
    P = program("linear_cross_entropy", (("group_partition", (), {"axis": "n"}),
                                         ("stream_partition", (0,), {"axis": "v"})))
    cst = cost(P, H100_2)
    ld = cst.loads["smem"]
    assert same(ld["X"], n * d)                     # grouped input: once in all
    assert same(ld["W"], d * v * n / g_n)           # lacks n: re-sent to each of n/g_n groups
    assert same(ld["Y"], n * v)                     # streamed: each chunk once per group
    assert same(cst.stores["smem"]["loss"], n)      # output written once


def test_flops_agree_with_the_flops_functor():
    for name, steps in (("matmul", MATMUL), ("attention", ATTENTION), ("attention", ()),
                        ("rmsnorm_matmul", ())):
        P = program(name, steps)
        assert same(cost(P, H100_2).flops, flops(P)), name
    by = cost(program("attention", ATTENTION), H100_2).flops_by_unit
    assert same(by["tensor:f32"], 4 * q * x * d)   # QK^T and PV on tensor cores
    assert same(by["sfu"], q * x + q * x / s_x)     # exp of scores and of the rescale


def test_dtypes_price_bytes():
    P = program("attention", ATTENTION)
    f32 = cost(P, H100_2)
    assert same(f32.transfers_bytes["smem"], 4 * f32.transfers["smem"])
    mixed = cost(P, H100_2, {"Q": "fp8", "K": "fp8", "V": "f16"})
    assert same(mixed.loads_bytes["smem"]["Q"], q * d)
    assert same(mixed.loads_bytes["smem"]["V"], 2 * x * q * d / g_q)
    assert same(mixed.stores_bytes["smem"]["O"], 4 * q * d)      # O keeps the program's f32
    with pytest.raises(Exception, match="dtype"):
        cost(P, H100_2, "f12")


def test_state_is_f32_by_default_and_q_with_a_dtype():
    P = program("attention", ATTENTION)
    own = cost(P, H100_2, intermediates=False)
    assert same(own.memory_bytes["smem"], 4 * own.memory["smem"])
    f16 = cost(P, H100_2, "f16", intermediates=False)
    assert same(f16.memory_bytes["smem"], 2 * f16.memory["smem"])


def test_levels_pass_through_and_map():
    P = program("attention", ATTENTION)
    full = cost(P, "h100")
    assert full.levels == ("gmem", "l2", "smem", "registers")
    assert same(full.transfers["l2"], full.transfers["smem"])   # L2 passes SMEM's traffic on
    assert full.transfers["registers"] == 0 and full.memory["l2"] == 0
    assert full.main_level == "smem"
    reg = RULES["relabel_level"].apply(P, Site((), (0,)), {"level": "registers"})
    rc = cost(reg, "h100")
    assert same(rc.transfers["registers"], rc.transfers["l2"]) and rc.memory["smem"] == 0
    l2only = cost(P, get_hardware("h100").two_level("l2"))   # no smem level: lands at l2
    assert same(l2only.transfers["l2"], full.transfers["smem"])


def test_divisibility_multiples():
    mm = cost(program("matmul", MATMUL), "h100", "f16")
    m = {t.name: dict(i.multiples) for t, i in mm.tiles.items()}
    # dot_min: no side of a dot under 16 (Triton's least tl.dot), on every side
    assert m["g_a"] == {"mma_m": 64, "dot_min": 16}
    assert m["g_c"] == {"coalesce 128B": 64, "mma_n": 8, "dot_min": 16}  # 128 B / 2 B; LCM 64
    assert m["s_b"] == {"coalesce 128B": 64, "mma_k": 16, "dot_min": 16}
    assert mm.tiles[s_b].multiple == 64
    at = cost(program("attention", ATTENTION), "h100", "fp8")
    assert at.tiles[s_x].multiple == 32 and at.tiles[g_q].multiple == 64   # mma_k = 32 B / 1 B
    # f32 operands: mma_k is 32 B / 4 B = 8, and mma_n 8, but no dot side under 16
    f32 = cost(program("attention", ATTENTION), "h100", "f32")
    assert f32.tiles[s_x].multiple == 16


def test_time_roofline():
    cst = cost(program("matmul", MATMUL), "h100", "f16")
    ts = cst.time_s
    assert isinstance(ts["total"], sympy.Max)
    pt = {"a": 8192, "b": 8192, "c": 8192, "g_a": 128, "g_c": 256, "s_b": 64}
    ev = cst.evaluate(pt)
    t = ev["time_s"]
    assert t["total"] == max(t["l2"], t["smem"], t["registers"], t["compute"])
    assert t["serial"] >= t["total"]
    assert math.isclose(t["compute"], 2 * 8192 ** 3 / 989e12, rel_tol=0.01)
    # f16 intensity = g/2 FLOP/B for g x g tiles (no L2 reuse modelled): below the ridge
    # (295 FLOP/B) the HBM hop bounds; SMEM-sized tiles (<= 256) are HBM-bound
    assert ev["bound_by"] == "l2"
    big = cst.evaluate({**pt, "g_a": 1024, "g_c": 1024})
    assert big["bound_by"] == "compute:tensor"


# ----------------------------------------------------------------------------- optimizer
def test_candidates():
    assert candidates(1024, 64) == [64, 128, 256, 512, 1024]
    assert candidates(96, 32) == [32, 64, 96]
    assert candidates(48, 64) == [48]                           # axis shorter than the multiple
    assert candidates(256, 64, power_of_two=False) == [64, 128, 192, 256]


def test_optimizer_respects_capacity_and_reports():
    cst = cost(program("matmul", MATMUL), "h100", "f16")
    sizes = {"a": 4096, "b": 4096, "c": 4096}
    t = optimize_tiles(cst, sizes=sizes)
    assert t.feasible and t.memory_bytes["smem"] <= 228 * 1024
    assert all(t.values[k] % t.multiples[k] == 0 for k in t.values)
    # the largest output tile whose f32 accumulator a block's registers hold (256 x 256
    # would need 256 registers of data per thread at 8 warps: it spills)
    assert {t.values["g_a"], t.values["g_c"]} == {128, 256}
    (k,) = t.launch
    assert k["num_warps"] == 8 and k["registers_per_thread"] <= 128 and k["spilled_bytes"] == 0
    assert k["smem_bytes"] <= 227 * 1024 and k["num_stages"] == 2
    # HBM-bound, spread over 512 blocks in 4 waves of 132 SMs, plus one launch
    assert k["blocks"] == 512 and k["waves"] == 4
    useful = 512 / (4 * 132)
    assert t.bound_by == "l2" and math.isclose(
        t.time_s, 3e-6 + t.transfers_bytes / 3.35e12 / useful, rel_tol=1e-9)
    tiny = optimize_tiles(cst, sizes=sizes, capacity={"smem": 1024})
    assert not tiny.feasible
    fixed = optimize_tiles(cst, sizes={**sizes, "s_b": 128})
    assert fixed.values["s_b"] == 128
    js = json.loads(json.dumps(t.to_json(sizes)))
    assert js["values"] == t.values and js["alpha_beta"][1]["beta"] == "1/2"
    with pytest.raises(CostError, match="no value for c"):
        optimize_tiles(cst, sizes={"a": 4096})


def test_nested_tiles_fit_their_outer_tile():
    P = program("attention", (("group_partition", (), {"axis": "q", "level": "l2"}),
                              ("group_partition", (0,), {"axis": "q", "size": "w_q"}),
                              ("stream_partition", (0, 0), {"axis": "x"})))
    cst = cost(P, "h100", "f16")
    assert str(cst.tiles[S("w_q")].full) == "g_q"
    t = optimize_tiles(cst, sizes={"q": 8192, "x": 8192, "d": 128})
    assert t.feasible and t.values["w_q"] <= t.values["g_q"]


def test_optimum_curve_decreases_with_memory():
    cst = cost(program("attention", ATTENTION), H100_2, "f16")
    pts = optimum_curve(cst, {"q": 4096, "x": 4096, "d": 128}, [2 ** 15, 2 ** 16, 2 ** 17, 2 ** 19])
    hs = [h for _, h, _ in pts]
    # 32 KiB holds no tiling: the tensor cores' smallest query tile (mma_m = 64 rows) is too big
    assert math.isnan(hs[0]) and pts[0][2]["g_q"] == 64
    assert hs[1] > hs[2] > hs[3]


def test_canonical_form_values_and_bytes():
    cst = cost(program("matmul", MATMUL), H100_2, "f16")
    cv, cb = canonical_form(cst), canonical_form(cst, unit="bytes")
    # bytes: 2 B per value moved and M_bytes = 2 M_values -> alpha x 2^(3/2)
    assert same(cb.terms[1][0] / cv.terms[1][0], 2 * sympy.sqrt(2))
    assert same(cv.H, a * c + 2 * a * b * c / sympy.sqrt(M_SYM))
    with pytest.raises(CostError):
        canonical_form(cst, unit="furlongs")


# ----------------------------------------------------------------------------- reports
def test_to_json():
    cst = cost(program("attention", ATTENTION), "h100", "f16")
    sizes = {"q": 4096, "x": 4096, "d": 128}
    js = cost_json(cst, sizes)
    js = json.loads(json.dumps(js))                              # JSON-able
    for key in ("transfers", "memory", "flops", "time_s", "tiles", "alpha_beta",
                "lower_bound_ratio"):
        assert key in js, key
    assert js["tiles_source"] == "optimized"
    assert js["tiles"]["g_q"]["value"] % 64 == 0
    assert js["transfers"]["l2"]["expr"] == "2*d*q + 2*d*q*x/g_q"
    assert js["memory"]["smem"]["fits"] is True
    assert js["alpha_beta"][1]["beta"] == "1" and js["alpha_beta"][1]["alpha"] > 0
    assert js["lower_bound_ratio"] >= 1
    given = cost_json(cst, {**sizes, "g_q": 128, "s_x": 64})
    assert given["tiles_source"] == "given" and given["tiles"]["g_q"]["value"] == 128


def test_plot_cost(tmp_path):
    path = plot_cost(program("matmul", MATMUL), "h100", {"a": 2048, "b": 2048, "c": 2048},
                     tmp_path / "cost.png", "f16")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cost_is_a_cost():
    cst = cost(program("matmul", MATMUL), "a100")
    assert isinstance(cst, Cost) and cst.hardware.name.startswith("A100")


def test_a_dot_over_merged_rows_asks_their_product():
    """GQA's scores S[k, r, q, x] = Q·Kᵀ take (r, q) as one dot's rows: the wgmma's 64 rows
    are asked of r × g_q, so at r = 4 the query tile may be 16 (the kernel writer merges
    the axes into one dot); a size the sizes do not fix leaves the tile the whole 64."""
    gq = cost(program("gqa", ATTENTION), "h100", "bf16")
    info = gq.tiles[g_q]
    assert "mma_m" not in dict(info.multiples)
    assert ("mma_m", 64, S("r")) in info.shared
    assert info.least({"r": 4}) == 16 and info.least({"r": 2}) == 32
    assert info.least({"r": 1}) == 64 and info.least({}) == 64
    # and the least dot dimension, 16, of the same merged rows (MQA's h·q: 32 heads, 2 queries)
    assert sorted(info.to_json()["shared"]) == [["dot_min", 16, "r"], ["mma_m", 64, "r"]]
    assert "dot_min" not in dict(info.multiples)


def test_a_row_statistic_does_not_bind_the_tile():
    """L[k, r, q] moves beside Q[k, r, q, d] (a d-th of its bytes): its short runs along q
    ask no coalescing of the query tile, where a [q, d]-shaped tile's rows still do."""
    from napkin.frontend.grad import residuals
    D = residuals(get("gqa").diagram())
    for rule, path, params in ATTENTION:
        D = RULES[rule].apply(D, Site(path, tuple(range(len(ops(to_graph(body_at(D, path))))))),
                              dict(params))
    info = cost(D, "h100", "bf16").tiles[g_q]
    assert not any(r.startswith("coalesce") for r, _ in info.multiples)
    # a 2-D output whose last axis is the tile's still asks for 128-byte runs
    mm = cost(program("matmul", MATMUL), "h100", "bf16")
    assert dict(mm.tiles[g_c].multiples)["coalesce 128B"] == 64


def test_the_plots_tile_panel_is_about_the_chosen_tiles(tmp_path, monkeypatch):
    # the right panel once drew the s_x curve at the transfer optimum (g_q = 256) while the
    # table chose g_q = 64, called every point of it "exceeds capacity", and marked no choice
    import matplotlib.figure
    from napkin.cost.grid import Grid
    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figs.append(self))
    sizes = {"q": 4096, "x": 4096, "d": 128}
    prog = program("attention", ATTENTION)
    plot_cost(prog, "h100", sizes, tmp_path / "cost.png", "bf16")
    grid = Grid(cost(prog, "h100", "bf16"), sizes)
    chosen = grid.values(grid.best("time")[0])
    right = figs[0].axes[1]
    assert f"chosen g_q={chosen['g_q']}, s_x={chosen['s_x']}" in right.get_title()
    stars = [ln for ln in right.get_lines() if ln.get_marker() == "*" and len(ln.get_xdata())]
    assert sorted(float(ln.get_xdata()[0]) for ln in stars) == sorted(
        float(chosen[t]) for t in ("g_q", "s_x"))
    filled = [ln for ln in right.get_lines() if ln.get_marker() == "o" and ln.get_mfc() != "none"]
    assert any(len(ln.get_xdata()) for ln in filled)  # the chosen tiles launch: not all hollow


def test_a_grid_prices_each_point_as_value_at_does():
    """Grid works expressions out on each tile's own dimension and broadcasts: at random
    points, its traffic and memory agree with the expression evaluated at that point."""
    import numpy as np
    from napkin.cost.grid import Grid
    from napkin.cost.model import value_at
    c = cost(program("attention", ATTENTION), H100_2, "bf16")
    sizes = {"q": 1000, "x": 3000, "d": 64}
    g = Grid(c, sizes)
    level = c.levels[1]
    for i in np.random.default_rng(0).integers(0, g.n, 12):
        at = {**sizes, **g.values(int(i))}
        assert g.Hb[i] == pytest.approx(value_at(c.transfers_bytes[c.main_level], at))
        assert g.mem[level][i] == pytest.approx(max(
            value_at(e, at) for e in c.memory_bytes_candidates[level]))


def test_combined_folds_parts_into_the_ones_that_cover_them():
    import numpy as np
    from napkin.cost.model import combined
    rng = np.random.default_rng(1)
    parts = [rng.random((3, 1, 1)), rng.random((3, 4, 1)), rng.random((1, 1, 5)),
             rng.random((1, 4, 1)), rng.random((3, 4, 5))]
    want = sum(np.broadcast_to(p, (3, 4, 5)) for p in parts)
    assert np.allclose(combined(parts, (3, 4, 5)), want)
    masks = [p > 0.3 for p in parts]
    assert (combined(masks, (3, 4, 5), np.logical_and, True)
            == np.logical_and.reduce([np.broadcast_to(m, (3, 4, 5)) for m in masks])).all()
    assert combined([], (2, 2)).shape == (2, 2)


def test_a_grid_beyond_its_points_is_thinned_and_still_priced_exactly(monkeypatch):
    """A grid larger than POINTS keeps every other candidate of its largest tiles (their
    least and largest kept); the tiling it chooses is one of those, priced as before."""
    from napkin.cost import grid
    c = cost(program("attention", ATTENTION), H100_2, "bf16")
    sizes = {"q": 4096, "x": 4096, "d": 64}
    whole = grid.Grid(c, sizes)
    monkeypatch.setattr(grid, "POINTS", whole.n // 3)
    thin = grid.Grid(c, sizes)
    assert thin.thinned and thin.n <= whole.n // 3
    for name, kept in thin.cands.items():
        assert set(kept) <= set(whole.cands[name])
        assert kept[0] == whole.cands[name][0] and kept[-1] == whole.cands[name][-1]
    best, ok = thin.best()
    values = thin.values(best)
    same = next(i for i in range(whole.n) if whole.values(i) == values)
    assert ok and thin.time[best] == pytest.approx(whole.time[same])
    assert thin.time[best] >= whole.time[whole.best()[0]] * (1 - 1e-12)
