"""Derivation certificates and the independent checker.

Why a "semantically wrong but fingerprint-consistent" certificate cannot be
made by editing JSON alone: the checker believes none of the recorded digests.
It rebuilds the algorithm from its name, re-checks each premise and re-applies
each rule itself, and only then compares the fingerprint it computed with the
recorded one.  So the program the checker ends up judging is always the one
the *rules* produce from the *algorithm* with the recorded sites and
parameters — never a program described by the file.  Editing a digest can only
make a comparison fail; editing a rule, site, parameter, step order or the
algorithm changes what is replayed, which either breaks a premise or changes
the replayed fingerprint (a mismatch at that step), or — if the edit is itself
a legal derivation and the digests are recomputed honestly — yields a
certificate of a *different, correct* derivation (the rules are proved sound,
and the replayed final program is still evaluated against the algorithm and
its reference).  The only way to get a wrong program past the checker is a
wrong *rule*, which is code, not JSON — and the numeric stage catches that
too (test_unsound_rule_is_caught_numerically_at_its_step).
"""
from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from napkin.certify.certificate import (FORMAT, Certificate, CertificateError, derive, fingerprint,
                                stored_certificates)
from napkin.certify.checker import check_certificate
from napkin.certify.isolate import check_paths
from napkin.core.errors import RuleError
from napkin.frontend.library import get
from napkin.core.region import Site
from proofs.certificates import make
from rewrites import RULES

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["flash_attention", "tiled_matmul", "causal_attention", "gqa", "cross_entropy",
            "rmsnorm_matmul", "flash_decoding"]

# Print some stored certificates' replayed fingerprints (nested groups, a
# stream, head grouping, normalized contraction) and the modules the checker
# drags in, from a fresh interpreter (different hash seeds below).
_PROBE = """
import json, sys
import napkin.certify.checker
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('napkin', 'rewrites', 'proofs'))
from proofs.certificates import make
out = {name: [s.result for s in make.build(name).steps] for name in %r}
print(json.dumps({"fingerprints": out, "modules": loaded}))
""" % (["gqa", "rmsnorm_matmul", "causal_attention"],)


@pytest.fixture(scope="module")
def probes():
    """Two subprocesses with different PYTHONHASHSEED, started early so they
    run while the other tests do; collected by the test that needs them."""
    procs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, "-c", _PROBE], cwd="/", env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()


def stored(name: str) -> dict:
    return json.loads((stored_certificates() / f"{name}.json").read_text(encoding="utf-8"))


def check(data, numeric=False):
    return check_certificate(copy.deepcopy(data), numeric=numeric)


# ----------------------------------------------------------------------------- stored ones
def test_stored_certificates_present_and_verify(probes):
    files = sorted(p.name for p in stored_certificates().iterdir() if p.name.endswith(".json"))
    assert set(f"{n}.json" for n in REQUIRED) <= set(files)
    n_ok, n_fail, lines = check_paths([str(stored_certificates())])
    assert (n_ok, n_fail) == (len(files), 0), "\n".join(lines)
    assert all(line.startswith("ok") for line in lines)


def test_stored_certificates_match_make():
    """The stored files are make.py's derivations (rerun it after editing it);
    the digests themselves are re-derived by the hash-seed probes below."""
    assert sorted(make.DERIVATIONS) == sorted(REQUIRED)
    for name, (algorithm, steps, sizes, tiles) in make.DERIVATIONS.items():
        data = stored(name)
        assert (data["algorithm"], data["sizes"], data["tiles"]) == (algorithm, sizes, tiles)
        got = [(s["rule"], tuple(s["site"]["path"]), s["params"]) for s in data["steps"]]
        want = [(r, tuple(path), {k: v for k, v in p.items() if k != "ops"})
                for r, path, p in steps]
        assert got == want, f"{name}.json is stale: python -m proofs.certificates.make"


