"""Every program a search reaches that the lowering says it can write, lowers and runs: not
just the best, but programs of several kernels, groups inside a kernel's body, streams over
values a kernel computes, at ragged sizes (every whole axis padded).  A sample of each
search's states, of distinct structure, is lowered with its own tiles and compared with the
algorithm's meaning in float64 (``benchmarks/lower_all.py`` runs every state)."""
import numpy as np
import pytest

import napkin as nk
from napkin import ops
from napkin.frontend.library import get
from napkin.lower import lower
from napkin.lower.plan import unlowerable
from napkin.frontend.sampling import sample
from napkin.search import search
from napkin.core.semantics import evaluate

a, b, c, d = nk.axes("a b c d")


@nk.algorithm(A=(a, b), B=(b, c), C=(c, d))
def gemm_chain(A, B, C):
    return ops.contract(ops.contract(A, B, out=(a, c)), C, out=(a, d))


CASES = {
    "attention": (get("attention").diagram(), dict(q=40, x=37, d=20)),
    "rmsnorm_matmul": (get("rmsnorm_matmul").diagram(), dict(n=24, d=20, e=40)),
    "gemm_chain": (gemm_chain, dict(a=40, b=37, c=24, d=20)),
}
PER_SEARCH = 8


def sampled_states(diagram, sizes):
    """Up to PER_SEARCH feasible, writable states, each of another structure (the rules and
    axes of its chain, in order), longest chains first."""
    r = search(diagram, "h100", sizes, "f32", max_states=200)
    states = [r.graph.nodes[n]["state"] for n in sorted(r.graph.nodes)]
    seen, out = set(), []
    for s in sorted(states, key=lambda s: -len(s.chain)):
        shape = tuple((m.rule, m.params_dict.get("axis"), m.site.path) for m in s.chain)
        if s.feasible and not s.unlowerable and shape not in seen:
            seen.add(shape)
            out.append(s)
    return out[:PER_SEARCH]


@pytest.mark.parametrize("name", sorted(CASES))
def test_searched_programs_lower_and_match(name):
    diagram, sizes = CASES[name]
    states = sampled_states(diagram, sizes)
    assert len(states) >= 4, name
    xs = sample(diagram, sizes, np.random.default_rng(0))
    want = np.asarray(evaluate(diagram)(*xs), np.float64)
    kinds = set()
    for s in states:
        assert unlowerable(s.program) == ""
        kernel = lower(s.program, {k: int(v) for k, v in s.tile_values.items()},
                       interpret=True, hardware="h100")
        got = np.asarray(kernel(*[np.asarray(x, np.float32) for x in xs]), np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, (name, [str(m) for m in s.chain], err)
        kinds.add(type(kernel).__name__)
    if name == "gemm_chain":  # the two products as two kernels, the product between in HBM
        assert "LoweredProgram" in kinds
