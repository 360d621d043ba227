"""Hostile command lines: each is one `napkin: error:` line on stderr, exit
status 2, and no file left behind (nor any changed)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from napkin.certify.certificate import derive
from napkin.cli import main

FLASH = [("group_partition", (), {"axis": "q", "size": "g_q"}),
         ("stream_partition", (0,), {"axis": "x", "chunk": "s_x"})]


def _certificate(**edits) -> str:
    data = derive("attention", FLASH, {"q": 8, "x": 8, "d": 4}, {"g_q": 4, "s_x": 4}).to_dict()
    for key, value in edits.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return json.dumps(data)


def _tampered() -> str:
    """A certificate whose second step's chunk was edited after the fact."""
    data = json.loads(_certificate())
    data["steps"][1]["params"]["chunk"] = "t"
    return json.dumps(data)


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A folder of bad inputs, and the current directory for the command."""
    files = {
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "deep_ok.json": "[" * 200 + "]" * 200,                  # parses; still no certificate
        "latin.json": b'{"format": "napkin-certificate/1", "dtype": "\xff"}',
        "digits.json": '{"sizes": {"q": ' + "9" * 5000 + "}}",
        "huge_size.json": _certificate(sizes={"q": 10 ** 30}),
        "huge_tile.json": _certificate(tiles={"g_q": 2 ** 40}),
        "tampered.json": _tampered(),
        "notes.txt": "x",
        "plain": "x",
        "exists.py": "# my kernel\n",
        "builders.py": ("def boom(dtype='f32'):\n    raise RuntimeError('no diagram today')\n"
                        "def number(dtype='f32'):\n    return 3\n"
                        "def nothing(dtype='f32'):\n    return None\n"
                        "def bye(dtype='f32'):\n    raise SystemExit(0)\n"),
        "exits.py": "import sys\nsys.exit(0)\n",
        "latin.py": b"x = '\xff'\n",
        "latin.toml": b"name = '\xff'\n",
        "bad.toml": "name = [",
        "deep.toml": "x = " + "[" * 5000 + "]" * 5000 + "\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    (tmp_path / "folder").mkdir()
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "pics.png").mkdir()       # a directory with a picture's name
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


CERTIFICATE_ARGS = [(cmd, name, words) for cmd in ("lower", "cost", "pseudocode")
                    for name, words in (("missing.json", "no such file"),
                                        ("latin.json", "UTF-8"),
                                        ("deep.json", "nested"),
                                        ("digits.json", "more than 4300 digits"),
                                        ("dir.json", "is a directory"),
                                        ("tampered.json", "does not replay|step 2"))]

CASES = [
    # certificates given to `napkin check`
    (["check", "deep.json"], ["deep.json", "nested too deeply"]),
    (["check", "deep_ok.json"], ["deep_ok.json", "nested more than 32"]),
    (["check", "latin.json"], ["latin.json", "not UTF-8"]),
    (["check", "digits.json"], ["digits.json", "more than 4300 digits"]),
    (["check", "huge_size.json"], ["huge_size.json", "sizes: q", "above 4096"]),
    (["check", "huge_tile.json"], ["huge_tile.json", "tiles: g_q", "above 4096"]),
    (["check", "missing.json"], ["missing.json", "no such file"]),
    (["check", "empty"], ["empty", "no certificates"]),
    (["check", "--timeout", "0", "empty"], ["--timeout", "positive"]),
    (["check", "--timeout", "nan", "empty"], ["--timeout", "positive"]),
    # certificates given to lower / cost / pseudocode
    *[([cmd, name], [name, *words.split("|")]) for cmd, name, words in CERTIFICATE_ARGS],
    # --from files
    (["optimize", "--from", "/etc/passwd:x"], ["--from", "/etc/passwd", "Python source"]),
    (["optimize", "--from", "builders.py"], ["--from", "FILE.py:NAME"]),
    (["optimize", "--from", "notes.txt:x"], ["--from", "not a Python source file"]),
    (["cost", "--from", "missing.py:x"], ["--from", "not found"]),
    (["cost", "--from", "folder:x"], ["--from", "directory"]),
    (["cost", "--from", "builders.py:boom"], ["--from", "RuntimeError", "no diagram today"]),
    (["cost", "--from", "builders.py:number"], ["--from", "returned an int, not a diagram"]),
    (["cost", "--from", "builders.py:nothing"], ["--from", "returned None, not a diagram"]),
    (["cost", "--from", "builders.py:bye"], ["--from", "SystemExit"]),
    (["cost", "--from", "builders.py:absent"], ["--from", "has no 'absent'"]),
    (["optimize", "--from", "exits.py:build"], ["--from", "SystemExit"]),
    (["lower", "--from", "latin.py:x"], ["--from", "latin.py"]),
    # sizes
    (["cost", "attention", "--size", "q=²"], ["--size", "q=²"]),
    (["cost", "attention", "--size", "q=" + "9" * 30], ["--size", "positive integer"]),
    (["cost", "attention", "--size", "q=-4"], ["--size", "q=-4"]),
    # an axis the algorithm lacks: run took it silently (small runs filtered the sizes)
    (["run", "attention", "--size", "zz=64"], ["--size names zz", "its axes: d, q, x"]),
    (["cost", "attention", "--size", "zz=64"], ["--size names zz"]),
    # hardware files
    (["cost", "attention", "--hardware", "folder/"], ["hardware file", "is a directory"]),
    (["cost", "attention", "--hardware", "missing.toml"], ["hardware file", "not found"]),
    (["cost", "attention", "--hardware", "latin.toml"], ["hardware file", "not UTF-8"]),
    (["cost", "attention", "--hardware", "bad.toml"], ["hardware file", "TOML syntax error"]),
    (["cost", "attention", "--hardware", "deep.toml"], ["hardware file"]),
    (["optimize", "attention", "--hardware", "folder/"], ["hardware file", "is a directory"]),
    # output paths: a missing directory, a directory, under a regular file, unwritable
    (["optimize", "attention", "--certificate", "nowhere/c.json"],
     ["--certificate", "'nowhere' does not exist"]),
    (["optimize", "attention", "--certificate", "folder"], ["--certificate", "is a directory"]),
    (["optimize", "attention", "--certificate", "plain/c.json"],
     ["--certificate", "is a file, not a directory"]),
    (["optimize", "attention", "--certificate", "c.json", "--draw", "/proc/d.png"],
     ["--draw", "/proc/d.png", "cannot create"]),
    (["optimize", "attention", "--certificate", "c.json", "--draw", "c.json"], ["--draw", ".png"]),
    (["optimize", "attention", "--certificate", "d.png", "--draw", "d.png"],
     ["--certificate", "--draw", "same file"]),
    (["optimize", "attention", "--draw", "nowhere/d.png"], ["--draw", "does not exist"]),
    (["optimize", "attention", "--draw", "pics.png"], ["--draw", "is a directory"]),
    (["optimize", "attention", "--draw", "plain/d.png"], ["--draw", "is a file"]),
    (["optimize", "attention", "--draw", "d.pdf"], ["--draw", ".pdf", ".png", ".svg"]),
    (["cost", "attention", "--plot", "nowhere/p.png"], ["--plot", "does not exist"]),
    (["cost", "attention", "--plot", "pics.png"], ["--plot", "is a directory"]),
    (["cost", "attention", "--plot", "plain/p.png"], ["--plot", "is a file"]),
    (["cost", "attention", "--plot", "/proc/p.png"], ["--plot", "cannot create"]),
    (["lower", "matmul", "--emit", "nowhere/k.py"], ["--emit", "does not exist"]),
    (["lower", "matmul", "--emit", "folder"], ["--emit", "is a directory"]),
    (["lower", "matmul", "--emit", "plain/k.py"], ["--emit", "is a file"]),
    (["lower", "matmul", "--emit", "exists.py"], ["--emit", "exists", "--force"]),
    (["draw", "attention", "-o", "pics.png"], ["--output", "is a directory"]),
    (["draw", "attention", "-o", "plain/a.png"], ["--output", "is a file"]),
    (["demo", "--out", "plain"], ["--out", "existing file"]),
    (["demo", "--out", "plain/sub"], ["--out", "is a file"]),
    # dtypes the kernels do not take
    (["run", "attention", "--dtype", "int8"], ["--dtype", "int8", "f32, bf16 or f16"]),
    (["run", "attention", "--dtype", "f64"], ["--dtype", "f64", "f32, bf16 or f16"]),
    (["run", "attention", "--dtype", "float7"], ["--dtype", "float7"]),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_hostile_command_line(hostile, capsys, argv, words):
    before = _snapshot(hostile)
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("napkin: error: "), err
    assert "internal error" not in err and "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert out == ""
    assert _snapshot(hostile) == before
    assert not Path("/proc/d.png").exists() and not Path("/proc/p.png").exists()


def test_a_failed_write_removes_what_the_command_wrote(hostile, capsys, monkeypatch):
    """--certificate is written first; when --draw then fails, it goes too."""
    import napkin.views.drawing_streamed

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(napkin.views.drawing_streamed, "draw_before_after", broken)
    before = _snapshot(hostile)
    status = main(["optimize", "matmul", "--size", "a=64", "--size", "b=64", "--size", "c=64",
                   "--certificate", "c.json", "--draw", "d.png"])
    _, err = capsys.readouterr()
    assert status == 2 and err.startswith("napkin: error: --draw: cannot write 'd.png': No space")
    assert _snapshot(hostile) == before


def test_emit_refuses_to_overwrite_without_force(hostile, capsys):
    argv = ["lower", "matmul", "--size", "a=64", "--size", "b=64", "--size", "c=64",
            "--emit", "exists.py"]
    assert main(argv) == 2
    assert (hostile / "exists.py").read_text() == "# my kernel\n"
    capsys.readouterr()
    assert main([*argv, "--force"]) == 0
    assert "pallas_call" in (hostile / "exists.py").read_text()


def test_a_from_certificate_whose_file_is_not_python_fails_its_check(hostile, capsys):
    """Inside `napkin check`, a well-formed certificate whose algorithm cannot
    be loaded is a failed check (exit 1), like any other unverifiable one."""
    data = json.loads(_certificate())
    data["algorithm"] = {"from": "/etc/passwd:x"}
    (hostile / "passwd.json").write_text(json.dumps(data))
    status = main(["check", "--no-numeric", "passwd.json", "huge_size.json"])
    out, err = capsys.readouterr()
    assert status == 2 and "huge_size.json" in err   # a malformed file stops the run first
    status = main(["check", "--no-numeric", "passwd.json"])
    out, err = capsys.readouterr()
    assert status == 1 and err == ""
    assert out.splitlines()[0] == ("FAIL passwd.json: source: algorithm: algorithm file "
                                   "/etc/passwd is not a Python source file (want FILE.py:NAME)")
    assert os.path.exists("/etc/passwd")


def test_a_failing_demo_removes_its_files_and_the_folders_it_made(hostile, capsys, monkeypatch):
    import napkin.search
    from napkin.core.errors import NapkinError

    def no_search(*args, **kwargs):
        raise NapkinError("no search today")
    monkeypatch.setattr(napkin.search, "search", no_search)
    before = _snapshot(hostile)
    status = main(["demo", "--out", "new/demo"])
    out, err = capsys.readouterr()
    assert status == 2 and err == "napkin: error: no search today\n"
    assert "1. stated" in out                     # it had drawn attention.png there
    assert _snapshot(hostile) == before and not (hostile / "new").exists()


def test_a_failure_before_writing_keeps_an_existing_file(hostile, capsys, monkeypatch):
    """--certificate names an existing file; the command fails while making the
    certificate, before writing it: the file stays as it was."""
    import napkin.cli.commands
    from napkin.core.errors import NapkinError

    def fails(*args, **kwargs):
        raise NapkinError("cannot make the certificate")
    monkeypatch.setattr(napkin.cli.commands, "write_certificate", fails)
    before = _snapshot(hostile)
    status = main(["optimize", "matmul", "--size", "a=64", "--size", "b=64", "--size", "c=64",
                   "--certificate", "exists.py"])
    _, err = capsys.readouterr()
    assert status == 2 and err == "napkin: error: cannot make the certificate\n"
    assert _snapshot(hostile) == before


def test_cost_at_a_size_with_no_lower_bound_prints_a_dash(capsys):
    """`napkin cost attention --size q=3` crashed formatting a ratio that does not exist."""
    from napkin.cli import main
    assert main(["cost", "attention", "--size", "q=3"]) == 0
    assert "no lower bound at these sizes" in capsys.readouterr().out


def test_an_algorithm_name_and_a_from_file_together_are_one_line(tmp_path, monkeypatch, capsys):
    """`napkin cost attention --from user.py:rowsum` costed rowsum, exit 0: two sources."""
    (tmp_path / "user.py").write_text(
        "import napkin as nk\nfrom napkin import ops\na, b = nk.axes('a b')\n\n\n"
        "@nk.algorithm(X=(a, b))\ndef rowsum(X):\n    return ops.sum_(X, b)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["cost", "attention", "--from", "user.py:rowsum"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one algorithm" in err[0], err
