"""Lowering streamed programs to Pallas (Triton backend) kernels.

Every library algorithm with a streamed derivation is lowered and run in
interpret mode against its plain-jnp reference (float32 and bfloat16, sizes the
tiles divide and ragged ones), and every kernel written here is also lowered
for CUDA on this CPU (an abstract H100), which catches Triton-only errors.
"""
import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy

from napkin import ops
from napkin.core.arrays import axes
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, to_graph
from napkin.frontend.library import get
from napkin.lower import export_cuda, hbm_bytes, lower
from napkin.lower.traffic import traffic
from napkin.core.region import Site, body_at
from napkin.frontend.trace import Array, trace
from rewrites import RULES

pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


def derive(name, steps, program=None):
    p = program if program is not None else get(name).diagram()
    for rule, path, params in steps:
        params = dict(params)
        ops = params.pop("ops", None)
        if ops is None:
            ops = tuple(range(len(op_order(to_graph(body_at(p, path))))))
        p = RULES[rule].apply(p, Site(tuple(path), tuple(ops)), params)
    return p


FLASH = [("group_partition", (), {"axis": "q"}), ("stream_partition", (0,), {"axis": "x"})]
FLASH_T = dict(g_q=16, s_x=16)
HEADS = [("group_partition", (), {"axis": "h"}), ("group_partition", (0,), {"axis": "q"}),
         ("stream_partition", (0, 0), {"axis": "x"})]
GQA = [("head_grouping", (), {"axis": "k"}), ("group_partition", (0,), {"axis": "q"}),
       ("stream_partition", (0, 0), {"axis": "x"})]
ROWS = [("group_partition", (), {"axis": "n"}), ("stream_partition", (0,), {"axis": "v"})]
MATMUL = [("group_partition", (), {"axis": "a"}), ("group_partition", (0,), {"axis": "c"}),
          ("stream_partition", (0, 0), {"axis": "b"})]
BMM = [("group_partition", (), {"axis": "batch"}), ("group_partition", (0,), {"axis": "a"}),
       ("group_partition", (0, 0), {"axis": "c"}), ("stream_partition", (0, 0, 0), {"axis": "b"})]
RMS = [("normalized_contraction", (), {"ops": (6,)}), ("group_partition", (), {"axis": "n"}),
       ("stream_partition", (0,), {"axis": "d"})]

# name: (derivation, tiles, aligned sizes, ragged sizes)
CASES = {
    "attention": (FLASH, FLASH_T, dict(q=64, x=64, d=32), dict(q=50, x=37, d=16)),
    "causal_attention": (FLASH, FLASH_T, dict(q=64, x=64, d=32), dict(q=50, x=37, d=16)),
    "sliding_window_attention": (FLASH, FLASH_T, dict(q=64, x=64, d=16),
                                 dict(q=50, x=37, d=16)),
    "softcap_attention": (FLASH, FLASH_T, dict(q=32, x=64, d=16), dict(q=50, x=37, d=16)),
    "mha": (HEADS, dict(g_h=1, **FLASH_T), dict(h=2, q=32, x=32, d=16),
            dict(h=2, q=40, x=24, d=16)),
    "gqa": (GQA, FLASH_T, dict(k=2, r=4, q=32, x=32, d=16), dict(k=2, r=4, q=20, x=24, d=16)),
    "mqa": (FLASH, FLASH_T, dict(h=4, q=32, x=32, d=16), dict(h=4, q=20, x=24, d=16)),
    "matmul": (MATMUL, dict(g_a=16, g_c=16, s_b=16), dict(a=32, b=64, c=32),
               dict(a=40, b=37, c=24)),
    "batched_matmul": (BMM, dict(g_batch=1, g_a=16, g_c=16, s_b=16),
                       dict(batch=2, a=32, b=32, c=16), dict(batch=2, a=20, b=37, c=24)),
    "logsumexp": (ROWS, dict(g_n=16, s_v=16), dict(n=32, v=64), dict(n=40, v=37)),
    "cross_entropy": (ROWS, dict(g_n=16, s_v=16), dict(n=32, v=64), dict(n=40, v=37)),
    "linear_cross_entropy": (ROWS, dict(g_n=16, s_v=16), dict(n=32, v=64, d=16),
                             dict(n=40, v=37, d=16)),
    "rmsnorm_matmul": (RMS, dict(g_n=16, s_d=16), dict(n=32, d=64, e=16),
                       dict(n=40, d=37, e=16)),
}
TOL = {"f32": 1e-5, "bf16": 2e-2}
_KERNELS = {}


def kernel_for(name, dtype="f32", steps=None, tiles=None):
    key = (name, dtype, repr(steps), repr(tiles))
    if key not in _KERNELS:
        steps = steps or CASES[name][0]
        tiles = tiles or CASES[name][1]
        _KERNELS[key] = lower(derive(name, steps), tiles, dtype=None if dtype == "f32" else dtype,
                              name=name)
    return _KERNELS[key]


def inputs(name, sizes, dtype="f32", seed=0):
    xs = get(name).sample(np.random.default_rng(seed), sizes)
    return [jnp.asarray(x, jnp.float32 if dtype == "f32" else jnp.bfloat16) for x in xs]


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.abs(out - ref).max() / np.abs(ref).max()


def check(name, kernel, sizes, dtype="f32", seed=0):
    xs = inputs(name, sizes, dtype, seed)
    out = kernel(*xs)
    ref = get(name).reference(*[x.astype(jnp.float32) for x in xs])
    assert out.shape == ref.shape
    assert out.dtype == (jnp.float32 if dtype == "f32" else jnp.bfloat16)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) <= TOL[dtype], rel_err(out, ref)
    mlir = export_cuda(kernel, [x.shape for x in xs])
    assert "__gpu$xla.gpu.triton" in mlir
    return out, ref


