"""napkin.jit: a plain JAX function searched, lowered and cached per shapes; the cache replays
its certificate on load, and an entry that does not replay is searched again."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin as nk
from napkin.certify import cache
from napkin.core.errors import NapkinError

_FILE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import napkin as nk

    @nk.jit(axes=["q d", "x d", "x d"])
    def softcapped(Q, K, V):
        s = Q @ K.T / 8.0
        return jax.nn.softmax(30.0 * jnp.tanh(s / 30.0), axis=-1) @ V

    def reference(Q, K, V):
        s = Q @ K.T / 8.0
        return jax.nn.softmax(30.0 * jnp.tanh(s / 30.0), axis=-1) @ V

    def inputs():
        rng = np.random.default_rng(1)
        return [jnp.asarray(rng.standard_normal(s), jnp.float32)
                for s in ((37, 16), (53, 16), (53, 16))]
""")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    (tmp_path / "mod_jit.py").write_text(_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mod_jit", None)
    return tmp_path


def _fresh():
    sys.modules.pop("mod_jit", None)
    import mod_jit
    return mod_jit


def test_first_call_searches_a_second_process_reads_the_cache(cache_dir):
    m = _fresh()
    xs = m.inputs()
    np.testing.assert_allclose(m.softcapped(*xs), m.reference(*xs), rtol=1e-5, atol=1e-6)
    assert list(m.softcapped.how.values()) == ["searched"]
    (entry,) = cache.entries()
    assert entry["name"] == "softcapped" and entry["sizes"] == {"d": 16, "q": 37, "x": 53}
    probe = ("import mod_jit, numpy as np; xs = mod_jit.inputs(); "
             "out = mod_jit.softcapped(*xs); "
             "print(list(mod_jit.softcapped.how.values())[0], "
             "float(np.abs(out - mod_jit.reference(*xs)).max()))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=cache_dir, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    how, err = run.stdout.split()
    assert how == "cache" and float(err) <= 1e-5
    # the gradient through the decorated function is jax.grad of the plain one
    g = jax.grad(lambda q: jnp.sum(m.softcapped(q, *xs[1:]) ** 2))(xs[0])
    want = jax.grad(lambda q: jnp.sum(m.reference(q, *xs[1:]) ** 2))(xs[0])
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tamper", ["step", "rule", "result", "tiles", "launch", "format"])
def test_a_tampered_entry_is_searched_again(cache_dir, tamper):
    m = _fresh()
    xs = m.inputs()
    m.softcapped(*xs)
    (entry,) = cache.entries()
    path = entry["path"]
    data = json.loads(path.read_text())
    steps = data["certificate"]["steps"]
    if tamper == "step":      # another axis than the one the fingerprints record
        steps[0]["params"]["axis"] = "d" if steps[0]["params"].get("axis") != "d" else "q"
    elif tamper == "rule":
        steps[0]["rule"] = "relabel_level"
    elif tamper == "result":
        data["certificate"]["result"] = "0" * 64
    elif tamper == "tiles":
        data["tiles"] = {"g_nonexistent": 4}
    elif tamper == "launch":
        data["launch"]["num_warps"] = 3
    else:
        data["format"] = "napkin-cache/0"
    path.write_text(json.dumps(data))
    again = _fresh()
    np.testing.assert_allclose(again.softcapped(*xs), again.reference(*xs), rtol=1e-5,
                               atol=1e-6)
    assert list(again.softcapped.how.values()) == ["searched"]
    # ... and the entry written again replays
    third = _fresh()
    third.softcapped(*xs)
    assert list(third.softcapped.how.values()) == ["cache"]


def test_shapes_are_compiled_once_each_and_batches_map(cache_dir):
    m = _fresh()
    xs = m.inputs()
    m.softcapped(*xs)
    m.softcapped(*xs)
    batched = [jnp.stack([x, 2 * x]) for x in xs]  # a leading batch axis
    out = m.softcapped(*batched)
    assert out.shape == (2, 37, 16) and len(m.softcapped.how) == 2
    np.testing.assert_allclose(out[1], m.reference(*[b[1] for b in batched]), rtol=1e-5,
                               atol=1e-6)


def test_cache_cli_lists_and_clears(cache_dir, capsys):
    from napkin.cli import main
    m = _fresh()
    m.softcapped(*m.inputs())
    assert main(["cache", "ls"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("softcapped") and "d=16 q=37 x=53" in line
    assert main(["cache", "clear"]) == 0 and "removed 1 entries" in capsys.readouterr().out
    assert main(["cache", "ls"]) == 0 and "no entries" in capsys.readouterr().out


def test_a_bad_option_is_one_line_at_decoration():
    with pytest.raises(NapkinError, match="interpret='bogus'"):
        nk.jit(lambda q: q, interpret="bogus")
