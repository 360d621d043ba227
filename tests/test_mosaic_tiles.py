"""Mosaic GPU's tiles of its own (issue 28): the launch model prices a warp-specialised block
(a producer warpgroup, consumers sharing the register file through setmaxnreg, K in
multiples of the 128-B swizzle, TMA boxes of at most 256), each backend writes a program at
the tiles its own model ranks best among those its writer takes, and ``auto`` on a Hopper
GPU compares the two backends' modelled times."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import napkin
from napkin.core.errors import NapkinError
from napkin.cost.grid import Grid
from napkin.cost.launch import consumer_registers, register_budget
from napkin.cost.model import cost
from napkin.hardware import A100_SXM, H100_SXM, HardwareError, load_toml
from napkin.lower import tiles as backend_tiles
from napkin.lower.backends import mosaic_gpu as mg
from napkin.lower.kernel import export_cuda
from napkin.lower.mosaic_module import ModuleFacts, mosaic_module

_FOUND: dict = {}


def searched(d: int):
    """Multi-head attention at the library's sizes, head dimension ``d`` (bf16, H100)."""
    if d not in _FOUND:
        _FOUND[d] = napkin.optimize("mha", hardware="h100", sizes={"d": d}, dtype="bf16")
    return _FOUND[d]


def named(tiles) -> dict:
    return {str(t): v for t, v in tiles.items()}


def test_the_mosaic_profile_is_a_warp_specialised_block(tmp_path):
    hw = mg.profile(H100_SXM)
    assert (hw.producer_warps, hw.producer_registers, hw.tile_max) == (4, 40, 256)
    assert hw.warps_per_block == (4, 8, 12)  # 1 to 3 consumer warpgroups
    # setmaxnreg's split is the writer's (the same formula): 256, 232, 152
    assert [int(consumer_registers(hw, w)) for w in (1, 2, 3)] == \
        [mg.consumer_registers(w) for w in (1, 2, 3)] == [256, 232, 152]
    budget = register_budget(hw, np.array([4.0, 8.0, 12.0]))
    assert budget[0] == mg.REGISTER_BUDGET and budget[0] > budget[1] > budget[2]
    # a contraction's K in multiples of the 128-B swizzle: 64 bf16 values
    assert max(lv.multiple("mma_k_bytes") for lv in hw.levels) == 128
    assert max(lv.multiple("mma_k_bytes") for lv in H100_SXM.levels) == 32
    assert mg.profile(hw.two_level()).register_budget == mg.REGISTER_BUDGET
    path = tmp_path / "mosaic.toml"
    path.write_text(hw.to_toml())
    assert load_toml(path) == hw
    with pytest.raises(HardwareError, match="producer_warps must be an integer >= 0"):
        dataclasses.replace(A100_SXM, producer_warps=-4)
    with pytest.raises(HardwareError, match="producer_registers must be 24 to 256"):
        dataclasses.replace(hw, producer_registers=600)


def test_the_launch_model_ranks_mosaic_tiles_bigger_chunks_first_where_they_fit():
    """At d = 128 the Mosaic model's best is FA3's configuration (two consumers of 64 rows,
    128-key chunks); 256-key chunks spill past what setmaxnreg leaves two consumers, and of
    the points that tie on time the fewer, larger steps rank first."""
    r = searched(128)
    hw = mg.profile(r.hardware)
    grid = Grid(cost(r.program, hw, r.dtype), r.sizes)
    order, feasible = grid.ranked()
    assert feasible
    ranked = [grid.values(int(i)) for i in order]
    best = ranked[0]
    assert (best["g_q"], best["s_x"]) == (128, 128)
    (launch,) = grid.launches.at(int(order[0]))
    assert launch["num_warps"] == 8 and launch["blocks_per_sm"] == 1  # 2 consumers, 1 block
    at = {(v["g_q"], v["s_x"]): k for k, v in enumerate(ranked) if v["g_h"] == 1}
    assert at[(128, 128)] < at[(128, 64)]  # bigger chunks first
    assert (128, 256) not in at  # spills: not among the points that run clean
    assert all(v["s_x"] % 64 == 0 and v["s_x"] <= 256 and v["g_q"] <= 256 for v in ranked)


