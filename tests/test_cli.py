"""The napkin command line, run in-process (and once as a subprocess)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from napkin import cli
from napkin.frontend.library import LIBRARY

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("napkin: error: ")
    assert "Traceback" not in err and "usage:" not in err


def test_algorithms_lists_library(capsys):
    rc, out, err = run(capsys, "algorithms")
    assert rc == 0 and err == ""
    lines = out.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(LIBRARY)
    by_name = {ln.split()[0]: ln for ln in lines}
    assert "Q[q,d] @ K[x,d] @ V[x,d] -> O[q,d]" in by_name["attention"]
    assert LIBRARY["attention"].summary in by_name["attention"]
    # aligned: every signature starts in the same column
    starts = {ln.index(ln.split()[1], len(ln.split()[0])) for ln in lines}
    assert len(starts) == 1


def test_draw_writes_file(capsys, tmp_path):
    target = tmp_path / "att.svg"
    rc, out, err = run(capsys, "draw", "attention", "-o", str(target))
    assert rc == 0 and err == ""
    assert out.strip() == str(target)
    text = target.read_text()
    assert "Q[q,d]" in text and "QK^T" in text


def test_draw_default_path_and_dtype(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(capsys, "draw", "matmul", "--dtype", "bfloat16")
    assert rc == 0 and out.strip() == "matmul.png"
    assert (tmp_path / "matmul.png").stat().st_size > 1000


def test_unknown_algorithm_did_you_mean(capsys, tmp_path):
    rc, out, err = run(capsys, "draw", "atention", "-o", str(tmp_path / "x.png"))
    assert rc == 2 and out == ""
    assert_one_error_line(err)
    assert "did you mean attention" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv, words", [
    (["frobnicate"], ["unknown command", "algorithms", "draw"]),
    (["drow", "attention"], ["did you mean draw"]),
    ([], ["no command"]),
    (["draw"], ["ALGO"]),
    (["draw", "attention", "--bogus"], ["--bogus"]),
    (["algorithms", "extra"], ["extra"]),
    (["draw", "attention", "--dtype", "float7"], ["dtype", "float7"]),
    (["draw", "attention", "-o", "a.pdf"], [".pdf", ".png", ".svg"]),
])
def test_errors_are_one_line_exit_2(capsys, argv, words):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert_one_error_line(err)
    for w in words:
        assert w in err


def test_version_and_help(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.startswith("napkin ")
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for name in cli.COMMANDS:
        assert name in out
    rc, out, _ = run(capsys, "draw", "--help")
    assert rc == 0 and "--dtype" in out


def test_a_new_subcommand_slots_in(capsys, monkeypatch):
    monkeypatch.setattr(cli.options, "COMMANDS", dict(cli.options.COMMANDS))
    seen = {}

    @cli.command("echo", "repeat a word", cli.arg("word"), cli.arg("--times", type=int, default=1))
    def _echo(args):
        seen["args"] = args
        print(" ".join([args.word] * args.times))

    rc, out, _ = run(capsys, "echo", "hi", "--times", "2")
    assert rc == 0 and out == "hi hi\n"
    rc, out, _ = run(capsys, "--help")
    assert "echo" in out and "repeat a word" in out
    rc, _, err = run(capsys, "echo", "hi", "--times", "x")
    assert rc == 2
    assert_one_error_line(err)


def test_internal_error_is_one_line_exit_1(capsys, monkeypatch):
    monkeypatch.setattr(cli.options, "COMMANDS", dict(cli.options.COMMANDS))

    @cli.command("boom", "fail")
    def _boom(args):
        raise RuntimeError("kaboom\nsecond line")

    rc, _, err = run(capsys, "boom")
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("napkin: internal error: RuntimeError: kaboom second line")
    with pytest.raises(RuntimeError):
        cli.main(["--traceback", "boom"])


def test_python_dash_m(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "napkin.cli", "algorithms"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "attention" in proc.stdout and "rmsnorm_matmul" in proc.stdout


def test_optimize_and_pseudocode_the_backward(capsys):
    rc, out, err = run(capsys, "optimize", "attention", "--backward", "--size", "q=256",
                       "--size", "x=256", "--size", "d=64")
    assert rc == 0, err
    assert "the backward of attention with respect to Q on" in out
    assert "the backward of attention with respect to K, V on" in out
    assert "backward: 2 programs" in out
    rc, out, err = run(capsys, "pseudocode", "attention", "--backward", "--wrt", "Q",
                       "--size", "q=256", "--size", "x=256", "--size", "d=64")
    assert rc == 0, err
    assert "dQ: the backward of attention" in out and "L0" in out  # reads the saved L
    for argv in (("--wrt", "Q"), ("--backward", "--wrt", "nope")):
        rc, out, err = run(capsys, "optimize", "attention", *argv)
        assert rc != 0
        assert_one_error_line(err)


def test_run_backward_compares_the_gradients(capsys):
    rc, out, err = run(capsys, "run", "attention", "--backward", "--size", "q=40",
                       "--size", "x=56", "--size", "d=16")
    assert rc == 0, err
    assert "backward: 2 programs (dQ: " in out and "jax.grad max relative error" in out


def test_a_search_shows_its_progress_on_a_terminal_only():
    """One rewritten line on a terminal while the search runs, cleared after; nothing on a
    pipe or a log."""
    import io
    from napkin.cli import _progress
    from napkin.pipeline import optimize
    from napkin.search import engine

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    shown, piped = Terminal(), io.StringIO()
    with _progress(shown):
        optimize("gqa", "h100", None, "bf16", max_states=3000)
    with _progress(piped):
        optimize("attention", "h100", None, "bf16")
    text = shown.getvalue()
    assert text.startswith("\rsearching: ") and " states, best " in text
    assert text.endswith("\r\033[K") and piped.getvalue() == "" and engine.PROGRESS is None


def test_the_command_line_starts_without_the_heavy_libraries():
    """``from napkin.cli import main`` (what the console script runs before main can catch
    anything) imports neither JAX, DisCoPy nor sympy: a Ctrl-C during start-up lands inside
    main, one line; they load when a command needs them."""
    import subprocess
    import sys
    probe = ("import sys; from napkin.cli import main; import napkin; "
             "print(sorted(m for m in ('jax', 'discopy', 'sympy', 'networkx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    # listing the library builds every diagram, and imports no JAX (about half of the 2.5 s
    # `napkin algorithms` took): the semantics' JAX backend loads when something is evaluated
    probe = ("import sys; from napkin.cli import main; main(['algorithms']); "
             "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "False", out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--tile", "g_q=7"], "--tile g_q=7: the Triton backend takes power-of-two tiles (or one "
                          "covering the whole axis, 256)"),
    (["--interpret", "off"], "--interpret off: a compiled kernel runs on a GPU"),
    (["--size", "q=99999999999"], "GiB, more than half this machine's"),
])
def test_a_run_that_could_only_fail_later_is_refused_before_the_search(capsys, monkeypatch,
                                                                        argv, message):
    """Refused in one line before any search (the search is replaced by one that fails)."""
    import napkin.search as search_pkg

    def no_search(*a, **k):
        raise AssertionError("searched")
    monkeypatch.setattr(search_pkg, "search", no_search)
    rc, out, err = run(capsys, "run", "attention", *argv)
    assert rc == 2 and message in err and "searched" not in err
    assert_one_error_line(err)


def test_a_tile_covering_its_axis_passes_the_early_check(capsys, monkeypatch):
    """The early --tile check is the lowering's own: a tile over the whole axis is taken
    (the search then runs: here replaced by one that says so)."""
    import napkin.search as search_pkg

    def no_search(*a, **k):
        raise AssertionError("searched")
    monkeypatch.setattr(search_pkg, "search", no_search)
    rc, _, err = run(capsys, "run", "attention", "--tile", "g_q=300")
    assert rc == 1 and "searched" in err
