"""Split-K (issue 27): a stream whose accumulator has a merge folds its parts in parallel, one
partial state per part, and a second kernel merges them in order.  The search tries it where
a kernel leaves the SMs idle (decoding), the model prices the blocks it adds against the
partial states' round trip through HBM, and the Triton kernel matches float64 at ragged
sizes, with parts whose every key is masked."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin
from napkin.frontend.library import LIBRARY
from shared_checks import grads_match_float64

DECODE = {"q": 16, "x": 131072, "d": 128}


def _split(opt):  # (a chain may end by naming each kernel's tiles its own: untie_tiles)
    return [m.rule for m in opt.chain if m.rule != "untie_tiles"][-1] == "split_stream"


def test_decoding_splits_the_keys_and_prefill_does_not():
    opt = napkin.optimize("attention", "h200", DECODE)
    assert _split(opt)
    seq = opt.sequential
    assert seq is not None and not _split(seq)
    (first, merge) = opt.search.best.tiles.launch
    # the merge is a kernel of its own, on query tiles of its own (g_q_2: untie_tiles)
    assert first["blocks"] >= 64 and merge["blocks"] == -(-DECODE["q"] // opt.tiles["g_q_2"])
    # one block streamed 131072 keys; the parts fill the chip: the model's time falls by
    # more than an order of magnitude (partial states through HBM and a second launch paid)
    assert seq.search.best.time_s / opt.search.best.time_s > 20
    # prefill with heads fills the chip already; single-head prefill is left unsplit
    assert not _split(napkin.optimize("mha", "h200", {"h": 16, "q": 4096, "x": 4096, "d": 128}))
    assert not _split(napkin.optimize("attention", "h200", {"q": 4096, "x": 4096, "d": 128}))


@pytest.mark.parametrize("name", ["attention", "causal_attention"])
@pytest.mark.parametrize("dtype, tol", [("f32", 1e-5), ("bf16", 2e-2)])
def test_the_split_kernel_matches_float64_at_ragged_sizes(name, dtype, tol):
    """q = 20, x = 203: ragged query tiles, parts and chunks; causal: the later parts of
    every query tile hold no key it sees (their partial state is the empty one)."""
    opt = napkin.optimize(name, "h200", DECODE, max_states=400)
    assert _split(opt)
    small = opt.fit({"q": 20, "x": 203, "d": 16})
    assert small.tiles["p_x"] < 203 and small.tiles["p_x"] % small.tiles["s_x"] == 0
    alg = LIBRARY[name]
    rng = np.random.default_rng(5)
    xs = [jnp.asarray(x, jnp.float32) for x in alg.sample(rng, small.sizes)]
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    got = small.kernel("triton", interpret=True, dtype=dtype)(*[x.astype(jdt) for x in xs])
    with jax.enable_x64(True):
        want = np.asarray(alg.reference(*[x.astype(jnp.float64) for x in xs]))
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err <= tol, err
    assert small.check().ok


def test_gradients_through_a_split_forward():
    opt = napkin.optimize("attention", "h200", DECODE, max_states=400)
    grads_match_float64(opt.fit({"q": 20, "x": 203, "d": 16}), LIBRARY["attention"], 6, 1e-4)


def test_the_command_line_prints_the_split(capsys):
    from napkin import cli
    rc = cli.main(["optimize", "attention", "--hardware", "h200", "--size", "q=16",
                   "--size", "x=131072"])
    out = capsys.readouterr().out
    assert rc == 0 and "split_stream(axis=x)" in out


def test_a_split_inside_nested_groups_is_checked_and_runs():
    """group h [group q [stream x]]: the split reaches the stream through both groups and
    wraps the parts and the merge in the same two."""
    from napkin.certify.certificate import derive
    from napkin.certify.checker import check_certificate
    from napkin.core.region import Site
    from napkin.lower import lower
    steps = [("group_partition", (), {"axis": "h"}),
             ("group_partition", (0,), {"axis": "q"}),
             ("stream_partition", (0, 0), {"axis": "x"}),
             ("split_stream", Site((), (0,)), {"axis": "x"})]
    sizes, tiles = {"h": 3, "q": 5, "x": 37, "d": 4}, {"g_h": 2, "g_q": 4, "s_x": 4, "p_x": 8}
    cert = derive("mha", steps, sizes, tiles)
    assert check_certificate(cert).ok
    from napkin.certify.certificate import load_algorithm
    from rewrites import get_rule
    from napkin.certify.certificate import _site
    program = load_algorithm("mha").build("f32")
    for rule, site, params in steps:
        program = get_rule(rule).apply(program, _site(program, site, rule), params)
    alg = LIBRARY["mha"]
    xs = [jnp.asarray(x, jnp.float32) for x in alg.sample(np.random.default_rng(7),
                                                          {"h": 3, "q": 20, "x": 203, "d": 16})]
    k = lower(program, {"g_h": 1, "g_q": 16, "s_x": 16, "p_x": 64}, backend="triton",
              interpret=True, dtype="f32")
    with jax.enable_x64(True):
        want = np.asarray(alg.reference(*[x.astype(jnp.float64) for x in xs]))
    got = np.asarray(k(*xs), np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_multiply_and_sum_contraction_holds_its_product_in_registers():
    # GQA decoding at q = 1: four grouped heads against a chunk of keys is below the smallest
    # dot, so the kernel writes it as a broadcast product and a sum; the product's values are
    # registers the launch model must count (before, it counted none and chose 128-key
    # chunks that ptxas spilled 48,892 bytes of)
    opt = napkin.optimize("gqa", "h200", {"q": 1, "x": 65536}, "bf16")
    s_x, d, r = opt.tiles["s_x"], opt.sizes["d"], opt.sizes["r"]
    parts = opt.search.best.tiles.launch[0]
    threads = 32 * parts["num_warps"]
    assert parts["registers_per_thread"] >= r * s_x * d / threads
    assert parts["registers_per_thread"] <= 255 and s_x <= 32