def test_flash_attention_shape_of_the_derivation():
    cert = Certificate.from_dict(stored("flash_attention"))
    assert cert.algorithm == "attention" and cert.format == FORMAT
    assert [s.rule for s in cert.steps] == ["group_partition", "stream_partition"]
    assert cert.steps[1].site.path == (0,) and cert.steps[1].params["axis"] == "x"
    assert cert.result == cert.steps[-1].result
    assert set(cert.symbolic) == {"q", "x", "d", "g_q", "s_x"}


def test_round_trip_is_stable():
    for name in REQUIRED:
        text = (stored_certificates() / f"{name}.json").read_text(encoding="utf-8")
        cert = Certificate.from_json(text)
        assert cert.to_json() == text
        again = Certificate.from_json(cert.to_json())
        assert again == cert and again.to_json() == text
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_fingerprint_depends_on_structure():
    a = get("attention").diagram()
    assert fingerprint(a) == fingerprint(get("attention").diagram())
    assert fingerprint(a) != fingerprint(get("causal_attention").diagram())
    assert fingerprint(a) != fingerprint(get("attention").diagram("bf16"))
    # names are labels: renaming a box or a wire keeps the fingerprint
    from napkin import ops
    from napkin.core.arrays import axes
    from napkin.frontend.trace import Array, trace
    i, j, k = axes("a b c")

    def mm(name, out):
        return trace(lambda A, B: ops.contract(A, B, out=(i, k), name=name, as_=out),
                     {"A": Array(i, j), "B": Array(j, k)}, name)
    assert fingerprint(mm("matmul", "C")) == fingerprint(mm("A·B", "Y"))
    assert fingerprint(mm("matmul", "C")) == fingerprint(get("matmul").diagram())
    g1 = RULES["group_partition"].apply(a, Site((), (0, 1, 2, 3)), {"axis": "q", "size": "g_q"})
    g2 = RULES["group_partition"].apply(a, Site((), (0, 1, 2, 3)), {"axis": "q", "size": 64})
    assert len({fingerprint(a), fingerprint(g1), fingerprint(g2)}) == 3