# ---------------------------------------------------------------- every algorithm
@pytest.mark.parametrize("ragged", [False, True], ids=["aligned", "ragged"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_f32(name, ragged):
    check(name, kernel_for(name), CASES[name][3 if ragged else 2])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_bf16(name):
    check(name, kernel_for(name, "bf16"), CASES[name][3], "bf16", seed=1)


@pytest.mark.parametrize("k,r", [(4, 1), (2, 4), (1, 8)], ids=["ratio1", "ratio4", "all_heads"])
def test_gqa_ratios(k, r):
    check("gqa", kernel_for("gqa"), dict(k=k, r=r, q=24, x=40, d=16))


def test_logsumexp_streamed_at_the_root_runs_as_one_program():
    kern = kernel_for("logsumexp", steps=[("stream_partition", (), {"axis": "v"})],
                      tiles=dict(s_v=16))
    check("logsumexp", kern, dict(n=16, v=40))
    assert kern.plan((16, 40)).grid == (1,)


def test_groups_without_a_stream_load_whole_tiles():
    kern = kernel_for("matmul", steps=MATMUL[:2], tiles=dict(g_a=16, g_c=16))
    check("matmul", kern, dict(a=40, b=32, c=24))
    assert "fori_loop" not in kern.source()


# ---------------------------------------------------------------- structure and source
def test_grid_and_blocks_follow_the_groups():
    kern = kernel_for("gqa")
    plan = kern.plan((2, 4, 40, 16), (2, 24, 16), (2, 24, 16))
    assert plan.grid == (2, 3)                                   # k groups of 1, ⌈40/16⌉
    assert plan.block_shapes["Q"] == (1, 4, 16, 16)
    assert plan.block_shapes["K"] == (1, 32, 16)                 # whole x, padded, streamed
    assert plan.block_shapes["O"] == (1, 4, 16, 16)
    src = plan.source
    assert "lambda i0, i1: (i0, 0, 0)" in src                    # K ignores the q grid dim
    assert "lax.fori_loop" in src or "x_chunk(0" in src
    assert "pl.ds(x0" in src and "plt.store(" in src              # chunk loads, masked store
    assert [str(g) for g in kern.grid] == ["k", "ceiling(q/16)"]


def test_source_is_a_module_that_runs(tmp_path):
    kern = kernel_for("causal_attention")
    xs = inputs("causal_attention", dict(q=50, x=37, d=16))
    path = tmp_path / "flash.py"
    path.write_text(kern.source(*[x.shape for x in xs]))
    spec = importlib.util.spec_from_file_location("flash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (out,) = mod.forward(*xs, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(kern(*xs)), rtol=1e-6, atol=1e-6)
    text = path.read_text()
    assert "napkin" not in text.split('"""')[2]                   # plain JAX: no napkin import
    assert "jnp.where(" in text and "lax.dot_general(" in text


def test_jit_and_vmap():
    kern = kernel_for("causal_attention")
    alg = get("causal_attention")
    xs = inputs("causal_attention", dict(q=40, x=24, d=16))
    np.testing.assert_allclose(np.asarray(jax.jit(kern)(*xs)), np.asarray(kern(*xs)),
                               rtol=1e-6, atol=1e-6)
    batch = [jnp.stack([x, 2 * x]) for x in xs]
    out = jax.vmap(kern)(*batch)
    ref = jax.vmap(alg.reference)(*batch)
    assert out.shape == (2, 40, 16) and rel_err(out, ref) <= 1e-5
    shared = jax.vmap(kern, in_axes=(0, None, None))(batch[0], xs[1], xs[2])
    assert rel_err(shared, jax.vmap(alg.reference, in_axes=(0, None, None))(
        batch[0], xs[1], xs[2])) <= 1e-5


# ---------------------------------------------------------------- masks and tile skipping
def test_fully_masked_rows_are_zero():
    # window 4, more queries than keys: rows q >= x + 3 keep no key.  The diagram
    # (softmax of a row that kept nothing) and the reference give those rows
    # zeros; so does the kernel, never NaN.
    kern = kernel_for("sliding_window_attention")
    out, ref = check("sliding_window_attention", kern, dict(q=48, x=16, d=16))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out)[20:], 0.0)


def test_causal_and_window_masks_skip_tiles():
    shapes = [(64, 32)] * 3
    full = traffic(kernel_for("attention"), shapes)
    causal = traffic(kernel_for("causal_attention"), shapes)
    window = traffic(kernel_for("sliding_window_attention"), shapes)
    chunk = 16 * 32 * 4
    assert full.reads["K"] == 16 * chunk                          # 4 tiles × 4 chunks
    assert causal.reads["K"] == (1 + 2 + 3 + 4) * chunk          # the upper triangle skipped
    assert window.reads["K"] == (1 + 2 + 2 + 2) * chunk          # window 4: one or two chunks
    assert "tile skipping" in kernel_for("causal_attention").source(*shapes)
    assert "tile skipping" not in kernel_for("attention").source(*shapes)


def test_a_grid_axis_of_tile_one_leaves_the_kernel_body_when_every_box_only_carries_it():
    """A unit grid axis (a head per program) is squeezed from every block and dropped from
    the body (napkin.frontend.weave.unweave), so the kernel's tiles are 2-D as a hand-written one's;
    an axis a box reads the index of (a causal mask's query) or reduces over stays."""
    from napkin.frontend.weave import unweavable
    mha = kernel_for("mha")  # g_h = 1
    sizes = dict(h=3, q=40, x=24, d=16)
    shapes = [(3, 40, 16), (3, 24, 16), (3, 24, 16)]
    src = mha.source(*shapes)
    assert mha.plan(*shapes).plan.body is not None
    assert src.count("pl.BlockSpec((None, ") == 4 and "reshape" not in src, src
    check("mha", mha, sizes)
    causal = lower(derive("causal_attention", FLASH), dict(g_q=1, s_x=16), name="causal")
    assert "reads the index of q" in unweavable(get("causal_attention").diagram(), "q")
    assert unweavable(get("attention").diagram(), "q") == ""
    assert "softmax_x reads the index of x" in unweavable(get("attention").diagram(), "x")
    assert "reduces over v" in unweavable(get("logsumexp").diagram(), "v")
    assert "None" not in causal.source((5, 16), (20, 16), (20, 16)).split("in_specs")[1]
    xs = inputs("causal_attention", dict(q=5, x=20, d=16))  # interpret mode: M = 1 dots
    assert rel_err(causal(*xs), get("causal_attention").reference(*xs)) <= TOL["f32"]


@pytest.mark.parametrize("g_n", [1, 4])
def test_a_low_precision_row_softmax_normalises_in_f32_and_lowers_for_cuda(g_n):
    """softmax of a bf16 row (a whole row per program: softmax does not stream) computes
    its max, exp, sum and division in f32 and rounds once: it matches the reference at
    bf16's tolerance and lowers for CUDA (a bf16 division Triton could not type did not)."""
    kernel = lower(derive("softmax", [("group_partition", (), {"axis": "n"})]), dict(g_n=g_n),
                   dtype="bf16", name="softmax")
    xs = inputs("softmax", dict(n=6, v=256), "bf16", seed=5)
    src = kernel.source(*[x.shape for x in xs])
    assert ".astype(jnp.float32)" in src and src.count("jnp.where(") == 1, src
    ref = get("softmax").reference(*[x.astype(jnp.float32) for x in xs])
    assert rel_err(kernel(*xs), ref) <= TOL["bf16"]
    assert "__gpu$xla.gpu.triton" in export_cuda(kernel, [x.shape for x in xs])


def test_a_whole_axis_of_any_size_lowers_padded_and_masked():
    """An axis every program loads whole need not be a power of two: Triton's block is the
    next one and the kernel masks past the axis's end (loads, stores, and each reduction
    over it sees its neutral element there), so the grouped-only attention at x = 96 lowers,
    and the search may return it."""
    from napkin.lower.backends import get_backend
    from napkin.lower.plan import unlowerable
    rules = get_backend().rules
    grouped = derive("attention", FLASH[:1])
    assert unlowerable(grouped, dict(q=96, x=96, d=16), rules) == ""
    kernel = lower(grouped, dict(g_q=16), interpret=True)
    for sizes in (dict(q=40, x=96, d=20), dict(q=33, x=5, d=3)):
        xs = inputs("attention", sizes)
        spec = kernel.plan(*[x.shape for x in xs])
        assert spec.plan.padded == {a: pow2 for a, pow2 in (("x", 128 if sizes["x"] > 64 else 8),
                                                             ("d", 32 if sizes["d"] > 16 else 4))}
        assert rel_err(kernel(*xs), get("attention").reference(
            *[np.asarray(x, np.float64) for x in xs])) < 1e-5


def test_matmul_grids_launch_in_grouped_order():
    """A grid whose two dimensions each index an operand the other does not (matmul's
    A[a,b], B[b,c]) launches as one dimension in groups of 8 row tiles: every tile exactly
    once, a group's programs sweeping the columns with the same column tile 8 programs in
    a row (a ragged last group too), and the kernel still equals the reference and moves
    the bytes the schedule prices.  Attention's (h, q) grid has no such pair."""
    from napkin.lower.plan import tile_indices
    from napkin.lower.plan import Raster
    kernel = kernel_for("matmul")
    shapes = [(300, 37), (37, 100)]  # 19 row tiles (two groups of 8, then 3) × 7 columns
    plan = kernel.plan(*shapes).plan
    assert plan.raster == Raster(0, 1, 8) and kernel.plan(*shapes).grid == (133,)
    pid = np.arange(133)
    rows, cols = [np.asarray(eval(e, {"jnp": jnp}, {"i0": pid}))
                  for e in tile_indices(plan, ["i0"])]
    assert sorted(zip(rows, cols)) == [(r, c) for r in range(19) for c in range(7)]
    assert (rows[:8] == np.arange(8)).all() and (cols[:8] == 0).all() and cols[8] == 1
    assert (rows[112:115] == [16, 17, 18]).all() and (cols[112:115] == 0).all()
    check("matmul", kernel, dict(a=300, b=37, c=100))
    a, b, c = 256, 48, 64  # 16 row tiles: A read once per column tile, B once per row tile
    assert kernel.plan((a, b), (b, c)).plan.raster is not None
    assert hbm_bytes(kernel, [(a, b), (b, c)]) == (a * b * (c // 16) + b * c * (a // 16)
                                                   + a * c) * 4
    mha = kernel_for("mha").plan((4, 200, 16), (4, 24, 16), (4, 24, 16))
    assert mha.plan.raster is None and mha.grid == (4, 13)  # K, V: per head, every q tile


@pytest.mark.parametrize("c", [0.125, -0.5])
def test_exp_is_exp2_with_a_positive_scale_of_low_precision_scores_folded_in(c):
    """Every exp is written as exp2 (one ex2 on a GPU, not libdevice's expf).  A positive
    scale of bf16 scores folds into it and into their row max, so the scaled tile is never
    computed; a negative scale (max(s·c) is not max(s)·c) and f32 scores (the subtraction
    stays exact) do not fold.  Each kernel matches the float64 reference, the bf16 one with
    scores large enough (|s·c| ~ 100) that a wrong fold would show."""
    q, x, d = axes("q x d")

    def f(Q, K, V):
        S = ops.scale(ops.contract(Q, K, out=(q, x), as_="S"), c)
        return ops.contract(ops.softmax(S, x), V, out=(q, d), as_="O")
    rng = np.random.default_rng(4)
    Q, K, V = [rng.standard_normal(s) for s in [(48, 32), (40, 32), (40, 32)]]
    Q = 4 * Q / abs(c)  # scaled scores of order 100: p spans many binades
    for dtype, tol in (("bf16", 2e-2), ("f32", 1e-5)):
        shapes = {"Q": Array(q, d, dtype=dtype), "K": Array(x, d, dtype=dtype),
                  "V": Array(x, d, dtype=dtype)}
        kern = lower(derive(None, FLASH, trace(f, shapes, "scaled")), FLASH_T,
                     dtype=None if dtype == "f32" else dtype)
        src = kern.source(Q.shape, K.shape, V.shape)
        assert "jnp.exp(" not in src and "jnp.exp2(" in src
        folded = f"jnp.exp2(S * {c * math.log2(math.e)!r} - " in src
        assert folded == (dtype == "bf16" and c > 0), src
        assert (f"S * {c!r}" in src) != folded, src  # the scaled tile goes unread
        cast = jnp.float32 if dtype == "f32" else jnp.bfloat16
        xs = [jnp.asarray(a, cast) for a in (Q, K, V)]
        Qr, Kr, Vr = [np.asarray(a, np.float64) for a in xs]
        sr = (Qr @ Kr.T) * c
        er = np.exp(sr - sr.max(1, keepdims=True))
        ref = (er / er.sum(1, keepdims=True)) @ Vr
        out = np.asarray(kern(*xs), np.float64)
        assert np.isfinite(out).all() and rel_err(out, ref) <= tol, (dtype, rel_err(out, ref))


@pytest.mark.parametrize("offset,window", [(-20, None), (3, 6)])
def test_user_written_masked_attention(offset, window):
    # a diagram written here (not in the library): a shifted causal mask, and a
    # causal mask combined with a window; rows with no key at all (offset -20)
    # are zero, as in the reference below
    q, x, d = axes("q x d")

    def f(Q, K, V):
        S = ops.scale(ops.contract(Q, K, out=(q, x)), 1 / sympy.sqrt(d.size))
        S = ops.causal_mask(S, q, x, offset=offset)
        if window:
            S = ops.window_mask(S, q, x, window)
        return ops.contract(ops.softmax(S, x), V, out=(q, d), as_="O")
    program = derive(None, FLASH, trace(f, {"Q": Array(q, d), "K": Array(x, d),
                                            "V": Array(x, d)}, "masked"))
    kern = lower(program, FLASH_T)
    rng = np.random.default_rng(3)
    Q, K, V = [rng.standard_normal(s).astype(np.float32) for s in [(50, 16), (37, 16), (37, 16)]]
    i, j = np.arange(50)[:, None], np.arange(37)[None]
    keep = j <= i + offset
    if window:
        keep &= (j > i - window) & (j <= i)
    s = np.where(keep, Q @ K.T / 4.0, -1e30)
    e = np.exp(s - s.max(1, keepdims=True))
    ref = np.where(keep.any(1)[:, None], (e / e.sum(1, keepdims=True)) @ V, 0.0)
    out = np.asarray(kern(Q, K, V))
    assert np.isfinite(out).all() and rel_err(out, ref) <= 1e-5
    assert traffic(kern, [Q.shape, K.shape, V.shape]).reads["K"] < 4 * 3 * 16 * 16 * 4
    export_cuda(kern, [Q.shape, K.shape, V.shape])


# ---------------------------------------------------------------- traffic
@pytest.mark.parametrize("g_q,dtype", [(16, "f32"), (32, "f32"), (16, "bf16")])
def test_attention_hbm_bytes_closed_form(g_q, dtype):
    q, x, d = 64, 128, 32
    kern = kernel_for("attention", dtype, tiles=dict(g_q=g_q, s_x=32))
    nbytes = 4 if dtype == "f32" else 2
    want = (2 * q * d + 2 * x * d * math.ceil(q / g_q)) * nbytes
    assert hbm_bytes(kern, [(q, d), (x, d), (x, d)]) == want


def test_matmul_hbm_bytes():
    a, b, c = 64, 48, 32
    kern = kernel_for("matmul")
    # A is read once per column tile, B once per row tile, C written once
    assert hbm_bytes(kern, [(a, b), (b, c)]) == (a * b * (c // 16) + b * c * (a // 16)
                                                 + a * c) * 4


# ---------------------------------------------------------------- errors
def test_non_power_of_two_tile_is_refused_unless_it_covers_the_axis():
    """A tile Triton cannot block is refused at the shapes it tiles, naming the way out; a
    tile that covers its whole axis (the search offers the axis's own size) is one tile,
    padded to a power of two and masked."""
    shapes = [(96, 16), (96, 16), (96, 16)]
    with pytest.raises(NapkinError, match=r"tile g_q=48 must be a power of two for the Triton "
                                          r"backend \(or cover the whole axis, 96\)"):
        lower(derive("attention", FLASH), dict(g_q=48, s_x=16)).plan(*shapes)
    with pytest.raises(NapkinError, match=r"tile s_x=24 must be a power of two"):
        lower(derive("attention", FLASH), dict(g_q=16, s_x=24)).plan(*shapes)
    whole = lower(derive("attention", FLASH), dict(g_q=96, s_x=96), interpret=True)
    plan = whole.plan(*shapes).plan
    assert [(g.tile, g.tiles, g.ragged) for g in plan.grid] == [(128, 1, True)]
    assert [(s.chunk, s.full, s.tail) for s in plan.streams.values()] == [(128, 0, 96)]
    xs = inputs("attention", dict(q=96, x=96, d=16))
    assert rel_err(whole(*xs), get("attention").reference(
        *[np.asarray(x, np.float64) for x in xs])) < 1e-5


def test_missing_tile_is_named():
    with pytest.raises(NapkinError, match=r"no tile size for s_x"):
        lower(derive("attention", FLASH), dict(g_q=16))


def test_interpret_is_automatic_on_a_cpu():
    kern = kernel_for("attention")
    assert kern.resolve_interpret() == (jax.devices()[0].platform != "gpu")
    assert kern.resolve_interpret(False) is False


def _pins() -> dict:
    """The versions pyproject's dev extra pins, by package."""
    import tomllib
    from pathlib import Path
    dev = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    return dict(p.split("==") for p in dev["project"]["optional-dependencies"]["dev"]
                if "==" in p)


def test_triton_compiles_the_kernels_for_hopper(monkeypatch):
    """Triton's whole pipeline for sm_90, no GPU needed (the dev extra's triton): small
    kernels, a second or two each."""
    pytest.importorskip("triton")
    from napkin.lower import ptx
    jaxlib, triton = ptx.versions()
    if jaxlib != _pins()["jaxlib"]:  # not set up from the dev extra (the GPU machine has
        pytest.skip(f"jaxlib {jaxlib} is not the dev extra's pin")  # its own pair)
    for name in ("causal_attention", "matmul"):
        kernel = kernel_for(name, "bf16")
        (k,) = ptx.compile_ptx(kernel, [x.shape for x in inputs(name, CASES[name][3])])
        assert 0 < k.shared <= ptx.SHARED_LIMIT and ".target sm_90" in k.ptx
        assert k.registers > 0 and k.spills == 0 and k.dots >= 1
        launch = kernel.plan(*[x.shape for x in inputs(name, CASES[name][3])]).launch
        assert (k.num_warps, k.num_stages) == (launch["num_warps"], launch["num_stages"])
        assert k.tensor_cores, name  # attention's P·V too: P rounded to V's bf16, not V upcast
    monkeypatch.setattr(ptx, "SHARED_LIMIT", k.shared - 1)
    with pytest.raises(NapkinError, match=rf"matmul needs {k.shared} bytes of shared memory"):
        ptx.compile_ptx(kernel, [x.shape for x in inputs("matmul", CASES["matmul"][3])])


@pytest.mark.parametrize("jaxlib, triton, words", [
    ("0.11.2", "3.9.0", ["triton 3.9.0 cannot read", "jaxlib 0.11.2", "'triton==3.8.*'"]),
    ("0.12.0.1", "3.8.0", ["triton 3.8.0 cannot read", "jaxlib 0.12.0.1", "'triton==3.9.*'"]),
    ("0.12.0.1", None, ["needs triton 3.9", "'triton==3.9.*'"]),
    ("0.13.0", "3.9.0", ["jaxlib 0.13.0", "known pairs", "jaxlib 0.12 with triton 3.9"]),
], ids=["0.11-3.9", "0.12-3.8", "no-triton", "unknown-jaxlib"])
def test_a_mismatched_triton_is_one_clear_line_before_any_parsing(monkeypatch, jaxlib, triton,
                                                                   words):
    from napkin.lower import kernel as lowered, ptx

    def never(*_):
        raise AssertionError("exported or parsed despite the mismatch")
    monkeypatch.setattr(ptx, "versions", lambda: (jaxlib, triton))
    monkeypatch.setattr(lowered, "export_cuda", never)
    monkeypatch.setattr(ptx, "_compile", never)
    with pytest.raises(NapkinError) as e:
        ptx.compile_ptx(kernel_for("matmul"), [(32, 64), (64, 32)])
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_the_dev_extra_pins_a_known_pair():
    """pyproject's dev extra installs jax, jaxlib and triton together, as a known pair."""
    from napkin.lower.ptx import TRITON_FOR_JAXLIB
    pins = _pins()
    assert pins["jax"] == pins["jaxlib"]
    assert TRITON_FOR_JAXLIB[".".join(pins["jaxlib"].split(".")[:2])] == \
        ".".join(pins["triton"].split(".")[:2])


def test_report_sets_what_triton_allocates_beside_the_schedule():
    pytest.importorskip("triton")
    from napkin.cost.model import value_at
    from napkin.hardware import get_hardware
    from napkin.lower.ptx import compile_ptx
    from napkin.lower.report import modelled, report
    from napkin.schedule import build
    sizes, tiles = CASES["matmul"][2], CASES["matmul"][1]
    kernel, shapes = kernel_for("matmul", "bf16"), [(32, 64), (64, 32)]
    schedule = build(derive("matmul", MATMUL), get_hardware("h100").two_level(), "bf16")
    text = report(kernel, schedule, sizes, shapes)
    smem = {lv.name: lv for lv in modelled(schedule, {**sizes, **tiles})}["smem"]
    assert smem.peak == max(value_at(b, {**sizes, **tiles}) for b in schedule.memory["smem"][1])
    assert {"A_blk", "B_blk"} <= {b[0] for b in smem.buffers}
    (k,) = compile_ptx(kernel, shapes)
    row = next(ln for ln in text.splitlines() if ln.startswith("smem "))
    assert f"{smem.peak:,}" in row
    row = next(ln for ln in text.splitlines() if "per block" in ln)
    # (tiles this small leave the tensor cores' wgmma path, and Triton's pipelining with
    # it: the CPU proofs at the optimiser's own tiles check the count is exact there)
    modelled_b = int(row.split("tensor cores")[1].split()[0].replace(",", ""))
    assert f"shared {k.shared:,} B = {k.shared / modelled_b:.2f}x modelled" in row
    row = next(ln for ln in text.splitlines() if ln.startswith("registers "))
    assert f"{k.registers} registers/thread" in row and "spills 0 B/thread" in row
    assert "1 dot: all on tensor cores" in text


def test_report_without_triton_says_so_and_keeps_the_schedule(monkeypatch):
    from napkin.hardware import get_hardware
    from napkin.lower import ptx
    from napkin.lower.report import report
    from napkin.schedule import build
    monkeypatch.setattr(ptx, "versions", lambda: ("0.12.0.1", None))
    schedule = build(derive("matmul", MATMUL), get_hardware("h100").two_level(), "bf16")
    lines = report(kernel_for("matmul", "bf16"), schedule, CASES["matmul"][2],
                   [(32, 64), (64, 32)]).splitlines()
    assert lines[1] == ("allocated: not compiled: compiling to PTX needs triton 3.9 (it reads "
                        "jaxlib 0.12.0.1's Triton IR): pip install 'triton==3.9.*'")
    assert any(ln.startswith("smem ") and "peak" in ln for ln in lines)
    assert any("A_blk" in ln and "bf16[a=16, b=16]" in ln for ln in lines)


@pytest.mark.parametrize("name", ["attention", "gqa", "matmul", "rmsnorm_matmul"])
def test_low_precision_contractions_are_tensor_core_dots(name):
    """The kernels' contraction policy: with a bf16 operand every operand is bf16 (P·V
    rounds P, it does not upcast V to f32 at HIGHEST precision), and a dot's result stays in
    its f32 accumulator (never rounded back to bf16 inside the kernel); the kernel still
    matches the float64 reference at bf16's tolerance."""
    import re
    kernel = kernel_for(name, "bf16")
    sizes = CASES[name][2]
    src = kernel.source(*[x.shape for x in inputs(name, sizes)])
    dots = [ln for ln in src.splitlines() if "lax.dot_general(" in ln]
    assert dots and not any("HIGHEST" in ln for ln in dots), src
    results = {re.match(r"\s*(\w+) = lax.dot_general", ln).group(1) for ln in dots}
    for r in results:  # a dot result is never cast back to bf16
        assert not re.search(rf"= {r}\.astype\(jnp\.bfloat16\)", src), src
    upcast = set(re.findall(r"(\w+) = \w+\.astype\(jnp\.float32\)", src))
    operands = {a for d in dots for a in re.findall(r"dot_general\((\w+), (\w+),", d)[0]}
    assert operands and not operands & upcast, src  # no operand upcast to f32
    check(name, kernel, sizes, "bf16")


def test_num_warps_follow_the_largest_tile():
    from napkin.lower.backends.triton import warps_for
    assert [warps_for(n) for n in (64, 128 * 64, 128 * 128, 256 * 128, 256 * 256)] == \
        [4, 4, 8, 8, 8]
    kernel = kernel_for("attention", "bf16")
    assert kernel.launch["num_warps"] == "auto"
    shapes = [x.shape for x in inputs("attention", CASES["attention"][2])]
    assert kernel.plan(*shapes).launch == {"num_warps": 4, "num_stages": 2}
    assert "CompilerParams(num_warps=4, num_stages=2)" in kernel.source(*shapes)
    pinned = lower(derive("attention", FLASH), FLASH_T, num_warps=8)
    assert "CompilerParams(num_warps=8, num_stages=2)" in pinned.source(*shapes)


CPU_PROOFS = [
    ("h100", "attention", None), ("h100", "causal_attention", None),
    ("h100", "sliding_window_attention", None), ("h100", "softcap_attention", None),
    ("h100", "matmul", None),
    ("h100", "gqa", dict(k=8, r=4, q=1024, x=1024, d=128, max_states=150)),  # a quick search
    ("h100", "logsumexp", None), ("h100", "cross_entropy", None),
    ("h200", "attention", dict(q=16384, x=16384, d=128)), ("h200", "matmul", None),
    ("h100", "batched_matmul", None),  # a unit batch axis, squeezed from the blocks
    ("h100", "mha", dict(h=16, q=4096, x=4096, d=128, max_states=300)),
    ("h100", "mqa", dict(h=16, q=4096, x=4096, d=128, max_states=300)),
    ("h100", "linear_cross_entropy", None),  # the logits in HBM: a GEMM and three row kernels
    pytest.param("h100", "softmax", None, marks=pytest.mark.xfail(
        strict=True, reason="a whole 32,768-wide row per block: the model holds X and P in "
                            "f32 at once (256 registers of data a thread) and prices a spill; "
                            "ptxas fits it in 200 registers with none")),
]


@pytest.mark.parametrize("hardware, name, sizes", CPU_PROOFS)
def test_the_optimisers_own_kernels_are_what_the_model_says(hardware, name, sizes):
    """CPU proof of the GPU code for each library kernel at the optimiser's own tiles and
    launch parameters (bf16, its default full sizes unless given), compiled for sm_90 with
    the pinned triton: every dot a Hopper wgmma (none on CUDA cores), no register spills,
    and the shared memory Triton allocates within the block's limit and within 15 % of the
    launch model's count (exact for these kernels; 1 KiB of slack where the model has
    none), in a bounded compile time."""
    import time
    pytest.importorskip("triton")
    from napkin.lower import ptx
    from napkin.pipeline import optimize
    if ptx.versions()[0] != _pins()["jaxlib"]:
        pytest.skip("jaxlib is not the dev extra's pin")
    sizes = dict(sizes or {})
    opt = optimize(name, hardware, sizes, "bf16", max_states=sizes.pop("max_states", 2000))
    shapes = [tuple(opt.sizes[a.name] for a in ob.type.axes) for ob in opt.algorithm.dom.inside]
    models = opt.search.best.tiles.launch
    start = time.perf_counter()
    compiled = ptx.compile_ptx(opt.kernel(), shapes, check_shared=False)
    assert time.perf_counter() - start < 60 * len(models)
    assert len(compiled) == len(models)
    for model, k in zip(models, compiled):
        assert (k.num_warps, k.num_stages) == (model["num_warps"], model["num_stages"])
        assert k.fma_dots == 0, k.ttgir
        assert ("wgmma.mma_async" in k.ptx) == (k.dots > 0)
        assert k.spills == 0 and model["spilled_bytes"] == 0
        assert k.shared <= ptx.SHARED_LIMIT
        assert abs(k.shared - model["smem_bytes"]) <= max(0.15 * model["smem_bytes"], 1024), \
            (k.shared, model)


def test_gqas_backward_kernels_load_merged_rows_as_rows_and_do_not_spill():
    """GQA's dK, dV stream Q, dO (and L, D) in chunks (r, s_q, ·) that its products read as
    r·s_q rows.  Loaded as the 3-D blocks they are and reshaped in registers, ptxas spilled
    276 B at 255 registers (g_x = 64, s_q = 32, default sizes); loaded as rows, each row's
    head and query from one iota (backends.triton._Spelling.rows_access), none.  Every
    kernel of the backward: dots on wgmma, no spills, shared memory within 15 % of the
    model's."""
    pytest.importorskip("triton")
    from napkin.lower import ptx
    from napkin.pipeline import optimize
    if ptx.versions()[0] != _pins()["jaxlib"]:
        pytest.skip("jaxlib is not the dev extra's pin")
    opt = optimize("gqa", "h100", dict(k=8, r=4, q=1024, x=1024, d=128), "bf16",
                   max_states=150)
    rows = 0
    for _, o in opt.backward.pieces:
        shapes = [tuple(o.sizes[a.name] for a in ob.type.axes) for ob in o.algorithm.dom.inside]
        rows += o.kernel().source(*shapes).count("r_i = ")
        for model, k in zip(o.search.best.tiles.launch,
                            ptx.compile_ptx(o.kernel(), shapes, check_shared=False)):
            assert k.spills == 0 and k.fma_dots == 0, (o.tiles, k.registers, k.spills)
            assert abs(k.shared - model["smem_bytes"]) <= max(0.15 * model["smem_bytes"], 1024)
    assert rows >= 1  # the dK, dV stream's chunks, loaded as rows


def test_a_product_accumulated_from_a_transposed_tile_is_carried_transposed():
    """dV += Pᵀ·dO, dK += dSᵀ·Q: the row operand is computed in the step and read
    transposed.  Triton transposed it in registers and, at 2 stages, held it over the step
    boundary: softcap's dK, dV spilled 52 B at 255 registers (g_x = 64, s_q = 128, 8 warps;
    MQA's 16 B, ALiBi's 12 B).  The writer carries such a state transposed (napkin.schedule.layout):
    the loaded operand gives the rows, the computed one is staged in shared memory as it
    lies, one transpose after the loop — no spill.  The forward's O += P·V (P read as it
    lies) keeps its layout.  K and V, loaded before the loop and read transposed by
    S = Q·Kᵀ, dP = dO·Vᵀ, are transposed once before it: Triton had transposed them into a
    shared-memory buffer every step (148,480 B allocated, 164,096 modelled, 218 registers);
    now it stages them once, and P and dS, the products' computed second operands, share one
    buffer — allocated as the schedule counts them (napkin.schedule.layout)."""
    pytest.importorskip("triton")
    from napkin.lower import ptx
    from napkin.lower.plan import stream_boxes
    from napkin.schedule.layout import carried
    from napkin.pipeline import optimize
    if ptx.versions()[0] != _pins()["jaxlib"]:
        pytest.skip("jaxlib is not the dev extra's pin")
    opt = optimize("softcap_attention", "h100", None, "bf16")
    assert [carried(b.spec)[3] for b in stream_boxes(opt.program)] == [()]
    (_, o), = [(w, o) for w, o in opt.backward.pieces if "K" in w]
    assert [carried(b.spec)[3] for b in stream_boxes(o.program)] == [(0, 1), ()]
    assert [[b.dom.inside[i].name for i in carried(b.spec)[4]]
            for b in stream_boxes(o.program)] == [["K", "V"], []]
    shapes = [tuple(o.sizes[a.name] for a in ob.type.axes) for ob in o.algorithm.dom.inside]
    assert o.kernel().source(*shapes).count("# transpose") == 2
    # each kernel of the program on its own too (the merge of the split's parts reads a
    # size its arrays lack: the part's source had raised sympy's TypeError)
    assert [part.source(*s).count("# transpose") for part, s in o.kernel().parts(shapes)] \
        == [0, 2, 0]
    for model, k in zip(o.search.best.tiles.launch,
                        ptx.compile_ptx(o.kernel(), shapes, check_shared=False)):
        assert k.spills == 0 and k.fma_dots == 0, (o.tiles, model, k.registers, k.spills)
        # (within 1 KiB: L and D are kept in f32, the schedule counts them at bf16)
        assert abs(k.shared - model["smem_bytes"]) <= 1024, (k.shared, model)


def test_a_dot_a_tile_makes_smaller_than_16_does_not_compile():
    """On a GPU no dot dimension is under 16 (Triton's tl.dot): a kernel whose tile makes
    one refuses to compile in one line naming the tile; interpret mode (a CPU) still runs
    it, as multiply-and-sum, and matches the reference.  A whole axis that small is the
    problem's own size and compiles (multiply-and-sum on the CUDA cores)."""
    sizes = dict(q=64, x=64, d=32)
    kernel = lower(derive("attention", FLASH), dict(g_q=16, s_x=8), name="attention")
    xs = inputs("attention", sizes)
    shapes = [x.shape for x in xs]
    with pytest.raises(NapkinError, match=r"attention cannot be compiled for a GPU: QK\^T: its "
                                          r"N dimension is 8 \(x in tiles of s_x = 8\), under "
                                          r"16, the least dot dimension"):
        export_cuda(kernel, shapes)
    with pytest.raises(NapkinError, match="cannot be compiled for a GPU"):
        kernel(*xs, interpret=False)
    out = kernel(*xs, interpret=True)
    assert rel_err(out, get("attention").reference(*xs)) <= TOL["f32"]
    small = lower(derive("attention", FLASH), dict(g_q=16, s_x=16), name="attention")
    assert "__gpu$xla.gpu.triton" in export_cuda(small, [(64, 8), (64, 8), (64, 8)])  # d = 8


def test_napkins_attention_matches_pallas_mha_at_the_same_tiles():
    """Parity with JAX's own Pallas ``mha`` (block_q 128, block_k 64, 8 warps, 2 stages, d =
    128, bf16), both compiled for sm_90 by the pinned triton: napkin's attention kernel has
    the same wgmma instructions (the two dots of one step), no spills, no more shared memory
    (98,304 B both) and registers within 10 % (140 against 150 on 2026-12-01, with exp2 and
    the scale folded; 176 with jnp.exp, which Triton writes as libdevice's __nv_expf)."""
    import warnings
    pytest.importorskip("triton")
    from napkin.lower import ptx
    from napkin.lower.backends.triton import TRITON
    if ptx.versions()[0] != _pins()["jaxlib"]:
        pytest.skip("jaxlib is not the dev extra's pin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    s, d = 4096, 128
    launch = {"num_warps": 8, "num_stages": 2}

    def theirs(q, k, v, interpret=False):
        return pallas_attention.mha(q, k, v, None, block_sizes=pallas_attention.BlockSizes(
            block_q=128, block_k=64), interpret=interpret, **launch)
    structs = [jax.ShapeDtypeStruct((1, s, 1, d), jnp.bfloat16)] * 3
    (ref,) = ptx.compile_exported(TRITON.export(theirs, structs), "pallas_mha", launch)
    kernel = lower(derive("attention", FLASH), dict(g_q=128, s_x=64), dtype="bf16",
                   name="attention", **launch)
    (mine,) = ptx.compile_ptx(kernel, [(s, d)] * 3)
    wgmma = lambda k: k.ptx.count("wgmma.mma_async")  # noqa: E731
    assert mine.spills == ref.spills == 0
    assert wgmma(mine) == wgmma(ref) > 0
    assert mine.registers <= 1.1 * ref.registers, (mine.registers, ref.registers)
    assert "ex2.approx" in mine.ptx
    assert mine.shared <= ref.shared, (mine.shared, ref.shared)


@pytest.mark.parametrize("name, sizes", [("causal_attention", dict(q=100, x=100, d=32)),
                                         ("sliding_window_attention", dict(q=100, x=100, d=32))])
def test_masked_streams_split_into_diagonal_and_unmasked_chunks(name, sizes):
    """Causal and window streams visit three runs of chunks: those the masks cut (the mask
    applied), those every row of the tile keeps whole (a step with no mask work), then cut
    ones again; causal query tiles run heaviest first (the last tile is program 0).  The
    kernel still equals the float64 reference at ragged sizes."""
    kernel = kernel_for(name, steps=FLASH, tiles=dict(g_q=16, s_x=16))
    xs = inputs(name, sizes)
    src = kernel.source(*[x.shape for x in xs])
    steps = re.findall(r"def (x_\w+)\(c\w*, carry\):\n(.*?)\n        return", src, re.S)
    bodies = dict(steps)
    assert {"x_chunk", "x_open"} <= set(bodies), src
    assert "-1e+30" in bodies["x_chunk"] and "-1e+30" not in bodies["x_open"], src
    assert len(re.findall(r"lax.fori_loop\([^\n]*, x_open, ", src)) == 1
    if name == "causal_attention":
        assert "q0 = (6 - pl.program_id(0)) * 16" in src  # 7 tiles of 16 over q = 100
        assert "lambda i0: (6 - i0, 0)" in src
    check(name, kernel, sizes)


def test_interpret_takes_auto_a_bool_or_on_off_and_nothing_else():
    """A truthy "off" or "bogus" ran in interpret mode: now "off" means False and anything
    else is one line."""
    from napkin.lower.kernel import interpret_mode
    assert [interpret_mode(v) for v in ("auto", True, False, "on", "off")] == \
        ["auto", True, False, True, False]
    import napkin as nk
    o = nk.optimize("attention", sizes={"q": 64, "x": 64, "d": 16}, dtype="f32")
    with pytest.raises(NapkinError, match=r"interpret='bogus': give 'auto'"):
        o.kernel(interpret="bogus")
    # every keyword of kernel() is checked: the backend, the dtype (a floating one)
    with pytest.raises(NapkinError, match="unknown kernel backend 'cuda'"):
        o.kernel(backend="cuda")
    with pytest.raises(NapkinError, match="unknown dtype 'bogus'"):
        o.kernel(dtype="bogus")
    with pytest.raises(NapkinError, match=r"dtype='int32': a kernel's dtype is that of its "
                                          r"floating inputs"):
        o.kernel(dtype="int32")


def test_a_kernel_of_no_inputs_is_written_and_runs():
    """A box that reads no input (positions, T5's bucket index) left a kernel of its own —
    what a search cut short by its time limit can hand back — is written (its forward takes
    only ``interpret``) and runs; it was a SyntaxError from the written module."""
    q, d = axes("q d")
    D = trace(lambda X: ops.mul(X, ops.positions(q)), {"X": Array(q, d)}, "positions apart")
    P = RULES["group_partition"].apply(D, Site((), (1,)), {"axis": "q"})  # the mul alone
    assert [len(b.dom) for b in P.boxes if getattr(b, "spec", None) is not None] == [0, 2]
    k = lower(P, {"q": 40, "d": 16, "g_q": 16}, backend="triton", interpret=True)
    x = np.random.default_rng(5).standard_normal((40, 16)).astype(np.float32)
    got = np.asarray(k(x))
    np.testing.assert_allclose(got, x * np.arange(40, dtype=np.float32)[:, None], rtol=1e-6)
    assert "def forward_0(*, interpret=False)" in k.source((40, 16))
    (alone, shapes), _ = k.parts([(40, 16)])
    assert shapes == [] and "__gpu$xla.gpu.triton" in export_cuda(alone, shapes)


def test_a_mask_one_kernel_writes_and_another_reads_stays_boolean():
    """A comparison's result through HBM between two kernels (what a search cut short can
    hand back): the reader's masked load filled with an int 0 made it int32, and `where`
    refused it while lowering."""
    q, d = axes("q d")
    D = trace(lambda X, Y: ops.where(ops.less(X, Y), X, Y),
              {"X": Array(q, d), "Y": Array(q, d)}, "a mask apart")
    P = RULES["group_partition"].apply(D, Site((), (0,)), {"axis": "q"})
    P = RULES["group_partition"].apply(P, Site((), (1,)), {"axis": "q"})
    k = lower(P, {"q": 40, "d": 16, "g_q": 16}, backend="triton", interpret=True)
    x, y = (np.random.default_rng(i).standard_normal((40, 16)).astype(np.float32)
            for i in (1, 2))
    np.testing.assert_array_equal(np.asarray(k(x, y)), np.minimum(x, y))
    _, (reader, shapes) = k.parts([(40, 16), (40, 16)])
    assert "other=False" in reader.source(*shapes)
    assert "__gpu$xla.gpu.triton" in export_cuda(reader, shapes)
