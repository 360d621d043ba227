"""The house: imports point one way (no circle, counting imports inside functions too), no
private name is imported from another module, and the top level shows the architecture."""
import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("napkin", "rewrites", "proofs")


def _modules() -> dict:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mods: dict):
    """(importer, imported module, name or None) for every import, at any depth."""
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield m, a.name, None
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    yield m, full if full in mods else node.module, a.name


def _owner(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def test_no_import_circles():
    mods = _modules()
    g = nx.DiGraph()
    for m, target, _ in _imports(mods):
        t = _owner(target, mods)
        if t and t != m:
            g.add_edge(m, t)
    circles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not circles, circles


def test_no_private_name_is_imported_across_modules():
    mods = _modules()
    private = [(m, t, name) for m, t, name in _imports(mods)
               if name and name.startswith("_") and not name.startswith("__")
               and _owner(t, mods) not in (None, m)]
    assert not private, private


def test_the_top_level_is_grouped():
    top = sorted(p.name for p in (ROOT / "napkin").iterdir()
                 if not p.name.startswith((".", "__pycache__")))
    assert top == ["__init__.py", "certify", "cli", "core", "cost", "devices", "frontend",
                   "hardware.py", "lower", "pipeline.py", "schedule", "search", "views"]
