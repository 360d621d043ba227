"""`napkin run` end to end on every library algorithm, in f32 and bf16, at ragged sizes:
optimise → check the certificate → lower → run (interpret mode) → compare with the
algorithm's own plain-jnp reference.  Every size is odd or not a power of two, so every
kernel pads and masks: whatever program the search returns must lower and run."""
import re

import pytest

from napkin.cli import main
from napkin.frontend.library import LIBRARY
from napkin.pipeline import sizes_for

RAGGED = dict(q=40, x=37, d=20, h=3, k=2, r=3, n=24, v=100, a=40, b=37, c=24, e=40, batch=2,
              f=24)
# the search keeps its first programs (a bound on time, not a different answer: the best
# of the first states it reaches, which the run must lower whatever it is)
MAX_STATES = 40


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_run_every_library_algorithm_at_ragged_sizes(capsys, name, dtype):
    sizes = sizes_for(LIBRARY[name].diagram(), {a: RAGGED[a] for a in RAGGED
                                                if a in _axes(name)})
    argv = ["run", name, "--dtype", dtype, "--max-states", str(MAX_STATES)]
    for a, n in sizes.items():
        argv += ["--size", f"{a}={n}"]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, out + err
    assert "certificate: verified" in out
    m = re.search(r"max relative error vs reference (\S+) \(tolerance (\S+)\)", out)
    assert m and float(m.group(1)) <= float(m.group(2)), out


def _axes(name):
    from napkin.certify.certificate import size_symbols
    return size_symbols(LIBRARY[name].diagram())