# ----------------------------------------------------------------------------- tampering
def _set(path, value):
    def edit(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value
    return edit


def _pop(path):
    def edit(d):
        *head, last = path
        for k in head:
            d = d[k]
        d.pop(last)
    return edit


def _swap(i, j):
    def edit(d):
        d["steps"][i], d["steps"][j] = d["steps"][j], d["steps"][i]
    return edit


FORGED = "0" * 64
TAMPERED = [
    # (certificate, edit, expected step, words in the reason)
    ("flash_attention", _set(["steps", 0, "params", "axis"], "x"), 1,
     "premise failed: cannot group x: softmax_x mixes"),
    ("flash_attention", _set(["steps", 1, "params", "axis"], "d"), 2,
     "premise failed: cannot stream PV over d"),
    ("tiled_matmul", _set(["steps", 2, "params", "axis"], "c"), 3, "premise failed"),
    ("flash_attention", _set(["steps", 0, "params", "size"], 0), 1,
     "premise failed: group_partition size must be a positive integer or a tile name, got 0"),
    ("flash_attention", _set(["tiles", "g_q"], 0), 1,
     "premise failed: tile size g_q = 0 is not a positive integer"),
    ("gqa", _pop(["tiles", "s_x"]), 3, "tile size s_x is not bound"),
    ("flash_attention", _set(["sizes", "q"], 0), 0, "sizes: q = 0 is not positive"),
    ("flash_attention", _pop(["sizes", "d"]), 0, "no value for the symbolic size d"),
    ("rmsnorm_matmul", _set(["steps", 0, "site", "ops"], [5]), 1,
     "premise failed: cannot factor out of the contraction: mul is not a contraction"),
    ("flash_attention", _set(["steps", 1, "rule"], "stream_partitoin"), 2,
     "unknown rule 'stream_partitoin'"),
    ("flash_attention", _pop(["steps", 0]), 1,
     "premise failed: site path step 0: op #0 (QK^T) is not a group"),
    ("tiled_matmul", _pop(["steps", 1]), 2, "premise failed: site path step 1"),
    ("tiled_matmul", _swap(1, 2), 2, "premise failed"),
    ("flash_attention", _swap(0, 1), 1, "premise failed"),
    ("gqa", _set(["steps", 1, "result"], FORGED), 2, "result fingerprint mismatch (recorded "
     "000000000000.., replayed"),
    ("flash_attention", _set(["algorithm"], "causal_attention"), 0, "source fingerprint mismatch"),
    ("flash_attention", _set(["algorithm"], "atention"), 0, "unknown algorithm 'atention'"),
    ("flash_attention", _set(["steps", 0, "params", "level"], "hbm"), 1, "unknown level 'hbm'"),
]


@pytest.mark.parametrize("name,edit,step,words", TAMPERED,
                         ids=[f"{t[0]}-{i}" for i, t in enumerate(TAMPERED)])
def test_tampered_certificate_is_rejected_at_its_step(name, edit, step, words):
    data = stored(name)
    edit(data)
    report = check(data)
    assert not report.ok
    assert report.step == step, str(report)
    assert words in report.reason, str(report)
    if step:
        assert str(report).startswith(f"step {step}") or "at step" in str(report)


def test_messages_read_as_documented():
    data = stored("flash_attention")
    _set(["steps", 1, "rule"], "stream_partitoin")(data)
    assert str(check(data)).startswith("unknown rule 'stream_partitoin' at step 2")
    data = stored("flash_attention")
    _set(["steps", 1, "params", "axis"], "q")(data)
    assert str(check(data)).startswith("step 2 (stream_partition): premise failed: cannot stream")


def test_whole_certificate_forgeries_are_rejected():
    # a forged final digest
    data = stored("tiled_matmul")
    data["result"] = FORGED
    report = check(data)
    assert report.step is None and "final result fingerprint mismatch" in report.reason
    # the last step dropped and its digest carried over: replay stops short
    data = stored("tiled_matmul")
    data["steps"].pop()
    report = check(data)
    assert report.step is None and "final result fingerprint mismatch" in report.reason
    # an unused tile, a wrong symbolic list, a wrong format
    data = stored("flash_attention")
    data["tiles"]["g_z"] = 8
    assert "g_z is bound but no step introduces it" in check(data).reason
    data = stored("flash_attention")
    data["symbolic"] = ["q"]
    assert "symbolic sizes" in check(data).reason
    data = stored("flash_attention")
    data["format"] = "napkin-certificate/0"
    assert "unsupported format" in check(data).reason
    assert "malformed" in check_certificate("{not json").reason


def test_algorithm_swap_with_a_resigned_source_fails_at_step_one():
    """Re-signing the source for another algorithm moves the failure to the
    first step whose replayed program differs."""
    data = stored("flash_attention")
    data["algorithm"] = "causal_attention"
    data["source"] = fingerprint(get("causal_attention").diagram())
    report = check(data)
    assert report.step == 1 and "result fingerprint mismatch" in report.reason


def test_final_digest_of_a_wrong_program_is_rejected():
    """The attempted forgery: claim that the unmasked streamed attention is
    causal attention's result.  The digest is a genuine fingerprint — of the
    wrong program — and the checker, which computes the result itself from the
    rules, rejects it."""
    wrong = make.build("flash_attention")
    data = stored("causal_attention")
    data["steps"][-1]["result"] = wrong.result
    data["result"] = wrong.result
    report = check(data)
    assert report.step == 2 and "result fingerprint mismatch" in report.reason


class _UnsoundRule:
    """A deliberately wrong rule (drops the causal mask), for the numeric stage."""
    name = "drop_the_mask"

    def check(self, program, site, params):
        pass

    def apply(self, program, site, params):
        return get("attention").diagram()


def test_unsound_rule_is_caught_numerically_at_its_step(monkeypatch):
    monkeypatch.setitem(RULES, "drop_the_mask", _UnsoundRule())
    cert = derive("causal_attention", [
        ("drop_the_mask", (), {}),
        ("group_partition", (), {"axis": "q", "size": "g_q"}),
    ], {"q": 24, "x": 24, "d": 8}, {"g_q": 8})
    report = check_certificate(cert)          # digests are all consistent: replay passes
    assert not report.ok and report.step == 1 and report.rule == "drop_the_mask"
    assert "numeric check failed" in report.reason


def test_derive_refuses_a_failing_premise():
    with pytest.raises(RuleError, match=r"step 1 \(stream_partition\): cannot stream"):
        derive("softmax", [("stream_partition", (), {"axis": "v"})], {"n": 4, "v": 8}, {"s_v": 4})


# ----------------------------------------------------------------------------- files
def test_check_paths_files_dirs_and_missing(tmp_path):
    good = stored("tiled_matmul")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "good.json").write_text(json.dumps(good))
    bad = copy.deepcopy(good)
    bad["steps"][0]["result"] = FORGED
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    n_ok, n_fail, lines = check_paths([tmp_path, tmp_path / "nothing.json"], numeric=False)
    assert (n_ok, n_fail) == (1, 2), lines
    assert any(line.startswith("FAIL") and "bad.json: step 1 (group_partition)" in line
               for line in lines)
    assert any("no such file" in line for line in lines)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_paths([empty])[:2] == (0, 1)


