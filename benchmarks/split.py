"""Split-K, modelled: per shape, the searched program, whether it splits a stream in parallel
parts, its modelled time against the program before the split (``Optimized.sequential``),
and the blocks each kernel launches.

    python benchmarks/split.py              # the decoding and prefill rows below, on h200
    python benchmarks/split.py --hardware h100
"""
from __future__ import annotations

import argparse
import time

ROWS = [
    ("attention", {"q": 16, "x": 131072, "d": 128}),
    ("causal_attention", {"q": 16, "x": 131072, "d": 128}),
    ("mha", {"h": 32, "q": 1, "x": 65536, "d": 128}),
    ("gqa", {"k": 8, "r": 4, "q": 1, "x": 65536, "d": 128}),
    ("logsumexp", {"n": 16, "v": 262144}),
    ("mha", {"h": 16, "q": 4096, "x": 4096, "d": 128}),   # prefill: fills the chip
    ("attention", {"q": 4096, "x": 4096, "d": 128}),      # single-head prefill: left unsplit
]


def main(argv=None) -> int:
    import napkin as nk
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h200")
    args = ap.parse_args(argv)
    print(f"{'algorithm':17s} {'sizes':34s} {'split':>5s} {'time s':>10s} {'sequential':>10s} "
          f"{'ratio':>6s} {'blocks':>12s} {'search s':>8s}  tiles")
    for name, sizes in ROWS:
        t = time.perf_counter()
        opt = nk.optimize(name, args.hardware, sizes)
        took = time.perf_counter() - t
        seq = opt.sequential
        best = opt.search.best
        blocks = "+".join(str(k["blocks"]) for k in best.tiles.launch)
        before = seq.search.best.time_s if seq is not None else None
        print(f"{name:17s} {','.join(f'{k}={v}' for k, v in sizes.items()):34s} "
              f"{'yes' if seq is not None else 'no':>5s} {best.time_s:10.3e} "
              + (f"{before:10.3e} {before / best.time_s:5.1f}x" if before else f"{'-':>10s} {'-':>6s}")
              + f" {blocks:>12s} {took:8.1f}  "
              + ", ".join(f"{k}={v}" for k, v in opt.tiles.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
