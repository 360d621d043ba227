"""The device level (napkin.devices): strategies priced from the single-device search plus
the links, chosen, and run on JAX's SPMD engine over CPU host devices — each against the
float64 reference, its communication counted from the program against the model's."""
import os
import subprocess
import sys

import pytest

import napkin as nk
from napkin.devices import Strategy, distribute
from napkin.hardware import get_hardware


def test_the_profiles_state_the_device_level_and_toml_keeps_it(tmp_path):
    h200 = get_hardware("h200")
    assert (h200.devices, h200.link_bytes_per_s, h200.hbm_bytes) == (8, 450e9, 141 * 10 ** 9)
    path = tmp_path / "tpu.toml"
    path.write_text(h200.to_toml().replace("devices = 8", "devices = 16"))
    assert get_hardware(str(path)).devices == 16
    bad = tmp_path / "bad.toml"
    bad.write_text(h200.to_toml().replace("devices = 8", "devices = -2"))
    with pytest.raises(nk.NapkinError, match="devices"):
        get_hardware(str(bad))


def test_a_million_tokens_on_eight_h200s_ring_their_keys():
    """Sequence-parallel inputs (Q cut along q, K and V along x): the ring hides its
    transfers behind the folds and beats sharding the queries, which gathers K and V
    first; every strategy is explained."""
    d = distribute("attention", "h200", {"q": 2 ** 20, "x": 2 ** 20, "d": 128}, "bf16", 8,
                   arrive=("q", "x"))
    best = d.best
    assert best.strategy == Strategy("ring", 8, shard="q", stream="x")
    shard = next(p for p in d.priced if p.strategy == Strategy("shard", 8, shard="q"))
    assert best.time_s < shard.time_s and shard.arrival_bytes > 0
    one = next(p for p in d.priced if p.strategy.kind == "one")
    assert one.time_s / best.time_s > 7  # about the device count
    # the ring's link: 7 transfers of K's and V's 1/8, hidden behind the folds
    assert best.link_bytes == 7 * 2 * (2 ** 20 // 8) * 128 * 2
    assert best.bound in ("compute", "HBM") and best.link_s < best.compute_s
    text = d.explain()
    assert "ring over 8 devices" in text and "gathered first" in text


def test_a_causal_ring_in_zigzag_order_halves_the_steps():
    """Cut contiguously, a causal ring's last device keeps every key of every chunk, so each
    step is a whole fold; in zigzag order (2n chunks, device i holding i and 2n − 1 − i)
    every device keeps two of its four block pairs a step (three at the first, the
    diagonals): (n/2 + 1/4) folds of the contiguous ring's n, chosen and explained.  An
    algorithm without masks between the cut axes is offered no zigzag."""
    from napkin.devices.plan import ring_work
    sizes = {"q": 2 ** 20, "x": 2 ** 20, "d": 128}
    d = distribute("causal_attention", "h200", sizes, "bf16", 8, arrive=("q", "x"))
    zigzag = Strategy("ring", 8, shard="q", stream="x", zigzag=True)
    plain = next(p for p in d.priced if p.strategy == Strategy("ring", 8, shard="q",
                                                                stream="x"))
    assert d.best.strategy == zigzag and "zigzag order" in d.explain()
    assert ring_work(zigzag, d.algorithm, sizes) == [3] + [2] * 7
    assert ring_work(plain.strategy, d.algorithm, sizes) == [1] * 8
    assert abs(d.best.time_s / plain.time_s - (8 / 2 + 1 / 4) / 8) < 0.02
    assert d.best.link_bytes == plain.link_bytes  # both pieces of K and V passed on
    # a window narrower than a chunk keeps only the diagonal blocks (and the block before
    # each): contiguous, steps 2-7 fold nothing; zigzag's far pieces meet again at step 7,
    # but its pieces are quarter blocks: 5 quarters against 2 wholes, the link bounding both
    w = distribute("sliding_window_attention", "h200", sizes, "bf16", 8,
                   strategy=[zigzag, plain.strategy])
    assert ring_work(plain.strategy, w.algorithm, sizes) == [1, 1] + [0] * 6
    assert ring_work(zigzag, w.algorithm, sizes) == [3, 1] + [0] * 5 + [1]
    a, b = w.priced
    assert a.time_s <= b.time_s and a.compute_s < b.compute_s
    from napkin.devices.plan import candidates
    from napkin.frontend.library import get
    full = candidates(get("attention").diagram(), nk.optimize("attention", "h200", sizes,
                                                              "bf16"), sizes, 8)
    assert any(s.kind == "ring" for s in full) and not any(s.zigzag for s in full)
    # pieces small enough that the search keeps the keys in one tile (256 × 256): the ring
    # folds the fastest streamed program the search reached instead
    from napkin.devices.strategy import mergeable_stream
    small = distribute("causal_attention", "h200", {"q": 4096, "x": 4096, "d": 128}, "f32", 8,
                       strategy=[zigzag])
    assert small.best.applies and small.best.local.sizes["x"] == 256
    assert mergeable_stream(small.best.local.program)[0] is not None
    from napkin.frontend.bases import with_bases
    own = nk.optimize(with_bases(get("causal_attention").diagram(), ("q", "x")), "h200",
                      small.best.local.sizes, "f32")  # the search's own best: not a stream
    assert mergeable_stream(own.program)[0] is None
    with pytest.raises(nk.NapkinError, match="does not divide over 8 chunks"):
        d.choose(Strategy("ring", 4, shard="q", stream="x", zigzag=True)).fit(
            {"q": 36, "x": 40, "d": 16}).kernel("triton", interpret=True)


def test_a_two_dimensional_mesh_cuts_heads_over_one_axis_and_rings_over_the_other():
    """GQA on 8 H200s: its KV heads cut over 4 devices, the ring over the other 2 within each
    head block passes a quarter of K and V the 8-device ring passes: chosen, explained, and
    its certificate decomposes over both mesh axes (the heads' group partition, then the
    ring's), replayed by the checker."""
    from napkin.certify.checker import check_certificate
    from napkin.devices.plan import candidates
    from napkin.frontend.library import get
    sizes = {"k": 8, "r": 4, "q": 2 ** 17, "x": 2 ** 17, "d": 128}
    two = Strategy("ring", 2, shard="q", stream="x", outer=(("k", 4),))
    whole = nk.optimize("gqa", "h200", sizes, "bf16")
    offered = candidates(get("gqa").diagram(), whole, sizes, 8)
    assert two in offered and Strategy("gather", 4, stream="x", outer=(("k", 2),)) in offered
    d = distribute("gqa", "h200", sizes, "bf16", 8, arrive=("q", "x"), strategy=[
        two, Strategy("ring", 2, shard="q", stream="x", outer=(("r", 4),)),
        Strategy("ring", 8, shard="q", stream="x"), Strategy("shard", 8, shard="k")])
    assert d.best.strategy == two and two.total == 8 and two.mesh == (4, 2)
    assert [p.strategy for p in distribute("gqa", "h200", sizes, "bf16", 8, mesh=(4, 2),
                                           strategy=[two, Strategy("ring", 8, shard="q",
                                                                   stream="x")]).priced] == [two]
    with pytest.raises(nk.NapkinError, match=r"no strategy on a 2 × 2 × 2 mesh \(the meshes "
                                             r"priced on 8 devices: 8, 4 × 2\)"):
        distribute("gqa", "h200", sizes, "bf16", 8, mesh=(2, 2, 2), strategy=[
            two, Strategy("ring", 8, shard="q", stream="x")])
    assert "ring over 2 devices: q cut, x passed round; × k cut over 4 (a 4 × 2 mesh)" \
        in d.explain()
    flat = next(p for p in d.priced if p.strategy == Strategy("ring", 8, shard="q",
                                                               stream="x"))
    assert d.best.link_bytes * 7 == flat.link_bytes  # 1 step of K/8 against 7 of K/8
    assert d.best.local.sizes == {**sizes, "k": 2, "q": 2 ** 16, "x": 2 ** 16}
    (_, decomposition), _ = d.certificates()
    steps = [(s.rule, s.params["axis"], s.site.path) for s in decomposition.steps]
    assert steps[-3:] == [("group_partition", "k", ()), ("group_partition", "q", (0,)),
                          ("stream_partition", "x", (0, 0))]
    assert check_certificate(decomposition.to_dict()).ok


def test_a_cut_along_an_axis_positions_are_read_along_hands_each_device_its_base():
    """A causal mask compares global positions, cross-entropy's take finds the label's
    global position: cut over devices, the per-device program takes each cut axis's base
    (napkin.frontend.bases) — and means the global algorithm's block, entry for entry."""
    import jax
    import numpy as np
    from napkin.frontend.bases import with_bases
    from napkin.frontend.library import get
    d = distribute("causal_attention", "h200", {"q": 4096, "x": 4096, "d": 128}, "bf16", 4,
                   strategy=[Strategy("shard", 4, shard="q"),
                             Strategy("ring", 4, shard="q", stream="x")])
    assert {p.strategy.kind: p.bases for p in d.priced} == {"shard": ("q",), "ring": ("q", "x")}
    assert [ob.name for ob in d.best.local.algorithm.dom.inside][3:] in (["q_base"],
                                                                        ["q_base", "x_base"])
    rng = np.random.default_rng(2)
    for name, axes, cut in (("causal_attention", ("q", "x"), {"q": (4, 8), "x": (8, 16)}),
                            ("sliding_window_attention", ("q", "x"), {"q": (6, 12), "x": (0, 8)}),
                            ("cross_entropy", ("v",), {"v": (8, 16)})):
        alg = get(name)
        sizes = {"q": 12, "x": 16, "d": 4} if "attention" in name else {"n": 5, "v": 16}
        xs = [np.asarray(a) for a in alg.sample(rng, sizes)]
        D = alg.diagram()
        block = [x[tuple(slice(*cut[a]) if a in cut else slice(None) for a in ob.type.names)]
                 for x, ob in zip(xs, D.dom.inside)]
        with jax.enable_x64(True):
            full = np.asarray(nk.evaluate(D)(*xs))
            got = np.asarray(nk.evaluate(with_bases(D, axes))(
                *block, *(np.int32(cut.get(a, (0,))[0]) for a in axes)))
        if name == "cross_entropy":  # on the label's shard its logit, elsewhere none: 0
            L, label = xs
            mine = (label >= 8) & (label < 16)
            lse = np.log(np.exp(L[:, 8:16]).sum(-1))
            np.testing.assert_allclose(got, lse - np.where(mine, L[np.arange(5), label], 0),
                                       rtol=1e-10)
            continue
        lo, hi = cut["q"]
        keys = slice(*cut["x"])
        # the block's meaning at the global positions, written out in numpy: a row that
        # keeps no key of the block is zeros (napkin's softmax on a fully masked row)
        mask_q = np.arange(lo, hi)[:, None]
        mask_k = np.arange(*cut["x"])[None, :]
        keep = mask_k <= mask_q
        if name == "sliding_window_attention":
            keep &= mask_k > mask_q - 4
        s = xs[0][lo:hi] @ xs[1][keys].T / np.sqrt(4)
        s = np.where(keep, s, -np.inf)
        m = np.max(s, -1, keepdims=True)
        p = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
        z = p.sum(-1, keepdims=True)
        want = np.where(z > 0, p @ xs[2][keys] / np.where(z > 0, z, 1), 0)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        assert full.shape == (12, 4)


_HEAD = """
import json
import jax, jax.numpy as jnp, numpy as np
import napkin as nk
from napkin.devices import Strategy, distribute
from napkin.devices.spmd import communication
from napkin.frontend.library import get
rng = np.random.default_rng(1)
out = {}
"""

_FORWARD = _HEAD + """
import sys
cases = [("attention", {"q": 4096, "x": 4096, "d": 128}, {"q": 40, "x": 96, "d": 16},
          [Strategy("shard", 4, shard="q"), Strategy("gather", 4, stream="x"),
           Strategy("ring", 4, shard="q", stream="x"), Strategy("ring", 8, shard="q",
           stream="x")]),
         ("gqa", {"k": 8, "r": 4, "q": 4096, "x": 4096, "d": 128},
          {"k": 4, "r": 3, "q": 24, "x": 40, "d": 16},
          [Strategy("shard", 4, shard="k"),  # and 2-D meshes: KV heads × a ring or gather
           Strategy("ring", 2, shard="q", stream="x", outer=(("k", 4),)),
           Strategy("gather", 4, stream="x", outer=(("k", 2),))]),
         # positions read along a cut axis: each device handed its base
         ("causal_attention", {"q": 4096, "x": 4096, "d": 128}, {"q": 40, "x": 48, "d": 16},
          [Strategy("shard", 4, shard="q"), Strategy("ring", 4, shard="q", stream="x"),
           Strategy("ring", 4, shard="q", stream="x", zigzag=True)]),
         ("sliding_window_attention", {"q": 4096, "x": 4096, "d": 128},
          {"q": 40, "x": 40, "d": 16}, [Strategy("ring", 4, shard="q", stream="x"),
                                        Strategy("ring", 4, shard="q", stream="x",
                                                 zigzag=True)]),
         ("cross_entropy", {"n": 4096, "v": 32768}, {"n": 8, "v": 64},
          [Strategy("gather", 4, stream="v")])]
half = int(sys.argv[1])  # the cases without (0) and with (1) positions read along a cut
for name, big, small, strategies in cases[:2] if half == 0 else cases[2:]:
    alg = get(name)
    xs = [np.asarray(a, np.float32) if np.asarray(a).dtype.kind == "f" else np.asarray(a)
          for a in alg.sample(rng, small)]
    with jax.enable_x64(True):
        want = np.asarray(alg.reference(*(np.float64(a) if a.dtype.kind == "f" else a
                                          for a in xs)))
    priced = distribute(name, "h200", big, "f32", 8, strategy=strategies)
    for s in strategies:
        d = priced.choose(s).fit(small)
        k = d.kernel("triton", interpret=True)
        got = np.asarray(k(*xs))
        sent = communication(k, *xs)
        out[f"{name} {s}"] = [float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
                              sum(sent.values()), d.best.link_bytes]
print(json.dumps(out))
"""

_GRAD = _HEAD + """
loss = lambda f: lambda *a: jnp.sum(jnp.tanh(f(*a)))
import sys
cases = [("attention", Strategy("shard", 4, shard="q"), "grad"),
         ("causal_attention", Strategy("ring", 4, shard="q", stream="x", zigzag=True),
          "ring grad"),
         ("gqa", Strategy("ring", 2, shard="q", stream="x", outer=(("k", 4),)), "2-D grad")]
for name, strategy, key in [cases[int(i)] for i in sys.argv[1].split(",")]:
    alg = get(name)
    heads = name == "gqa"
    small = {"q": 40, "x": 96, "d": 16, **({"k": 4, "r": 2} if heads else {})}
    big = {"q": 4096, "x": 4096, "d": 128, **({"k": 8, "r": 4} if heads else {})}
    xs = [np.asarray(a, np.float32) for a in alg.sample(rng, small)]
    with jax.enable_x64(True):
        want = jax.grad(loss(alg.reference), (0, 1, 2))(*(np.float64(a) for a in xs))
    priced = distribute(name, "h200", big, "f32", 8, strategy=[strategy])
    k = priced.choose(strategy).fit(small).kernel("triton", interpret=True)
    got = jax.grad(loss(k), (0, 1, 2))(*xs)
    out[key] = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))) /
                         np.max(np.abs(np.asarray(w)))) for g, w in zip(got, want))
print(json.dumps(out))
"""


def _on_eight_devices(script, *args) -> dict:
    import json
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("half", ["0", "1"], ids=["plain", "positions read along a cut"])
def test_strategies_run_on_eight_cpu_devices_as_the_model_says(half):
    """Each strategy at ragged per-device sizes (q = 40 on 4 devices: 10 queries each)
    equals the float64 reference — causal and window masks and cross-entropy's label take
    with each device's base — and what it sends between devices, counted from its program's
    collectives, is the model's link bytes exactly."""
    out = _on_eight_devices(_FORWARD, half)
    for case, (err, counted, modelled) in out.items():
        assert err <= 1e-5, (case, err)
        assert counted == modelled, (case, counted, modelled)
    if half == "0":
        assert out["attention ring over 8 devices: q cut, x passed round"][1] == \
            7 * 2 * (96 // 8) * 16 * 4  # 7 steps pass K's and V's 12 keys on
        # 3 others' (μ, z, o) states, for each part of a device's keys (split-K inside it:
        # 64 query tiles leave half the SMs idle at the searched size)
        gathered = out["attention gather over 4 devices: x cut, partial states merged"][1]
        assert gathered and gathered % (3 * 40 * (16 + 2) * 4) == 0
        assert out["gqa ring over 2 devices: q cut, x passed round; × k cut over 4 (a 4 × 2 "
                   "mesh)"][1] == 1 * 2 * (4 // 4) * (40 // 2) * 16 * 4  # K's, V's share, once
    else:
        assert len(out) == 6 and "cross_entropy gather over 4 devices: v cut, partial states " \
            "merged" in out
        assert sum("zigzag" in case for case in out) == 2


_OUTPUT_ORDER = _HEAD + """
from napkin.frontend import ops
q, x, d = nk.axes("q x d")

def attention_and_lse(Q, K, V):  # L made first, returned second: the stream writes (L, O)
    S = ops.contract(Q, K, out=(q, x), name="QK")
    L = ops.logsumexp(S, x, as_="L")
    return ops.contract(ops.softmax(S, x), V, out=(q, d), name="O"), L
D = nk.trace(attention_and_lse, {"Q": (q, d), "K": (x, d), "V": (x, d)}, "attention and L")
xs = [rng.standard_normal(sh).astype(np.float32) for sh in ((40, 16), (96, 16), (96, 16))]
s64 = np.float64(xs[0]) @ np.float64(xs[1]).T
lse = np.log(np.exp(s64 - s64.max(1, keepdims=True)).sum(1)) + s64.max(1)
want = [np.exp(s64 - lse[:, None]) @ np.float64(xs[2]), lse]
for s in (Strategy("ring", 4, shard="q", stream="x"), Strategy("gather", 4, stream="x")):
    k = distribute(D, "h200", {"q": 4096, "x": 4096, "d": 128}, "f32", 8, strategy=s).choose(
        s).fit({"q": 40, "x": 96, "d": 16}).kernel("triton", interpret=True)
    out[str(s)] = [float(np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w)))
                   for g, w in zip(k(*xs), want)]
print(json.dumps(out))
"""


def test_outputs_come_back_in_the_algorithms_order_whatever_the_streams():
    """A ring's or a gather's outputs are its merged stream's, finalised: that stream writes
    them in its own order (L before O here), and they come back in the algorithm's — they
    used to be handed to shard_map in the stream's, a deep JAX error on their ranks."""
    out = _on_eight_devices(_OUTPUT_ORDER)
    assert len(out) == 2 and all(max(errs) <= 1e-5 for errs in out.values()), out


@pytest.mark.parametrize("cases", ["0,1", "2"], ids=["a shard, a zigzag ring", "a 2-D mesh"])
def test_gradients_go_through_a_shard_and_a_ring(cases):
    """A shard's kernel has napkin's derived backward on each device; a ring's (causal, in
    zigzag order; GQA's on a 4 × 2 mesh) runs the forward that saves L, then the backward
    programs, each distributed in turn."""
    out = _on_eight_devices(_GRAD, cases)
    assert len(out) == len(cases.split(",")) and all(v <= 1e-4 for v in out.values()), out


def test_a_rings_certificates_replay_and_a_tampered_one_is_rejected():
    """The decomposition over the devices (the group partition of the queries, one share a
    device, and the stream partition of the keys, one chunk a device: proved rules, the
    shares as tiles) and each device's program (derived on its block, the bases as
    inputs: {"bases": "causal_attention", "axes": ["q", "x"]}) both replay in the
    independent checker; a decomposition whose chunk was edited is rejected."""
    from napkin.certify.checker import check_certificate
    d = distribute("causal_attention", "h200", {"q": 4096, "x": 4096, "d": 128}, "bf16", 4,
                   strategy=Strategy("ring", 4, shard="q", stream="x"))
    (what, decomposition), (_, local) = d.certificates()
    assert [s.rule for s in decomposition.steps] == ["group_partition", "stream_partition"]
    assert decomposition.steps[0].params["level"] == "gmem"
    assert local.to_dict()["algorithm"] == {"bases": "causal_attention", "axes": ["q", "x"]}
    for cert in (decomposition, local):
        report = check_certificate(cert.to_dict())
        assert report.ok, report
    bad = decomposition.to_dict()
    bad["steps"][1]["params"]["axis"] = "d"
    assert not check_certificate(bad).ok
    # in zigzag order: the same rules at the pieces' tiles (two per device; the groups'
    # assignment and the chunks' order are the rules' business: independent groups, a merge
    # proved in either order)
    z = distribute("causal_attention", "h200", {"q": 4096, "x": 4096, "d": 128}, "bf16", 4,
                   strategy=Strategy("ring", 4, shard="q", stream="x", zigzag=True))
    assert z.best.local.sizes["q"] == 512  # the per-device program is a piece's
    (_, decomposition), (_, local) = z.certificates()
    assert [s.rule for s in decomposition.steps] == ["group_partition", "stream_partition"]
    assert all(check_certificate(c.to_dict()).ok for c in (decomposition, local))


def test_the_command_line_prices_devices_and_writes_the_plans_certificates(tmp_path, capsys):
    """`napkin optimize ALGO --devices N --certificate PATH`: the plan explained, and beside
    PATH the decomposition's and each device's certificates, which `napkin check` verifies;
    a path that cannot be written stops it before any search, with one line."""
    from napkin import cli
    cert = tmp_path / "c.json"
    rc = cli.main(["optimize", "causal_attention", "--size", "q=1024", "--size", "x=1024",
                   "--size", "d=64", "--hardware", "h200", "--devices", "2",
                   "--certificate", str(cert)])
    out = capsys.readouterr().out
    assert rc == 0 and "causal_attention on 2 × H200" in out and "one device:" in out
    written = [tmp_path / "c.decomposition.json", tmp_path / "c.device.json"]
    assert all(p.exists() for p in written) and "certificate of each device's program" in out
    assert cli.main(["check", *map(str, written)]) == 0
    assert "2 certificates verified" in capsys.readouterr().out
    for argv, words in [(["--mesh", "4x2"], "--mesh shapes the plan over devices: give "
                                            "--devices N too"),
                        (["--devices", "8", "--mesh", "3x3"], "--mesh 3x3: a shape such as "
                                                              "4x2 whose devices multiply to "
                                                              "--devices 8")]:
        assert cli.main(["optimize", "gqa", *argv]) == 2  # before any search
        assert capsys.readouterr().err.strip() == f"napkin: error: {words}"
    (tmp_path / "blocker").write_text("a file where a folder is asked for")
    rc = cli.main(["optimize", "attention", "--devices", "2", "--certificate",
                   str(tmp_path / "blocker" / "c.json")])
    err = capsys.readouterr().err
    assert rc != 0 and err.strip().splitlines() == [
        f"napkin: error: --certificate '{tmp_path / 'blocker' / 'c.json'}': "
        f"'{tmp_path / 'blocker'}' is a file, not a directory"]
