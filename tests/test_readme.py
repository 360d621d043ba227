"""The README's Python examples run as printed (in order, one namespace), and every
``print(...)  # OUTPUT`` in them prints that output (``…`` elides; `` — `` starts a remark),
so the figures the README shows cannot drift from the code."""
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _shown(line: str) -> str | None:
    """The output a ``print(...)  # OUTPUT`` line shows, or None for another line."""
    code, sep, comment = line.partition("  # ")
    if not sep or "print(" not in code:
        return None
    return comment.split(" — ")[0].strip()


def _agrees(shown: str, printed: str) -> bool:
    """``shown``'s pieces between ``…`` appear in ``printed`` in order (whitespace folded)."""
    fold = lambda t: " ".join(t.split())  # noqa: E731
    printed, at = fold(printed), 0
    for piece in (fold(p) for p in shown.split("…")):
        found = printed.find(piece, at)
        if found < 0 or (at == 0 and found != 0 and not shown.startswith("…")):
            return False
        at = found + len(piece)
    return shown.endswith("…") or at == len(printed)


def test_readme_python_blocks_run_and_print_what_they_show():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    checked = []
    for block in blocks:
        lines = block.splitlines()
        for j, line in enumerate(lines):
            if _shown(line) is not None:
                lines[j] = re.sub(r"\bprint\(", f"__shown__({len(checked)}, ", line, count=1)
                checked.append((_shown(line), []))

        def shown(k, *args, **kw):
            buf = io.StringIO()
            print(*args, **kw, file=buf)
            checked[k][1].append(buf.getvalue())
        ns["__shown__"] = shown
        exec(compile("\n".join(lines), str(README), "exec"), ns)
    assert ns["np"].allclose(ns["out"], ns["ref"])
    assert len(checked) >= 6
    for want, got in checked:
        assert got, f"never printed: {want}"
        assert all(_agrees(want, g) for g in got), f"README shows {want!r}, prints {got[0]!r}"


def test_the_output_matcher():
    assert _agrees("a b … d", "a b c d") and _agrees("a …", "a b") and not _agrees("a c", "a b")
    assert not _agrees("b", "a b") and _agrees("… b", "a b")
    printed = ["head", "tiles: g_q=64, s_x=64", "x", "tail"]
    assert _lines_agree(["head", "tiles: g_q=64, …", "…", "tail"], printed) == ""
    assert "shows 'tiles: g_q=256, s_x=64'" in _lines_agree(["head", "tiles: g_q=256, s_x=64"],
                                                          printed)
    assert "prints more" in _lines_agree(["head", "tiles: …"], printed)


def _lines_agree(shown: list[str], printed: list[str]) -> str:
    """Why ``printed`` is not what ``shown`` shows ("" when it is): shown lines match printed
    lines in order (``…`` inside a line elides part of it); printed lines are skipped only
    where a shown line is ``…`` alone."""
    at, skip = 0, False
    for want in shown:
        if want.strip() == "…":
            skip = True
            continue
        while at < len(printed) and not _agrees(want, printed[at]):
            if not skip:
                return f"shows {want!r} where it prints {printed[at]!r}"
            at += 1
        if at == len(printed):
            return f"shows {want!r}, which it does not print"
        at, skip = at + 1, False
    return "" if skip or at == len(printed) else f"prints more: {printed[at]!r}"


def test_readme_command_samples_are_what_the_commands_print(capsys):
    """Every ```$ napkin …``` sample: the command run, its output as shown."""
    import shlex

    from napkin.cli import main
    samples = re.findall(r"```\n\$ (napkin [^\n]*)\n(.*?)```", README.read_text(), re.S)
    assert len(samples) >= 4
    for command, shown in samples:
        assert main(shlex.split(command)[1:]) == 0, command
        printed = capsys.readouterr().out.rstrip("\n").splitlines()
        why = _lines_agree(shown.rstrip("\n").splitlines(), printed)
        assert not why, f"README's `{command}` {why}"
