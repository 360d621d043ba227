"""Backward programs the search used to miss: a diagram mapped over axes (MHA's heads) is
also searched at one index and its kernels grouped over them (napkin.search.mapped); a
product's least dot size is asked of its merged side (MQA's rows h·q); a kernel that leaves
half the SMs idle is offered split-K (attention's dK, dV at 64 key tiles)."""
import numpy as np
import pytest

import napkin as nk
from napkin.frontend.grad import grad
from napkin.frontend.library import LIBRARY, get
from napkin.search.mapped import map_axes
from shared_checks import dv_stream, grads_match_float64


@pytest.mark.parametrize("name, axes", [("mha", ["h"]), ("gqa", ["k"]), ("mqa", []),
                                        ("attention", []), ("matmul", []),
                                        ("alibi_attention", ["h"]), ("sink_attention", ["h"]),
                                        ("softmax", ["n"]), ("cross_entropy", ["n"])])
def test_the_map_axes_are_those_every_input_carries_and_no_box_mixes(name, axes):
    """MHA is attention once per head, GQA once per KV head; MQA's K and V have no head
    axis, a matmul's operands share only the axis it reduces.  ALiBi's positions q − x lack
    the heads (a constant per head, replayed); a softmax reads along v, so only its rows n
    map."""
    alg = get(name).diagram()
    assert map_axes(alg) == axes
    wrt = [ob.name for ob in alg.dom.inside if ob.name in ("K", "B")] or [alg.dom.inside[0].name]
    assert map_axes(grad(alg, wrt=wrt, residuals=True)) == axes


def _kernels(o) -> int:
    return len(o.search.best.tiles.launch)


def test_mhas_backward_is_attentions_per_head():
    """MHA's dK, dV: searched whole, the best-first met only a four-kernel program that
    re-read P through HBM (3.66 ms modelled at 32 heads, 5.35× the forward; 3,000 states did
    not find better); searched per head, it is attention's — D, then a stream over the
    queries per key tile — with a block per head and key tile."""
    opt = nk.optimize("mha", sizes=dict(h=32, q=4096, x=4096, d=128), dtype="bf16")
    (_, dq), (_, dkv) = opt.backward.pieces
    assert _kernels(dkv) == 2
    rules = [(m.rule, dict(m.params).get("axis")) for m in dkv.chain]
    assert ("stream_partition", "q") in rules and ("group_partition", "h") in rules
    assert dkv.search.best.time_s < 2.5 * opt.search.best.time_s


def test_alibis_backward_is_searched_per_head_and_stays_right():
    """ALiBi's bias −slope[h]·(q − x) reads positions that carry no head, so the map axes
    were none and its dK, dV searched whole: 21 kernels, 15.7× the forward.  Per head (the
    positions replayed in each head's block) it is attention's — 2 kernels.  Fitted to
    ragged sizes, its kernels equal the backward diagram in float64."""
    import jax.numpy as jnp
    from napkin.frontend.grad import residuals
    alg = get("alibi_attention").diagram()
    sizes = dict(h=32, q=4096, x=4096, d=128)
    fwd = nk.optimize("alibi_attention", sizes=sizes, dtype="bf16")
    dkv = nk.optimize(grad(alg, wrt=["K", "V"], residuals=True), sizes=sizes, dtype="bf16")
    assert _kernels(dkv) <= 2
    assert dkv.search.best.time_s < 2.5 * fwd.search.best.time_s
    small = {"h": 3, "q": 37, "x": 53, "d": 16}
    rng = np.random.default_rng(13)
    xs = LIBRARY["alibi_attention"].sample(rng, small)
    saved = nk.evaluate(residuals(alg), small)(*xs)  # O and L, as the forward saves them
    args = [*xs, *saved, rng.standard_normal((3, 37, 16))]
    got = dkv.fit(small).kernel("triton", interpret=True, dtype="f32")(
        *[jnp.asarray(a, jnp.float32) for a in args])
    want = nk.evaluate(dkv.algorithm, small)(*args)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(g, np.float64) - w).max() <= 1e-5 * np.abs(w).max()


