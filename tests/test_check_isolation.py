"""`napkin check` checks every certificate in a process of its own.

A ``{"from": "FILE:NAME"}`` certificate runs FILE's code.  Checked in the
checker's own process, that code could rewrite a rule or the checker's
tolerance and so change the verdict of its own certificate and of every one
checked after it, or end the run with its own exit status.  ``check_paths``
(what ``napkin check`` uses) runs FILE in a process of its own that hands back
the diagram as data, and judges in another, forked from a server that never ran
any certificate's code, which rebuilds the diagram with napkin's own primitives:
these tests poison, exit, crash and stall such processes and watch every
verdict, the checker and the exit status stay as they were.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import napkin.certify.checker
import rewrites.softmax_contraction as sc
from napkin.certify.certificate import derive
from napkin.certify.checker import check_certificate
from napkin.certify.isolate import check_paths
from napkin.cli import main

ROOT = Path(__file__).resolve().parents[1]
FLASH = [("group_partition", (), {"axis": "q", "size": "g_q"}),
         ("stream_partition", (0,), {"axis": "x", "chunk": "s_x"})]
SIZES, TILES = {"q": 4, "x": 8, "d": 2}, {"g_q": 2, "s_x": 4}
BUILD = ("from napkin.frontend.library import get\n\n\n"
         "def build(dtype='f32'):\n"
         "    return get('attention').diagram(dtype)\n")
# FlashAttention's accumulator without the rescale exp(mu - mu'): a wrong rule.
WRONG_RULE = """\
import rewrites.softmax_contraction as sc
from napkin import ops


def _update_without_rescale(self, graph, claim, axis, state, ins):
    mu, z, o = state
    x, others = ins[0], list(ins[1:])
    mu2 = ops.maximum(mu, ops.max_(x, axis), as_="mu")
    p = ops.exp(ops.sub(x, mu2), as_="p")
    port = claim.data["port"]
    pv = ops.contract(*others[:port], p, *others[port:], out=list(claim.data["out"]),
                      name="sum p.v")
    return [mu2, ops.add(z, ops.sum_(p, axis), as_="z"), ops.add(o, pv, as_="o")]


sc.SoftmaxContraction.update = _update_without_rescale
"""
# ... and the checker's tolerances set to infinity, so that it "verifies" anything.
BLIND_CHECKER = """\
import math
import napkin.certify.checker
napkin.certify.checker.RTOL = math.inf
for _k in getattr(napkin.certify.checker, "DTYPE_RTOL", {}):
    napkin.certify.checker.DTYPE_RTOL[_k] = math.inf