@pytest.mark.parametrize("d", [64, 128])
def test_attention_is_written_by_mosaic_at_its_own_tiles(d):
    """The search's tiles are Triton's (at d = 64, 32-key chunks: an N = 32 wgmma whose K
    Mosaic refuses); ``kernel("mosaic")`` writes Mosaic's own, exported here with its shared
    memory exactly as counted."""
    r = searched(d)
    own = r.backend_tiles("mosaic")
    assert not own.refused and own.tiles["s_x"] >= 64 and own.tiles["g_q"] >= 128
    if d == 64:
        assert r.tiles["s_x"] == 32
        with pytest.raises(NapkinError, match="multiple of 64"):
            export_cuda(napkin.lower.lower(r.program, r.tiles, backend="mosaic", dtype="bf16",
                                           schedule=r.schedule),
                        r.input_shapes(), "NVIDIA H100")
    k = r.kernel("mosaic")
    assert named(k.tiles) == {**r.tiles, **own.tiles}
    spec = k.plan(*r.input_shapes())
    assert spec.written.backend == "mosaic" and spec.written.turns
    assert spec.launch["consumer_warpgroups"] == 2
    facts = ModuleFacts.read(mosaic_module(export_cuda(k, r.input_shapes(), "NVIDIA H100")))
    assert facts.shared_memory == sum(spec.written.smem.values()) <= mg.SMEM_LIMIT
    assert facts.wgmma > 0


def test_the_writer_gates_the_models_ranking(monkeypatch):
    """Where the writer refuses the model's best, the next ranked point it takes is written;
    where it refuses every point tried, the backend is said to refuse, with the first reason,
    and the kernel is written at the search's tiles (where the refusal is raised)."""
    r = searched(128)
    asked = []

    def refuse_first(program, tiles, *args, plan_only=False):
        if plan_only:  # (the plans' own check: passed)
            return ""
        asked.append(dict(tiles))
        return "refused by the test" if len(asked) == 1 else ""
    monkeypatch.setattr(backend_tiles, "writer_refusal", refuse_first)
    got = backend_tiles.choose(r.program, r.hardware, r.sizes, r.dtype, "mosaic",
                               r.input_shapes())
    assert not got.refused and got.tiles == asked[1] != asked[0]
    monkeypatch.setattr(backend_tiles, "writer_refusal", lambda *a, **k: "no layout for the test")
    got = backend_tiles.choose(r.program, r.hardware, r.sizes, r.dtype, "mosaic",
                               r.input_shapes())
    assert got.refused == "no layout for the test" and "refuses" in got.describe()
    fresh = dataclasses.replace(r)
    assert named(fresh.kernel("mosaic").tiles) == r.tiles


def test_points_the_plans_refuse_cost_no_try(monkeypatch):
    """A point whose plans the backend refuses before writing (rows no warpgroup layout
    takes, a block over a TMA box: logsumexp's best-ranked 16-row blocks) is passed over
    without counting as one of the writer's tries, up to LOOKED_AT points."""
    r = searched(128)
    looked, written = [], []

    def refuse(program, tiles, *args, plan_only=False):
        if plan_only:
            looked.append(dict(tiles))
            return "plans refused by the test" if len(looked) <= 2 else ""
        written.append(dict(tiles))
        return ""
    monkeypatch.setattr(backend_tiles, "writer_refusal", refuse)
    monkeypatch.setattr(backend_tiles, "TRIES", 1)  # one writing: not spent on the first two
    got = backend_tiles.choose(r.program, r.hardware, r.sizes, r.dtype, "mosaic",
                               r.input_shapes())
    assert len(looked) == 3 and written == [looked[2]] == [got.tiles] and not got.refused
    monkeypatch.undo()
    lse = napkin.optimize("logsumexp", hardware="h200", dtype="bf16").backend_tiles("mosaic")
    assert not lse.refused and lse.tiles["g_n"] % 64 == 0


def test_tiles_a_user_sets_are_kept_and_a_small_run_shrinks_mosaics_own():
    r = searched(64)
    mine = r.with_tiles({"g_q": 64})
    assert mine.backend_tiles("mosaic").tiles["g_q"] == 64
    small = r.fit({"h": 2, "q": 256, "x": 256, "d": 64})
    assert small.tiles["s_x"] == 32  # Triton's, shrunk
    own = small.backend_tiles("mosaic").tiles
    assert own["s_x"] == 64 and own["g_q"] == 64  # Mosaic's, shrunk to its multiples
    assert small.kernel("mosaic").plan(*small.input_shapes()).written.backend == "mosaic"