def test_algorithm_from_a_user_file(tmp_path):
    (tmp_path / "mine.py").write_text(
        "import numpy as np\n"
        "from napkin import ops\n"
        "from napkin.core.arrays import axes\n"
        "from napkin.frontend.library import Algorithm\n"
        "from napkin.frontend.trace import Array, trace\n"
        "a, b, c = axes('a b c')\n"
        "def build(dtype='f32'):\n"
        "    return trace(lambda A, B: ops.scale(ops.contract(A, B, out=(a, c)), 0.5, as_='C'),\n"
        "                 {'A': Array(a, b, dtype=dtype), 'B': Array(b, c, dtype=dtype)}, 'half')\n"
        "# a numpy reference: the checker falls back to running it op by op\n"
        "half_matmul = Algorithm('half_matmul', 'C = A·B / 2', build,\n"
        "                        lambda A, B: np.asarray(A) @ np.asarray(B) / 2)\n")
    spec = {"from": "mine.py:half_matmul"}
    cert = derive(spec, [("group_partition", (), {"axis": "a", "size": "g_a"}),
                         ("stream_partition", (0,), {"axis": "b", "chunk": "s_b"})],
                  {"a": 12, "b": 16, "c": 4}, {"g_a": 6, "s_b": 8}, base=tmp_path)
    cert.save(tmp_path / "half.json")
    n_ok, n_fail, lines = check_paths([tmp_path / "half.json"])
    assert (n_ok, n_fail) == (1, 0), lines
    (tmp_path / "mine.py").unlink()
    report = check_certificate(tmp_path / "half.json", numeric=False)
    assert report.step == 0 and "not found" in report.reason


def test_a_from_file_is_named_relative_to_the_certificate(tmp_path, monkeypatch, capsys):
    """`napkin optimize --from algos.py:mm --certificate sub/c.json` names the file as the
    certificate's folder sees it (../algos.py), so it checks from any working folder."""
    from napkin.cli import main
    (tmp_path / "algos.py").write_text(
        "import napkin as nk\nfrom napkin import ops\na, b, c = nk.axes('a b c')\n\n\n"
        "@nk.algorithm(A=(a, b), B=(b, c))\ndef mm(A, B):\n"
        "    return ops.contract(A, B, out=(a, c), name='AB')\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["optimize", "--from", "algos.py:mm", "--size", "a=256", "--size", "b=256",
                 "--size", "c=256", "--certificate", "sub/c.json"]) == 0
    assert json.loads((tmp_path / "sub" / "c.json").read_text())["algorithm"] == {
        "from": "../algos.py:mm"}
    for folder in (tmp_path, tmp_path / "sub", tmp_path.parent):
        monkeypatch.chdir(folder)
        assert check_paths([tmp_path / "sub" / "c.json"], numeric=False)[:2] == (1, 0)
    capsys.readouterr()


