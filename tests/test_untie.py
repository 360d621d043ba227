"""Each kernel's tiles its own (issue 32): a program's kernels share a tile name by
convention (one per axis), which forced every kernel of a transformer block onto one query
tile.  The search prices every program with the names untied (napkin.core.retile), chooses
each kernel's tiles on its own grid (napkin.cost.separable: a sum of small grids, not their
product), and ends its chain with the move that names them so (rewrites.untie), which the
checker replays like any other."""
import copy

import jax
import numpy as np
import pytest

import napkin as nk
from napkin.core.errors import RuleError
from napkin.core.region import Site
from napkin.core.retile import untied
from napkin.core.streamed import names
from napkin.cost import cost
from napkin.cost.grid import Grid
from napkin.cost.separable import Parts, grid_for
from napkin.frontend.library import LIBRARY
from proofs.untie import _tied
from rewrites import RULES

MLP = dict(n=2048, d=1024, e=4096, f=1024)


def test_the_later_kernel_gets_fresh_names_and_the_function_is_unchanged():
    from proofs._core import numeric, sample
    D, T = _tied()
    U, renames = untied(T)
    assert renames == {1: {"g_n": "g_n_2"}} and sorted(names(U).tiles) == ["g_n", "g_n_2", "s_e"]
    assert untied(U) == (U, {})  # nothing left to untie: the rule refuses it
    with pytest.raises(RuleError, match="no two top-level boxes share"):
        RULES["untie_tiles"].check(U, Site((), ()), {})
    with pytest.raises(RuleError, match="takes no parameters"):
        RULES["untie_tiles"].check(T, Site((), ()), {"tile": "g_n"})
    sizes = {"n": 11, "d": 5, "e": 9, "f": 3}  # ragged: no tile divides its axis
    xs = sample(D, sizes, np.random.default_rng(5))
    for g1, g2, s in [(4, 3, 2), (2, 11, 4)]:
        numeric(D, U, xs, sizes_rhs={"g_n": g1, "g_n_2": g2, "s_e": s}, tol=1e-12)


def test_the_parts_best_is_the_best_of_every_tiling():
    """The separable grid finds the optimum the product grid finds (the time is a sum over
    the kernels), evaluating the sum of the parts' points, not their product."""
    _, T = _tied()
    c = cost(untied(T)[0], "h100", "bf16")
    sizes = dict(n=4096, d=64, e=256, f=128)  # (the first kernel holds a whole row of e)
    parts = grid_for(c, sizes)
    whole = Grid(c, sizes)
    assert isinstance(parts, Parts) and len(parts.grids) == 2
    assert parts.n < whole.n
    p, ok = parts.best()
    i, ok_whole = whole.best()
    assert ok and ok_whole
    assert parts.summary(p)["time_s"] == pytest.approx(float(whole.time[i]), rel=1e-3)
    # the same tiles priced on the product grid cost what the parts say
    at = whole.values(i)
    same = np.ravel_multi_index([whole.cands[t.name].index(parts.values(p)[t.name])
                                 for t in whole.free], whole.shape)
    assert float(whole.time[same]) == pytest.approx(parts.summary(p)["time_s"], rel=1e-9)
    assert set(at) == set(parts.values(p))
    # the traffic, peaks and bound, summed over the parts, are the whole cost's at the point
    got, want = parts.summary(p), c.evaluate({**sizes, **parts.values(p)})
    assert got["transfers_bytes"] == pytest.approx(want["transfers_bytes"][c.main_level])
    assert got["transfers"] == pytest.approx(want["transfers"][c.main_level])
    assert got["memory_bytes"] == pytest.approx({lv: want["memory_bytes"][lv]
                                                 for lv in c.levels[1:]})
    assert got["bound_by"] == want["bound_by"]
    # a capacity bound or the transfers objective reads the whole grid
    assert isinstance(grid_for(c, sizes, "transfers"), Grid)


def test_a_search_reports_each_kernels_tiles_and_the_checker_replays_the_move():
    opt = nk.optimize("mlp", "h100", MLP, dtype="bf16", max_states=200)
    assert opt.chain[-1].rule == "untie_tiles"
    kernels = len(opt.search.best.tiles.launch)
    assert kernels >= 2
    assert {"g_n", "g_n_2"} <= set(opt.tiles)  # each kernel's row tile its own
    report = opt.check()
    assert report.ok, report
    # tampered: the move given a parameter, or dropped (the kernels' own tiles unbound)
    from napkin.certify.checker import check_certificate
    cert = opt.certificate.to_dict()
    last = len(cert["steps"])
    bad = copy.deepcopy(cert)
    bad["steps"][-1]["params"] = {"tile": "g_n"}
    report = check_certificate(bad, numeric=False)
    assert not report.ok and report.step == last and "takes no parameters" in report.reason
    bad = copy.deepcopy(cert)
    bad["steps"].pop()
    assert "final result fingerprint mismatch" in str(check_certificate(bad, numeric=False))
    small = opt.fit({"n": 13, "d": 6, "e": 10, "f": 7})
    rng = np.random.default_rng(3)
    X, W1, W2 = (rng.standard_normal(s).astype(np.float32) for s in [(13, 6), (6, 10), (10, 7)])
    got = np.asarray(small.kernel("triton", interpret=True, dtype="f32")(X, W1, W2))
    with jax.enable_x64(True):
        want = LIBRARY["mlp"].reference(*(a.astype(np.float64) for a in (X, W1, W2)))
    assert np.max(np.abs(got - np.asarray(want))) <= 1e-5 * np.max(np.abs(want))