def test_auto_on_hopper_writes_the_backend_its_model_prices_faster(monkeypatch):
    """On a Hopper GPU (simulated) ``auto`` writes Mosaic GPU at Mosaic's tiles where its
    modelled time is no worse than Triton's at the search's, else Triton at those."""
    import jax
    from napkin.lower.backends import auto
    monkeypatch.setattr(auto, "hopper_here", lambda: "")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="gpu"))
    r = dataclasses.replace(searched(64))
    shapes = r.input_shapes()
    with jax.sharding.use_abstract_mesh(mesh):
        k = r.kernel()
        spec = k.plan(*shapes)
    own = r.backend_tiles("mosaic")
    assert spec.written.backend == "mosaic" and named(k.tiles) == {**r.tiles, **own.tiles}
    slower = dataclasses.replace(own, time_s=2 * r.search.best.time_s)
    r = dataclasses.replace(searched(64))
    r.__dict__["_backend_tiles"] = {"mosaic": slower}
    assert r.written_at("auto")[:2] == ("triton", r.tiles)
    with jax.sharding.use_abstract_mesh(mesh):
        k = r.kernel()
        assert named(k.tiles) == r.tiles and k.plan(*shapes).written.backend == "triton"


@pytest.mark.parametrize("case, sms", [("matmul streamed over b", 3), ("causal", 1),
                                       ("mha, 2 consumers of 64 q", 3)])
def test_a_grid_larger_than_the_chip_is_persistent(monkeypatch, case, sms):
    """A kernel of more tiles than the chip has SMs runs one program an SM, looping over its
    tiles in the grid's order (``plgpu.nd_loop``): each tile waits only for its stores' reads
    of shared memory, and the program for their writes once, after its last tile.  With the
    chip made 3 SMs, interpret mode runs matmul, causal attention (tile skipping, O staged in
    Q's buffer; its two tiles on one SM) and two consumers taking turns that way against
    float64; it exports with the
    shared memory of the kernel that is not persistent."""
    from tests.test_mosaic_gpu import CASES, kernel_for
    name, sizes, tiles = CASES[case]
    _, k, shapes = kernel_for(case)
    plain = k.plan(*shapes)
    monkeypatch.setattr(mg, "SMS", sms)
    k = napkin.lower.lower(k.program, {str(t): v for t, v in k.tiles.items()},
                           backend="mosaic", dtype="bf16", schedule=k.schedule)
    spec = k.plan(*shapes)
    assert any(n.startswith(f"persistent: {sms} programs") for n in spec.written.notes)
    src = spec.source
    assert "plgpu.nd_loop(" in src and f"grid=({sms},), grid_names=('sm',)" in src
    assert src.count("wait_smem_to_gmem(0)") == 1  # once, after the last tile
    facts = ModuleFacts.read(mosaic_module(export_cuda(k, shapes, "NVIDIA H100")))
    assert facts.shared_memory == sum(plain.written.smem.values())
    if not mg.interpret_supported():
        return
    from napkin.frontend.library import get
    alg = get(name)
    xs = alg.sample(np.random.default_rng(11), sizes)
    want = np.asarray(alg.reference(*xs), np.float64)
    got = np.asarray(k(*xs, interpret=True), np.float64)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_the_pipeline_is_as_deep_as_a_loads_latency_needs():
    """A warp-specialised block is alone on its SM: its stages are the fewest (2 to 4, as
    many as fit) whose buffers, each held for a load's latency, its transfer and its step,
    keep a step running every step (Little's law: (stages - 1) x step >= latency + load).
    Single-head attention at d = 64 (64 blocks, one wave: bandwidth-bound, a step's load as
    long as the step) takes 4, written and exported with the shared memory counted; the
    multi-head program at d = 128 (more compute a step) takes 3, and the search's tiles at
    d = 64 too; where 4 stages do not fit, what they leave uncovered is paid every step:
    ten times the latency costs time at the same depth."""
    from napkin.cost.optimize import optimize_tiles
    r = napkin.optimize("attention", hardware="h100", sizes={"d": 64}, dtype="bf16")
    hw = mg.profile(r.hardware)
    at = {**r.sizes, "g_q": 64, "s_x": 128}
    fast = optimize_tiles(cost(r.program, hw, r.dtype), hw, at, r.dtype)
    assert fast.launch[0]["num_stages"] == 4
    slow_hw = dataclasses.replace(hw, memory_latency_s=10 * hw.memory_latency_s)
    slow = optimize_tiles(cost(r.program, slow_hw, r.dtype), slow_hw, at, r.dtype)
    assert slow.launch[0]["num_stages"] == 4 and slow.time_s > fast.time_s
    assert searched(128).backend_tiles("mosaic").launch[0]["num_stages"] == 3
    assert r.backend_tiles("mosaic").tiles == {"g_q": 64, "s_x": 128}
    k, shapes = r.kernel("mosaic"), r.input_shapes()
    spec = k.plan(*shapes)
    assert spec.written.launch["num_stages"] == 4
    assert spec.written.smem["staged"] == fast.launch[0]["smem_bytes"]
    facts = ModuleFacts.read(mosaic_module(export_cuda(k, shapes, "NVIDIA H100")))
    assert facts.shared_memory == sum(spec.written.smem.values())


