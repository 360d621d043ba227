"""napkin.optimize, the pipeline as a library call: a library name, an Algorithm, a
diagram or a from-file in; program, tiles, cost, certificate and kernel out."""
import subprocess
import sys

import jax
import numpy as np
import pytest

import napkin
from napkin.certify.certificate import fingerprint
from napkin.cli import Outputs, main
from napkin.frontend.library import Algorithm, get

SMALL = {"q": 256, "x": 256, "d": 64}


def _rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


SIGMOID_ATTENTION = """
import napkin
from napkin import ops
q, x, d = napkin.axes("q x d")

@napkin.algorithm(Q=(q, d), K=(x, d), V=(x, d))
def sigmoid_attention(Q, K, V):
    return ops.contract(ops.sigmoid(ops.contract(Q, K, out=(q, x))), V, out=(q, d))
"""


def _sigmoid_attention():
    ns = {}
    exec(SIGMOID_ATTENTION, ns)
    return ns["sigmoid_attention"]


@pytest.fixture(scope="module")
def attention():
    return napkin.optimize("attention", sizes=SMALL, dtype="f32")


def test_a_library_name_gives_program_tiles_cost_and_a_certificate_that_checks(attention):
    opt = attention
    assert opt.name == opt.source == "attention" and opt.sizes == SMALL and opt.dtype == "f32"
    assert [m.rule for m in opt.chain] == [m.rule for m in opt.search.best.chain]
    assert opt.program is opt.search.best.program and opt.cost is opt.search.best.cost
    assert opt.tiles == dict(opt.search.best.tiles.values) and opt.tiles
    assert all(isinstance(v, int) and v > 0 for v in opt.tiles.values())
    assert set(opt.launch) == {"num_warps", "num_stages"}
    assert opt.hardware.name == "H100 SXM [gmem+smem]" and list(opt.cost.levels) == ["gmem", "smem"]
    cert = opt.certificate
    assert cert.algorithm == "attention" and cert.source == fingerprint(opt.algorithm)
    assert cert.result == fingerprint(opt.program)
    assert opt.check().ok


def test_the_kernel_matches_the_plain_jnp_reference(attention):
    alg = get("attention")
    xs = alg.sample(np.random.default_rng(0), SMALL)
    kernel = attention.kernel(interpret=True)
    assert _rel_error(kernel(*xs), alg.reference(*xs)) < 1e-5


def test_an_algorithm_and_a_smaller_run_of_its_program():
    alg = get("matmul")
    opt = napkin.optimize(alg, sizes={"a": 4096, "b": 4096, "c": 4096}, dtype="f32")
    assert opt.source == "matmul" and opt.certificate.algorithm == "matmul"
    small = opt.fit({"a": 128, "b": 64, "c": 128})
    assert small.search is opt.search and small.sizes == {"a": 128, "b": 64, "c": 128}
    for name, value in small.tiles.items():
        assert value & (value - 1) == 0 and value <= max(opt.tiles[name], 1)
    assert small.tiles["g_a"] <= 128 // 4 and small.tiles["g_c"] <= 128 // 4
    xs = alg.sample(np.random.default_rng(1), small.sizes)
    assert _rel_error(small.kernel(interpret=True)(*xs), alg.reference(*xs)) < 1e-5


def test_a_diagram_without_a_source_has_no_certificate():
    diagram = _sigmoid_attention()
    opt = napkin.optimize(diagram, sizes=SMALL, dtype="f32")
    assert opt.source is None and opt.certificate is None and opt.name == "algorithm"
    with pytest.raises(napkin.NapkinError, match="no certificate.*source="):
        opt.check()
    xs = [np.random.default_rng(2).standard_normal(s) for s in ((256, 64), (256, 64), (256, 64))]
    want = napkin.evaluate(diagram)(*xs)
    assert _rel_error(opt.kernel(interpret=True)(*xs), want) < 1e-5
    mine = Algorithm("mine", "not in the library", lambda dtype="f32": diagram, None)
    assert napkin.optimize(mine, sizes=SMALL).source is None


def test_a_from_file_and_a_diagram_with_its_source(tmp_path):
    (tmp_path / "mine.py").write_text(SIGMOID_ATTENTION)
    spec = {"from": "mine.py:sigmoid_attention"}
    opt = napkin.optimize(spec, sizes=SMALL, dtype="f32", base=tmp_path)
    assert opt.name == "mine.py:sigmoid_attention" and opt.certificate.algorithm == spec
    same = napkin.optimize(_sigmoid_attention(), sizes=SMALL, dtype="f32", source=spec,
                           base=tmp_path)
    assert same.certificate.source == fingerprint(same.algorithm)
    assert same.check().ok


def test_the_demo_certifies_the_diagram_it_searches(tmp_path, monkeypatch):
    from napkin.cli.commands import state_demo_algorithm
    with monkeypatch.context() as m:
        m.setattr(sys, "dont_write_bytecode", False)  # as on a user's machine
        source, diagram = state_demo_algorithm(Outputs(), tmp_path)
    assert (tmp_path / "attention.py").is_file() and source == {"from": "attention.py:attention"}
    assert not (tmp_path / "__pycache__").exists()  # loading it leaves the folder as it was
    opt = napkin.optimize(diagram, sizes=SMALL, dtype="f32", source=source, base=tmp_path)
    assert opt.certificate.source == fingerprint(diagram)
    assert opt.certificate.result == fingerprint(opt.program)
    # the library's attention scales by 1/sqrt(d), the demo's by 1/d**0.5: another diagram,
    # which a certificate of this one must not name
    with pytest.raises(napkin.NapkinError, match="different diagram"):
        napkin.optimize(diagram, sizes=SMALL, dtype="f32", source="attention").certificate


def test_an_unknown_backend_names_the_known_ones(attention):
    with pytest.raises(napkin.NapkinError, match=r"unknown kernel backend 'cuda' \(known: triton, "
                                                r"mosaic, auto\)"):
        attention.kernel(backend="cuda")


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(napkin.NapkinError, match="unknown algorithm 'atention'"):
        napkin.optimize("atention")
    with pytest.raises(napkin.NapkinError, match="optimize takes a library name"):
        napkin.optimize(3)
    with pytest.raises(napkin.NapkinError, match=r"sizes names z, which the algorithm does not"):
        napkin.optimize("attention", sizes={"z": 4})
    with pytest.raises(napkin.NapkinError, match="unknown dtype"):
        napkin.optimize("attention", dtype="f7")


def test_the_schedule_is_the_one_the_cost_folds(attention):
    from napkin.schedule import Schedule
    s = attention.schedule
    assert isinstance(s, Schedule) and s is attention.cost.schedule
    assert s.program is attention.program
    assert {str(t) for t in s.tiles} == set(attention.tiles)


def test_run_leaves_jax_x64_mode_as_it_was(capsys):
    jax.config.update("jax_enable_x64", False)  # the tests' default is on (conftest)
    try:
        status = main(["run", "matmul", "--size", "a=64", "--size", "b=64", "--size", "c=64",
                       "--interpret", "on"])
        assert status == 0, capsys.readouterr()
        assert jax.config.jax_enable_x64 is False
    finally:
        jax.config.update("jax_enable_x64", True)


def test_importing_napkin_does_not_import_the_pipeline():
    code = ("import sys, napkin; heavy = {'napkin.search', 'napkin.pipeline', 'napkin.lower'}; "
            "assert not heavy & set(sys.modules), heavy & set(sys.modules); "
            "assert callable(napkin.optimize) and 'napkin.pipeline' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