def test_alibis_dslopes_sums_rows_of_streamed_keys_and_stays_right():
    """dslopes_h = Σ_{q,x} dS·(q − x) sums two axes, and no rule streams two axes of one
    sum in one loop nest: the search wrote dS·(q − x) over [h, q, x] to HBM (1 GB at the
    default sizes), summed it in two more kernels, and its first kernel spilled (2.9 ms
    modelled, 4.25× the forward).  Split (rewrites.split_sum: Σ_q of Σ_x), the keys stream
    per query tile as in dQ and the rows are summed after (0.39 ms).  Fitted to ragged
    sizes, its kernels equal the backward diagram in float64."""
    import jax.numpy as jnp
    from napkin.frontend.grad import residuals
    alg = get("alibi_attention").diagram()
    sizes = dict(h=32, q=4096, x=4096, d=128)
    fwd = nk.optimize("alibi_attention", sizes=sizes, dtype="bf16")
    ds = nk.optimize(grad(alg, wrt="slopes", residuals=True), sizes=sizes, dtype="bf16")
    assert ("split_sum", "q") in [(m.rule, dict(m.params).get("axis")) for m in ds.chain]
    assert ds.search.best.time_s < 0.75 * fwd.search.best.time_s
    assert all(launch["spilled_bytes"] == 0 for launch in ds.search.best.tiles.launch)
    small = {"h": 3, "q": 37, "x": 53, "d": 16}
    rng = np.random.default_rng(17)
    xs = LIBRARY["alibi_attention"].sample(rng, small)
    saved = nk.evaluate(residuals(alg), small)(*xs)
    args = [*xs, *saved, rng.standard_normal((3, 37, 16))]
    got = ds.fit(small).kernel("triton", interpret=True, dtype="f32")(
        *[jnp.asarray(a, jnp.float32) for a in args])
    want = nk.evaluate(ds.algorithm, small)(*args)
    got, want = np.asarray(got, np.float64), np.asarray(want[0] if isinstance(want, tuple)
                                                        else want)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_dots_least_side_is_asked_of_its_merged_axes():
    """MQA's products read Q[h, q, d] as h·q rows: with 32 heads a query chunk of 4 is a
    128-row dot.  The least dot size (16) was asked of the chunk alone, so the least chunk
    held 512 rows, no fused dK, dV fitted, and the search answered 14 kernels (37× the
    forward); now 2 or 3 (the queries split in parts)."""
    from napkin.cost import cost
    from napkin.cost.grid import Grid
    from napkin.hardware import get_hardware
    D = dv_stream("h", "mqa dv")
    c = cost(D, get_hardware("h100").two_level(), "bf16")
    chunks = Grid(c, dict(h=32, q=4096, x=4096, d=128)).cands["s_q"]
    assert min(chunks) == 2  # 64 rows: a warp group's
    opt = nk.optimize("mqa", sizes=dict(h=32, q=2048, x=2048, d=128), dtype="bf16")
    assert _kernels(opt.backward.pieces[-1][1]) <= 3


def test_a_split_dk_dv_is_chosen_where_half_the_sms_idle_and_stays_right():
    """Attention's dK, dV at 4096 keys run 64 key tiles on 132 SMs: split over the queries
    (two parts, their partial dK, dV merged) the model's time falls by a third.  Fitted to
    ragged sizes, jax.grad through the kernels equals float64."""
    opt = nk.optimize("attention", sizes=dict(q=4096, x=4096, d=128), dtype="bf16")
    dkv = opt.backward.pieces[-1][1]
    assert "split_stream" in [m.rule for m in dkv.chain]
    grads_match_float64(opt.fit({"q": 37, "x": 53, "d": 16}), LIBRARY["attention"], 11, 1e-5)