def test_the_matmul_is_persistent_at_hoppers_tile_with_three_stages():
    """The 4096³ bf16 matmul on H200: Mosaic's own tiles are JAX's Hopper matmul's
    128 × 256 × 64, three stages deep (two hide a load's latency and transfer behind too
    short a step), written by two consumers over a persistent grid of one program an SM,
    its shared memory the model's three stages."""
    r = napkin.optimize("matmul", hardware="h200", dtype="bf16")
    own = r.backend_tiles("mosaic")
    assert not own.refused
    assert own.tiles == {"g_a": 128, "g_c": 256, "s_b": 64}
    assert own.launch[0]["num_stages"] == 3
    stage = (128 + 256) * 64 * 2  # one A and one B chunk of bf16
    assert own.launch[0]["smem_bytes"] == 3 * stage
    spec = r.kernel("mosaic").plan(*r.input_shapes())
    assert spec.written.launch["num_stages"] == 3
    assert any(n.startswith("persistent: 132 programs") for n in spec.written.notes)
    assert spec.written.smem["staged"] == 3 * stage


def test_the_launch_model_prices_the_overlap_the_schedule_states():
    """Mosaic's block is alone on its SM: one consumer runs its tensor cores beside the
    softmax only where the schedule says P·V may run a step late (attention's stream does);
    without that statement it waits for its products, then works on them — the tensor
    cores' time plus the rest's.  Two consumers taking turns overlap either way; Triton's
    blocks (several an SM) always do."""
    import dataclasses as dc
    from napkin.cost.launch import Launches
    from napkin.cost.model import compute_times, fold, value_at
    r = napkin.optimize("attention", hardware="h100", sizes={"d": 128}, dtype="bf16")
    hw = mg.profile(r.hardware)
    c = cost(r.program, hw, r.dtype)
    (k,) = c.kernels
    assert k.overlapped  # (the schedule's statement, read off o = E(o) + p·V)

    def priced(kernel, g_q, c=c):
        env = {**r.sizes, "g_q": g_q, "s_x": 128}
        ev = lambda e: np.array([value_at(e, env)], dtype=float)  # noqa: E731
        return Launches._kernel(kernel, c, ev, 1)
    units = {u: value_at(t, {**r.sizes, "g_q": 64, "s_x": 128})
             for u, t in compute_times(fold(k.loop).flops, hw).items()}
    assert units["tensor"] > 0 and max(units["vector"], units["sfu"]) > 0
    late, waiting = priced(k, 64), priced(dc.replace(k, overlapped=False), 64)
    assert late.warps[0] == 4 and waiting.time[0] > late.time[0]  # one consumer
    two, two_waiting = priced(k, 128), priced(dc.replace(k, overlapped=False), 128)
    assert two.warps[0] == 8 and two_waiting.time[0] == two.time[0]  # turns
    tc = cost(r.program, r.hardware, r.dtype)
    (tk,) = tc.kernels
    assert priced(dc.replace(tk, overlapped=False), 64, tc).time[0] == \
        priced(tk, 64, tc).time[0]