"""
# Derive the wrong rule's certificate in a separate interpreter (deriving it
# here would load the wrong rule into this process); there, also show what the
# poison does to certificates checked after it in one process, with
# check_certificate (the in-process API).
DERIVE_WRONG = f"""
import json, sys
from pathlib import Path
from napkin.certify.certificate import derive
from napkin.certify.checker import check_certificate
here = Path(sys.argv[1])
cert = derive({{"from": "wrong.py:build"}}, {FLASH!r}, {SIZES!r}, {TILES!r}, base=here)
cert.save(here / "wrong.json")
verdicts = {{n: check_certificate(here / (n + ".json")).ok for n in ("poisoned", "wrong", "honest")}}
print(json.dumps(verdicts))
"""


def _timeless(line: str) -> str:
    return re.sub(r"\(\d+\.\d s\)", "(_ s)", line)


def _from_certificate(folder: Path, name: str, code: str, *, after: bool = False) -> Path:
    """A certificate of attention (no steps) built by ``name``.py:build, whose
    file then gets ``code`` before (or ``after``) the builder -- derived first,
    so that the code never runs here."""
    (folder / f"{name}.py").write_text(BUILD)
    cert = derive({"from": f"{name}.py:build"}, [], {"q": 3, "x": 4, "d": 2}, {}, base=folder)
    cert.save(folder / f"{name}.json")
    (folder / f"{name}.py").write_text(BUILD + "\n" + code if after else code + "\n" + BUILD)
    return folder / f"{name}.json"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """honest.json: attention, the FlashAttention chain.  poisoned.json: its
    file installs the wrong rule and blinds the checker.  wrong.json: the
    FlashAttention chain derived with the wrong rule (its file installs it)."""
    here = tmp_path_factory.mktemp("poison")
    derive("attention", FLASH, SIZES, TILES).save(here / "honest.json")
    _from_certificate(here, "poisoned", WRONG_RULE + BLIND_CHECKER)
    (here / "wrong.py").write_text(WRONG_RULE + BUILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DERIVE_WRONG, str(here)], cwd=here, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    in_one_process = json.loads(proc.stdout.strip().splitlines()[-1])
    return here, in_one_process


def test_a_poisoned_certificate_cannot_change_the_others(poisoned):
    here, in_one_process = poisoned
    # Without isolation (one process, after poisoned.json): the wrong
    # derivation verifies and the honest one fails -- the poison decided both.
    assert in_one_process == {"poisoned": True, "wrong": True, "honest": False}
    alone = check_certificate(here / "honest.json", name=str(here / "honest.json"))
    assert alone.ok, str(alone)

    update, rtol = sc.SoftmaxContraction.update, napkin.certify.checker.RTOL
    files = [here / "poisoned.json", here / "honest.json", here / "wrong.json"]
    n_ok, n_fail, lines = check_paths(files)
    by_name = {Path(line.split()[1].rstrip(":")).name: line for line in lines}
    # the honest certificate, checked after the poisoned one: exactly as when alone
    assert _timeless(by_name["honest.json"]) == _timeless(f"ok   {here / 'honest.json'}: {alone}")
    # the wrong derivation, after it: its own file installs the wrong rule, but only in the
    # process that builds its diagram; the judge replays napkin's rule, which makes another
    # program at step 2
    assert by_name["wrong.json"].startswith("FAIL"), by_name["wrong.json"]
    assert "step 2" in by_name["wrong.json"], by_name["wrong.json"]
    # the poisoned certificate (attention, no steps) is judged by the checker's own rules and
    # tolerances: what its file patched stayed in the process that ran it
    assert by_name["poisoned.json"].startswith("ok"), by_name["poisoned.json"]
    assert (n_ok, n_fail) == (2, 1), lines
    # ... and nothing of it reached this process
    assert sc.SoftmaxContraction.update is update and napkin.certify.checker.RTOL == rtol


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Certificates of attention with no steps whose from-files end their
    process in different ways, and an honest one (replayed only: fast)."""
    here = tmp_path_factory.mktemp("quick")
    derive("attention", [], {"q": 3, "x": 4, "d": 2}, {}).save(here / "z_honest.json")
    return here


def test_a_certificate_that_ends_its_process_is_a_failure_and_the_run_goes_on(quick, capsys):
    exits = _from_certificate(quick, "exits", "import sys\nsys.exit(0)\n")
    os_exit = _from_certificate(quick, "os_exit", "import os\nos._exit(0)\n")
    killed = _from_certificate(quick, "killed",
                               "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    late = _from_certificate(quick, "late_exit", "import os\n\n\ndef build(dtype='f32'):\n"
                                                 "    os._exit(0)\n", after=True)
    status = main(["check", "--no-numeric", str(exits), str(os_exit), str(killed), str(late),
                   str(quick / "z_honest.json")])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert status == 1, out + err
    assert len(lines) == 6, out
    assert lines[0].startswith(f"FAIL {exits}: ") and "SystemExit" in lines[0]
    assert lines[1].startswith(f"FAIL {os_exit}: no verdict") and "exited with status 0" in lines[1]
    assert lines[2].startswith(f"FAIL {killed}: no verdict") and "SIGKILL" in lines[2]
    assert lines[3].startswith(f"FAIL {late}: no verdict") and "exited with status 0" in lines[3]
    assert lines[4].startswith(f"ok   {quick / 'z_honest.json'}: verified")
    assert lines[5] == "1 certificates verified, 4 failed"


def test_a_certificate_past_its_time_limit_is_a_failure(quick, capsys):
    pid_file = quick / "sleeper.pid"
    sleeper = _from_certificate(quick, "sleeper", f"import os, time\nopen({str(pid_file)!r}, 'w')"
                                                  f".write(str(os.getpid()))\ntime.sleep(120)\n")
    t0 = time.monotonic()
    status = main(["check", "--timeout", "1.5", "--no-numeric", str(sleeper)])
    out, _ = capsys.readouterr()
    assert time.monotonic() - t0 < 60
    assert status == 1
    line = out.strip().splitlines()[0]
    assert line.startswith(f"FAIL {sleeper}: timed out") and "1.5 s" in line, line
    assert out.strip().splitlines()[1] == "0 certificates verified, 1 failed"
    pid = int(pid_file.read_text())
    for _ in range(100):  # the stalled process was stopped
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"process {pid} still runs")