def test_a_from_file_imports_a_module_beside_it(tmp_path, monkeypatch):
    """A --from file may import its own helpers from its folder, wherever napkin runs."""
    from napkin.certify.certificate import load_algorithm
    (tmp_path / "shapes_helper.py").write_text("import napkin as nk\nAXES = nk.axes('a b c')\n")
    (tmp_path / "algos.py").write_text(
        "from napkin import ops\nimport napkin as nk\nfrom shapes_helper import AXES\n"
        "a, b, c = AXES\n\n\n@nk.algorithm(A=(a, b), B=(b, c))\ndef mm(A, B):\n"
        "    return ops.contract(A, B, out=(a, c), name='AB')\n")
    monkeypatch.chdir(tmp_path.parent)
    before = list(sys.path)
    src = load_algorithm({"from": "algos.py:mm"}, tmp_path)
    assert [ob.name for ob in src.build("f32").dom.inside] == ["A", "B"]
    assert sys.path == before  # the file's folder was on the path only while it loaded


def test_malformed_fields_are_named():
    data = stored("flash_attention")
    data["sizes"]["q"] = "big"
    with pytest.raises(CertificateError, match="sizes: 'q' must map to an integer"):
        Certificate.from_dict(data)
    data = stored("flash_attention")
    del data["steps"][0]["site"]
    with pytest.raises(CertificateError, match="step 1 lacks site"):
        Certificate.from_dict(data)
    for bad in ([-1], [0.5], [True]):
        data = stored("flash_attention")
        data["steps"][1]["site"]["path"] = bad
        with pytest.raises(CertificateError, match="step 2: bad site"):
            Certificate.from_dict(data)
        report = check(data)
        assert report.step == 2 and report.reason.startswith("malformed certificate: step 2: bad")


# ----------------------------------------------------------------------------- independence
def test_checker_imports_only_rules_and_core():
    tree = ast.parse((ROOT / "napkin" / "certify" / "checker.py").read_text(encoding="utf-8"))
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {m for m in mods if m.split(".")[0] in ("napkin", "rewrites", "proofs")}
    allowed = {"rewrites", "napkin.frontend.library", "napkin.core.semantics", "napkin.core.region", "napkin.core.ir",
               "napkin.core.errors", "napkin.certify.certificate", "napkin.core.primitives", "napkin.frontend.sampling",
               "napkin.core.arrays"}
    assert ours <= allowed, ours - allowed


def test_fingerprints_stable_across_processes_and_hash_seeds(probes):
    results = []
    for p in probes:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["fingerprints"] == results[1]["fingerprints"]
    for name, digests in results[0]["fingerprints"].items():
        assert digests == [s["result"] for s in stored(name)["steps"]], name
    # no search code is loaded by the checker (nor by replaying a derivation)
    assert not [m for m in results[0]["modules"] if "search" in m], results[0]["modules"]


def test_a_certificate_carries_the_launch_the_model_chose():
    """The launch parameters travel with the tiles: optimize's certificate records the warps
    and stages its kernel is written with, they survive JSON, and ``lower`` from the
    certificate writes the kernel with them.  Their form is checked: a tampered launch is a
    clear error, not a kernel Triton refuses later."""
    from napkin.pipeline import optimize
    opt = optimize("attention", "h100", dict(q=512, x=512, d=64), "bf16")
    cert = opt.certificate
    assert cert.launch == {"num_warps": opt.launch["num_warps"],
                           "num_stages": opt.launch["num_stages"]}
    assert cert.launch == {k: opt.search.best.tiles.launch[0][k] for k in cert.launch}
    again = Certificate.from_json(cert.to_json())
    assert again.launch == cert.launch and check_certificate(again).ok
    data = json.loads(cert.to_json())
    for bad, why in (({"num_warps": 3}, "num_warps = 3 is not one of 1, 2, 4, 8, 16, 32"),
                     ({"num_stages": 0}, "num_stages = 0 is not one of 1, 2"),
                     ({"num_warps": "8"}, "'num_warps' must map to an integer")):
        with pytest.raises(CertificateError, match=why):
            Certificate.from_dict({**data, "launch": bad})
    del data["launch"]  # certificates without one (older, or hand-written) still load
    assert Certificate.from_dict(data).launch == {}