def test_napkin_run_writes_mosaic_at_its_own_tiles(capsys):
    """`napkin run --backend mosaic` on multi-head attention at d = 64: the search's (Triton's)
    32-key chunks would be refused; the run shows and writes Mosaic's own (shrunk to the
    small run), in interpret mode, against the reference."""
    from napkin import cli
    rc = cli.main(["run", "mha", "--size", "d=64", "--dtype", "bf16", "--backend", "mosaic"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    tiles = next(line for line in out.splitlines() if line.startswith("tiles: "))
    assert "s_x=64" in tiles and "Mosaic GPU's own tiles" in tiles
    assert "kernel: Mosaic GPU" in out


def test_a_launch_of_ones_own_is_kept_where_the_search_chose_the_tiles():
    """Only a backend that chose its own tiles launches as its model chose with them; at the
    search's tiles the program's ``launch`` (a benchmark's, a user's) is what runs."""
    r = searched(64)
    warps = 4 if r.launch["num_warps"] != 4 else 8
    mine = dataclasses.replace(r, launch={**r.launch, "num_warps": warps})
    assert mine.kernel("triton").launch["num_warps"] == warps
    assert r.kernel("mosaic").launch["num_stages"] == \
        r.backend_tiles("mosaic").launch[0]["num_stages"]


def test_mosaic_takes_any_multiple_of_its_granules_that_divides_the_axis():
    """Mosaic's candidates are every multiple of its granules (no powers of two) that divides
    its axis (it masks no tail): at q = x = 3072, d = 64 its model's best is 192-key chunks,
    which Triton's search cannot take; exported with the shared memory counted, and a
    192-key chunk runs right in interpret mode."""
    r = napkin.optimize("mha", hardware="h100", sizes={"q": 3072, "x": 3072, "d": 64},
                        dtype="bf16")
    own = r.backend_tiles("mosaic")
    assert not own.refused and own.tiles["s_x"] == 192 and 3072 % own.tiles["g_q"] == 0
    assert all(v & (v - 1) == 0 for v in r.tiles.values())  # Triton's: powers of two
    k, shapes = r.kernel("mosaic"), r.input_shapes()
    spec = k.plan(*shapes)
    facts = ModuleFacts.read(mosaic_module(export_cuda(k, shapes, "NVIDIA H100")))
    assert facts.shared_memory == sum(spec.written.smem.values())
    if not mg.interpret_supported():
        return
    from napkin.frontend.library import get
    small = {"h": 1, "q": 128, "x": 384, "d": 64}
    alg = get("mha")
    xs = alg.sample(np.random.default_rng(5), small)
    k = napkin.lower.lower(r.program, {"g_h": 1, "g_q": 128, "s_x": 192}, backend="mosaic",
                           dtype="bf16", schedule=r.schedule)
    want = np.asarray(alg.reference(*xs), np.float64)
    got = np.asarray(k(*xs, interpret=True), np.float64)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_mosaics_own_tiles_survive_auto_a_smaller_run_a_split_and_a_launch_of_ones_own(
        monkeypatch):
    """On a (simulated) Hopper GPU ``auto`` writes Mosaic's 192-key chunks (no Triton block:
    Mosaic's own backend, not auto's power-of-two rules); a smaller run whose axis 192 no
    longer divides chooses again; with every tile set, a launch of one's own is kept."""
    import jax
    from napkin.lower.backends import auto
    r = napkin.optimize("mha", hardware="h100", sizes={"q": 3072, "x": 3072, "d": 64},
                        dtype="bf16")
    small = r.fit({"h": 2, "q": 2048, "x": 2048, "d": 64})
    own = small.backend_tiles("mosaic").tiles
    assert not small.backend_tiles("mosaic").refused and 2048 % own["s_x"] == 0
    assert small.kernel("mosaic").plan(*small.input_shapes()).written.backend == "mosaic"
    mine = dataclasses.replace(r, launch={**r.launch, "num_stages": 3}).with_tiles(
        r.backend_tiles("mosaic").tiles)
    assert mine.kernel("mosaic").launch["num_stages"] == 3
    monkeypatch.setattr(auto, "hopper_here", lambda: "")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        k = dataclasses.replace(r).kernel()
        spec = k.plan(*r.input_shapes())
    assert spec.written.backend == "mosaic" and named(k.tiles)["s_x"] == 192


def test_a_small_runs_split_k_program_runs_its_sequential_one_at_mosaics_own_tiles():
    """Mosaic writes no split stream: a decoding program (split-K) runs the program before
    the split, whose own tiles — fitted to a small run — are its, not the split's (which
    Mosaic refuses: 16 query rows)."""
    r = napkin.optimize("attention", hardware="h200", sizes={"q": 16, "x": 131072, "d": 128},
                        dtype="bf16")
    seq = r.fit({"q": 64, "x": 4096, "d": 128}).sequential
    assert seq is not None and not seq.backend_tiles("mosaic").refused
    assert seq.kernel("mosaic").plan(*seq.input_shapes()).written.backend == "mosaic"
