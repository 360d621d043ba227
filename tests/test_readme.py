"""The README's Python examples run as printed (in order, one namespace)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)
    assert ns["np"].allclose(ns["out"], ns["ref"])