def test_a_stale_dtype_is_rejected(tmp_path):
    """A builder that ignores its dtype makes the same diagram at every dtype, so editing a
    certificate's dtype leaves its fingerprint as it was: the checker compares the dtype
    with the diagram's own inputs."""
    (tmp_path / "f32_only.py").write_text(
        "from napkin.frontend.library import get\n\n\ndef build(dtype='f32'):\n"
        "    return get('attention').diagram('f32')\n")
    cert = derive({"from": "f32_only.py:build"}, [], {"q": 4, "x": 4, "d": 2}, {},
                  base=tmp_path).to_dict()
    cert["dtype"] = "bf16"
    (tmp_path / "stale.json").write_text(json.dumps(cert))
    report = check_certificate(tmp_path / "stale.json", numeric=False)
    assert not report.ok and report.step == 0, str(report)
    assert "says bf16" in report.reason and "f32 inputs" in report.reason
    honest = derive("attention", [], {"q": 4, "x": 4, "d": 2}, {}, dtype="bf16")
    assert check_certificate(honest.to_dict(), numeric=False).ok


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.setdefault("launch", {}).update(num_wraps=4), "unknown parameter"),
    (lambda c: c.setdefault("launch", {}).update(num_warps=1024), "num_warps = 1024 is not"),
    (lambda c: c.setdefault("launch", {}).update(num_stages=0), "num_stages = 0 is not"),
    (lambda c: c["steps"][0].update(note="trust me"), "step 1: unknown field"),
])
def test_every_unknown_or_impossible_field_is_rejected_alike(edit, message):
    cert = stored("tiled_matmul")
    edit(cert)
    with pytest.raises(CertificateError, match=message):
        Certificate.from_dict(cert)


@pytest.mark.parametrize("rule, params", [
    ("group_partition", {"axis": "q", "size": "g_q", "colour": "red"}),
    ("stream_partition", {"axis": "x", "chunk": "s_x", "axis2": "q"}),
    ("recompute", {"what": 1}),
])
def test_a_stray_parameter_is_refused_by_every_rule(rule, params):
    """Every rule refuses parameters it does not take, by one mechanism (rewrites.base)."""
    from napkin.core.ir import ops as op_order, view
    D = get("attention").diagram()
    site = Site((), tuple(range(len(op_order(view(D))))))
    with pytest.raises(RuleError, match=f"{rule} takes .*; got also"):
        RULES[rule].check(D, site, params)


def test_a_huge_name_is_one_line_not_a_malformed_verdict():
    cert = stored("tiled_matmul")
    cert["algorithm"] = "a" * 100_000
    with pytest.raises(CertificateError, match="a name of 100,000 characters"):
        Certificate.from_dict(cert)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_search_at_a_dtype_is_certified_and_checked_at_that_dtype(dtype):
    """The certificate of a bf16 search (the CLI's default) is derived on the algorithm
    built at bf16, so the checker runs the program at bf16 wires (it said f32, and was
    checked at f32: not what was searched).  Editing the dtype back is rejected: the
    fingerprints are those of the bf16 diagram."""
    import napkin
    opt = napkin.optimize("attention", sizes={"q": 128, "x": 128, "d": 32}, dtype=dtype,
                          max_states=60)
    cert = opt.certificate
    assert cert.dtype == dtype
    report = opt.check()
    assert report.ok and report.dtype == dtype and f"at {dtype} wires" in str(report), str(report)
    edited = {**cert.to_dict(), "dtype": "f32"}
    assert not check_certificate(edited, numeric=False).ok
