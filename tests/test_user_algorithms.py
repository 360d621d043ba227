"""Algorithms not in the library (tests/user_algorithms.py: sigmoid, QK-norm and linear
attention, soft-capped causal GQA, a GEMM chain, attention with its softmax written by hand)
end to end at ragged sizes: through `napkin run --from FILE:NAME` in f32 and bf16
(optimise → check → lower → run → compare with the file's own reference), and through
the Python API (napkin.optimize → kernel → compare)."""
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import napkin
from napkin.certify.certificate import size_symbols
from napkin.cli import main

import user_algorithms

FILE = pathlib.Path(user_algorithms.__file__)
RAGGED = dict(q=40, x=37, d=20, k=2, r=3, a=40, b=37, c=24, e=20)
NAMES = sorted(user_algorithms.ALGORITHMS)


def sizes_of(name):
    return {s: RAGGED[s] for s in size_symbols(user_algorithms.ALGORITHMS[name].diagram())}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_napkin_run_from_a_file(capsys, name, dtype):
    argv = ["run", "--from", f"{FILE}:{name}", "--dtype", dtype, "--max-states", "60"]
    for s, n in sizes_of(name).items():
        argv += ["--size", f"{s}={n}"]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, out + err
    m = re.search(r"max relative error vs reference (\S+) \(tolerance (\S+)\)", out)
    assert "certificate: verified" in out and m and float(m.group(1)) <= float(m.group(2)), out


@pytest.mark.parametrize("name", NAMES)
def test_python_api(name):
    alg = user_algorithms.ALGORITHMS[name]
    sizes = sizes_of(name)
    opt = napkin.optimize(alg, sizes=sizes, dtype="f32", max_states=60)
    xs = alg.sample(np.random.default_rng(1), sizes)
    got = np.asarray(opt.kernel(interpret=True)(*[jnp.asarray(v, jnp.float32) for v in xs]))
    want = np.asarray(alg.reference(*xs), np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), [str(m) for m in opt.chain]