# What a `from` file may try besides the wrong rule and the blind checker: replace the
# semantics, numpy's and jax.numpy's comparisons, or the checker module itself.
PATCHES = {
    "blind": BLIND_CHECKER,
    "semantics": "import napkin.core.semantics as s\n"
                 "s.evaluate = lambda *a, **k: (lambda *xs: 0.0)\n",
    "numpy": "import numpy as np\nnp.max = lambda *a, **k: 0.0\nnp.abs = lambda x: 0 * x\n",
    "jax_numpy": "import jax.numpy as jnp\njnp.asarray = lambda x, *a, **k: 0 * x\n",
    "sys_modules": "import sys, types\nfake = types.ModuleType('napkin.certify.checker')\n"
                   "sys.modules['napkin.certify.checker'] = fake\n",
}


@pytest.mark.parametrize("patch", sorted(PATCHES))
def test_a_from_file_cannot_blind_the_judge_of_its_own_certificate(poisoned, patch):
    """The issue's attack: the file swaps in the update without the rescale, derives the
    FlashAttention chain with it, and patches the checker (or what it computes with) at
    import.  Judged by `napkin check`, it fails at the step the wrong rule made; the same
    patches in front of an honest derivation change nothing."""
    here, _ = poisoned
    (here / f"attack_{patch}.py").write_text(WRONG_RULE + PATCHES[patch] + BUILD)
    wrong = json.loads((here / "wrong.json").read_text())
    wrong["algorithm"] = {"from": f"attack_{patch}.py:build"}
    (here / f"attack_{patch}.json").write_text(json.dumps(wrong))
    (here / "honest_src.py").write_text(BUILD)
    honest = derive({"from": "honest_src.py:build"}, FLASH, SIZES, TILES, base=here)
    (here / f"patched_{patch}.py").write_text(PATCHES[patch] + BUILD)
    data = honest.to_dict()
    data["algorithm"] = {"from": f"patched_{patch}.py:build"}
    (here / f"patched_{patch}.json").write_text(json.dumps(data))
    n_ok, n_fail, lines = check_paths([here / f"attack_{patch}.json",
                                       here / f"patched_{patch}.json"])
    assert lines[0].startswith("FAIL") and "step 2" in lines[0], lines[0]
    assert lines[1].startswith("ok") and "numeric max rel err" in lines[1], lines[1]


def test_data_naming_code_or_unknown_kinds_is_rejected(quick):
    """The process that runs the file hands back data; the judge rebuilds it only from
    napkin's primitives: a spec kind it does not know is a rejection, in one line."""
    forged = ("import napkin.core.serial as s\n_spec = s._spec\n"
              "def forged(spec):\n    return {**_spec(spec), 'kind': 'os.system'}\n"
              "s._spec = forged\n")
    cert = _from_certificate(quick, "forged_kind", forged)
    n_ok, n_fail, lines = check_paths([cert], numeric=False)
    assert n_fail == 1 and "not one of napkin's primitives" in lines[0], lines


def test_a_from_file_reference_is_still_compared(tmp_path):
    """The file's reference runs where the file runs; the judge compares the diagram it
    rebuilt with the reference's outputs: a reference that disagrees fails the check."""
    (tmp_path / "ref.py").write_text(
        "import numpy as np\nfrom napkin.frontend.library import Algorithm, get\n"
        "att = get('attention')\n"
        "good = Algorithm('good', 'attention', att.diagram, att.reference)\n"
        "bad = Algorithm('bad', 'attention off by one', att.diagram,\n"
        "                lambda Q, K, V: np.asarray(att.reference(Q, K, V)) + 1.0)\n")
    for name in ("good", "bad"):
        derive({"from": f"ref.py:{name}"}, FLASH, SIZES, TILES, base=tmp_path).save(
            tmp_path / f"{name}.json")
    n_ok, n_fail, lines = check_paths([tmp_path / "good.json", tmp_path / "bad.json"])
    assert lines[0].startswith("ok"), lines[0]
    assert lines[1].startswith("FAIL") and "reference" in lines[1], lines[1]


def test_a_file_that_raises_keyboard_interrupt_is_one_fail_line(quick, capsys):
    ki = _from_certificate(quick, "interrupts", "raise KeyboardInterrupt\n")
    status = main(["check", "--no-numeric", str(ki)])
    out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in out + err
    assert out.splitlines()[0] == (f"FAIL {ki}: source: algorithm: building interrupts.py:build "
                                   f"raised KeyboardInterrupt"), out
