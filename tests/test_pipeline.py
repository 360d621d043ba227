"""The pipeline end to end through the CLI: optimise → certificate → check →
lower → run; plus the kernel's HBM traffic against the cost model."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from napkin.cli import main
from napkin.cost import cost
from napkin.hardware import get_hardware
from napkin.frontend.library import get
from napkin.lower import hbm_bytes, lower
from napkin.search import search

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_rules_lists_every_rule(capsys):
    from rewrites import RULES, STREAMABILITY
    status, out, _ = run(capsys, "rules")
    assert status == 0
    for r in [*RULES.values(), *STREAMABILITY]:
        assert r.name in out and r.proof in out


def test_optimize_writes_a_certificate_that_checks(capsys, tmp_path):
    cert = tmp_path / "fa.json"
    status, out, _ = run(capsys, "optimize", "attention", "--hardware", "h100", "--json",
                         "--certificate", str(cert))
    assert status == 0
    data = json.loads(out)
    assert [s["rule"] for s in data["chain"]] == ["group_partition", "stream_partition"]
    assert {"tiles", "cost", "alternatives", "search"} <= set(data)
    # the launch the cost model chose with the tiles, in the JSON and in the certificate
    (model,) = data["kernels"]
    assert data["launch"] == {k: model[k] for k in ("num_warps", "num_stages")}
    assert json.loads(cert.read_text())["launch"] == data["launch"]
    assert data["search"]["states"] > 0 and data["search"]["seconds"] > 0
    assert 0 <= data["search"]["first_fit_s"] <= data["search"]["best_found_s"] <= data["search"]["seconds"]
    status, out, _ = run(capsys, "check", str(cert))
    assert status == 0 and "1 certificates verified" in out
    bad = json.loads(cert.read_text())
    bad["steps"][1]["params"]["axis"] = "q"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    status, out, _ = run(capsys, "check", str(tmp_path / "bad.json"))
    assert status == 1 and "step 2" in out


def test_cost_json_has_the_promised_keys(capsys):
    status, out, _ = run(capsys, "cost", "matmul", "--hardware", "h200", "--json")
    assert status == 0
    data = json.loads(out)
    for key in ("transfers", "memory", "flops", "time_s", "tiles", "alpha_beta",
                "lower_bound_ratio"):
        assert key in data
    # the largest output tile whose accumulator the registers hold, and its launch
    assert {data["tiles"][t]["value"] for t in ("g_a", "g_c")} == {128, 256}
    (k,) = data["optimum"]["launch"]
    assert (k["num_warps"], k["num_stages"], k["spilled_bytes"]) == (8, 2, 0)


def test_bad_input_is_one_line_exit_2(capsys):
    for argv in (["cost", "attention", "--size", "q=0"], ["cost", "attention", "--size", "z=4"],
                 ["optimize", "atention"], ["cost", "attention", "--hardware", "h900"]):
        status, out, err = run(capsys, *argv)
        assert status == 2 and err.startswith("napkin: error:") and err.count("\n") == 1, err


def test_run_matches_reference(capsys):
    status, out, _ = run(capsys, "run", "causal_attention", "--size", "q=96", "--size", "x=96",
                         "--size", "d=16")
    assert status == 0, out
    assert "verified" in out and "max relative error" in out and "HBM bytes" in out


def test_run_searches_at_the_sizes_the_user_gives(capsys, monkeypatch):
    """Interpret mode runs small, searching unsized axes at the library's defaults (the
    program found at full scale) — but an axis the user sizes is searched at that size."""
    import napkin.cli.commands as commands
    searched = []
    real = commands.optimized
    monkeypatch.setattr(commands, "optimized", lambda *a, **k: searched.append(k["sizes"])
                        or real(*a, **k))
    status, out, _ = run(capsys, "run", "softmax", "--size", "v=512")
    assert status == 0, out
    assert searched == [{"n": 4096, "v": 512}], searched  # n: the library's default


def test_lower_emits_source_that_compiles(capsys, tmp_path):
    path = tmp_path / "kernel.py"
    status, out, _ = run(capsys, "lower", "matmul", "--size", "a=128", "--size", "b=128",
                         "--size", "c=128", "--emit", str(path))
    assert status == 0
    src = path.read_text()
    compile(src, str(path), "exec")
    assert "pallas_call" in src


def test_lower_report_sets_triton_beside_the_schedule(capsys):
    pytest.importorskip("triton")
    status, out, _ = run(capsys, "lower", "matmul", "--size", "a=128", "--size", "b=128",
                         "--size", "c=128", "--hardware", "h200", "--report")
    assert status == 0 and "pallas_call" not in out   # the report instead of the source
    lines = out.splitlines()
    assert lines[0].startswith("matmul: tiles") and "H200 SXM [gmem+smem], bf16" in lines[0]
    assert lines[1].startswith("allocated by triton 3.9") and "sm_90" in lines[1]
    # the block's staged shared memory is Triton's allocation, byte for byte
    block = next(ln for ln in lines if "per block" in ln)
    assert re.search(r"per block +staged for the tensor cores +([\d,]+) +shared \1 B = "
                     r"1\.00x modelled$", block), block
    assert re.search(r"^registers +per thread +at \d warps +\d+ regs +\d+ registers/thread",
                     out, re.M), out
    a = next(ln for ln in lines if ln.lstrip().startswith("A_blk"))
    assert re.search(r"A_blk +bf16\[a=\d+, b=128\] +tile", a), a


def test_lower_report_of_a_certificate_without_triton_keeps_the_schedule(capsys, monkeypatch):
    monkeypatch.setattr("napkin.lower.ptx.versions", lambda: ("0.11.2", "3.6.0"))
    status, out, _ = run(capsys, "lower", str(ROOT / "proofs/certificates/tiled_matmul.json"),
                         "--report")
    assert status == 0
    lines = out.splitlines()
    assert lines[1] == ("allocated: not compiled: triton 3.6.0 cannot read the Triton IR of "
                        "jaxlib 0.11.2 (only triton 3.8 can): pip install 'triton==3.8.*'")
    # the kernel's 2 pipeline stages: two copies of each streamed chunk
    assert re.search(r"^smem +peak +18,432$", out, re.M), out
    assert re.search(r"^ +acc_C +bf16\[a=32, c=32\] +state +2,048$", out, re.M), out
    assert re.search(r"^ +B_blk +bf16\[b=64, c=32\] +chunk, 2 stages +8,192$", out, re.M), out


def test_user_algorithm_from_a_file_optimises_lowers_and_matches(capsys, tmp_path):
    (tmp_path / "mine.py").write_text('''
import napkin as nk
from napkin import ops
q, x, d = nk.axes("q x d")

@nk.algorithm(Q=(q, d), K=(x, d), V=(x, d), bias=(x,))
def sigmoid_attention(Q, K, V, bias):
    S = ops.contract(Q, K, out=(q, x), name="QK^T")
    P = ops.sigmoid(ops.add(S, bias))
    return ops.contract(P, V, out=(q, d), name="PV")
''')
    status, out, err = run(capsys, "run", "--from", f"{tmp_path / 'mine.py'}:sigmoid_attention",
                           "--size", "q=64", "--size", "x=2000", "--size", "d=64")
    assert status == 0, err  # (K and V whole would not fit on chip: the keys stream)
    assert "stream_partition" in out and "max relative error" in out


@pytest.mark.parametrize("reference, ok", [("jax.nn.sigmoid(Q @ K.T) @ V", True),
                                           ("jax.nn.sigmoid(Q @ K.T) @ V * 1.01", False)])
def test_run_from_a_file_compares_with_the_files_own_reference(capsys, tmp_path, monkeypatch,
                                                               reference, ok):
    """An Algorithm in a --from file carries an independent reference: `napkin run` checks
    the kernel against it (a wrong one fails the run), not only against the diagram."""
    (tmp_path / "mine.py").write_text(f'''
import jax
import napkin as nk
from napkin import ops
from napkin.frontend.library import Algorithm
q, x, d = nk.axes("q x d")


def build(dtype="f32"):
    @nk.algorithm(Q=(q, d), K=(x, d), V=(x, d), dtype=dtype)
    def sigmoid_attention(Q, K, V):
        P = ops.sigmoid(ops.contract(Q, K, out=(q, x), name="QK^T"))
        return ops.contract(P, V, out=(q, d), name="PV")
    return sigmoid_attention


mine = Algorithm("mine", "sigmoid attention", build, lambda Q, K, V: {reference})
''')
    import napkin.cli.commands as commands
    compared = []
    real = commands.run_and_compare
    monkeypatch.setattr(commands, "run_and_compare",
                        lambda k, alg, *a: compared.append(alg) or real(k, alg, *a))
    status, out, err = run(capsys, "run", "--from", f"{tmp_path / 'mine.py'}:mine",
                           "--size", "q=64", "--size", "x=64", "--size", "d=16")
    assert (status == 0) == ok, (out, err)
    if ok:
        (alg,) = compared
        assert alg.label.endswith("mine.py:mine") and alg.reference is not None
    else:  # the certificate's check already holds the diagram to the file's reference
        assert "the algorithm's diagram itself disagrees with its reference" in err


@pytest.mark.parametrize("name,sizes,tiles", [
    ("attention", dict(q=128, x=128, d=32), {"g_q": 32, "s_x": 16}),
    ("matmul", dict(a=128, b=64, c=128), {"g_a": 32, "g_c": 32, "s_b": 16}),
    ("cross_entropy", dict(n=64, v=256), {"g_n": 16, "s_v": 32}),
])
def test_kernel_traffic_equals_the_cost_model(name, sizes, tiles):
    from napkin.frontend.library import DEFAULT_SIZES
    # the structure found at full scale, in bf16 (in f32 one head's 64 query tiles leave half
    # the SMs idle, and attention's scores in HBM, a kernel per box, model faster)
    full = {a: DEFAULT_SIZES[a] for a in sizes}
    r = search(get(name).diagram(), "h100", full, "bf16")
    assert "stream_partition" in [m.rule for m in r.best.chain]
    k = lower(r.best.program, tiles)
    shapes = [tuple(sizes[str(a.size)] for a in ob.type.axes) for ob in get(name).diagram().dom.inside]
    model = cost(r.best.program, get_hardware("h100").two_level(), "f32").evaluate({**sizes, **tiles})
    assert hbm_bytes(k, shapes) == pytest.approx(model["transfers_bytes"]["smem"], rel=1e-12)


def test_demo_runs_the_main_job(tmp_path):
    out = subprocess.run([sys.executable, "-m", "napkin.cli", "demo", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "verified in" in out.stdout
    assert (tmp_path / "before_after.png").exists() and (tmp_path / "attention_kernel.py").exists()
    # the certificate names the demo's own statement of attention, the diagram it searched
    from napkin.certify.certificate import Certificate, fingerprint, load_algorithm
    cert = Certificate.load(tmp_path / "attention.cert.json")
    assert cert.algorithm == {"from": "attention.py:attention"}
    assert cert.source == fingerprint(load_algorithm(cert.algorithm, tmp_path).build("f32"))


def test_gpu_benchmark_cpu_smoke():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
        assert gpu.main(["--cpu-smoke"]) == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_readme_commands_exist():
    from napkin.cli import COMMANDS
    for name in ("algorithms", "draw", "rules", "check", "cost", "optimize", "lower", "run",
                 "demo", "pseudocode"):
        assert name in COMMANDS


def test_the_backward_is_searched_within_the_forwards_limits():
    """optimize's max_states / max_seconds bound the searches the result makes later too:
    each backward program's, and the saving forward's."""
    import napkin as nk
    r = nk.optimize("attention", sizes={"q": 256, "x": 256, "d": 64}, max_states=25,
                    max_seconds=30.0)
    assert r.search.states <= 25 + 40  # (a state's children are costed before the check)
    for _, piece in r.backward.pieces:
        assert piece.limits == (25, 30.0) and piece.search.states <= 25 + 40
    assert r.saving.limits == (25, 30.0)
