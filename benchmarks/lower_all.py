"""Lower and run every program a search reaches (not only the best), at ragged sizes.

    python benchmarks/lower_all.py [NAME ...] [--max-states N]

For each library algorithm named (default: a handful), the search's every feasible state
whose program the lowering says it can write is lowered with its own tiles, run in
interpret mode and compared with the algorithm's meaning in float64.  Prints one line per
algorithm: states, written, failures (with the first failure's chain and error).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from napkin.frontend.library import LIBRARY
from napkin.lower import lower
from napkin.frontend.sampling import sample
from napkin.search import search
from napkin.core.semantics import evaluate

RAGGED = dict(q=40, x=37, d=20, h=3, k=2, r=3, n=24, v=100, a=40, b=37, c=24, e=40, batch=2,
              f=24)
DEFAULT = ["attention", "causal_attention", "rmsnorm_matmul", "cross_entropy", "mlp", "gqa"]


def campaign(name: str, max_states: int) -> tuple:
    from napkin.certify.certificate import size_symbols
    diagram = LIBRARY[name].diagram()
    sizes = {a: RAGGED[a] for a in size_symbols(diagram)}
    r = search(diagram, "h100", sizes, "f32", max_states=max_states)
    xs = sample(diagram, sizes, np.random.default_rng(0))
    want = np.asarray(evaluate(diagram)(*xs), np.float64)
    states = [r.graph.nodes[n]["state"] for n in r.graph.nodes]
    writable = [s for s in states if s.feasible and not s.unlowerable]
    failures = []
    for s in writable:
        try:
            kernel = lower(s.program, {k: int(v) for k, v in s.tile_values.items()},
                           interpret=True)
            got = np.asarray(kernel(*[np.asarray(x, np.float32) for x in xs]), np.float64)
            err = np.abs(got - want).max() / np.abs(want).max()
            if not err < 1e-5:
                failures.append((s, f"relative error {err:.2e}"))
        except Exception as e:  # noqa: BLE001 - a campaign reports every failure
            failures.append((s, f"{type(e).__name__}: {e}"))
    return len(states), len(writable), failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", default=DEFAULT)
    p.add_argument("--max-states", type=int, default=300)
    args = p.parse_args()
    print(f"{'algorithm':24} {'states':>6} {'written':>7} {'failed':>6} {'s':>6}")
    for name in args.names:
        t0 = time.perf_counter()
        n, w, failures = campaign(name, args.max_states)
        print(f"{name:24} {n:6} {w:7} {len(failures):6} {time.perf_counter() - t0:6.0f}")
        for s, why in failures[:3]:
            print("   ", " → ".join(str(m) for m in s.chain), "|", why[:300])


if __name__ == "__main__":
    main()
