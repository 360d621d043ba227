"""The backward pass, searched: per algorithm, the forward's program and the programs of its
cotangents (napkin.grad, one search per group of inputs with the same axes), their kernels, modelled times and HBM bytes.

    python benchmarks/backward.py                    # the library rows, default sizes
    python benchmarks/backward.py attention gqa      # some rows

For attention, FlashAttention-2's backward traffic at the chosen key tile is counted beside
(Dao 2023, Algorithm 2: K, V read once; Q, dO, L, D read once per key tile; dQ read and
written, in float32, once per key tile; dK, dV written once).
"""
from __future__ import annotations

import sys
import time

ROWS = ["attention", "causal_attention", "gqa", "cross_entropy", "rmsnorm_matmul", "mlp"]


def fa2_bytes(q: int, x: int, d: int, key_tile: int, width: int = 2) -> float:
    """FlashAttention-2's backward HBM bytes for one head (storage ``width`` bytes)."""
    tiles = -(-x // key_tile)
    per_tile = 2 * q * d * width + 2 * q * 4 + 2 * q * d * 4  # Q, dO; L, D; dQ in and out
    return 2 * x * d * width + tiles * per_tile + 2 * x * d * width


def main(argv=None) -> int:
    import napkin as nk
    names = (argv if argv is not None else sys.argv[1:]) or ROWS
    print(f"{'algorithm':18s} {'pass':10s} {'kernels':>7s} {'time s':>10s} {'÷ fwd':>6s} "
          f"{'HBM bytes':>11s} {'search s':>8s}  chain")
    for name in names:
        t = time.perf_counter()
        fwd = nk.optimize(name)
        fs = time.perf_counter() - t
        rows = [("forward", fwd, fs)]
        for wrt, o in _timed_pieces(fwd):
            rows.append((",".join("d" + n for n in wrt),) + o)
        for label, o, s in rows:
            best = o.search.best
            chain = " → ".join(m.rule + (f"({dict(m.params)['axis']})" if "axis" in dict(m.params)
                                         else "") for m in o.chain)
            print(f"{name:18s} {label:10s} {len(best.tiles.launch):7d} {best.time_s:10.3g} "
                  f"{best.time_s / fwd.search.best.time_s:6.2f} {best.tiles.transfers_bytes:11.4g} "
                  f"{s:8.1f}  {chain}")
        total = sum(o.search.best.time_s for _, o, _ in rows[1:])
        print(f"{name:18s} {'backward':10s} {'':7s} {total:10.3g} "
              f"{total / fwd.search.best.time_s:6.2f}")
        if name == "attention":
            sz = fwd.sizes
            key = fwd.backward.pieces[-1][1].tiles.get("g_x", sz["x"])
            fa2 = fa2_bytes(sz["q"], sz["x"], sz["d"], key)
            ours = sum(o.search.best.tiles.transfers_bytes for _, o, _ in rows[1:])
            print(f"  FlashAttention-2's backward at key tile {key}: {fa2:.4g} bytes; napkin's "
                  f"programs {ours:.4g} ({ours / fa2:.2f}×)")
    return 0


def _timed_pieces(fwd):
    t = time.perf_counter()
    pieces = fwd.backward.pieces
    seconds = (time.perf_counter() - t) / max(len(pieces), 1)
    return [(wrt, (o, seconds)) for wrt, o in pieces]


if __name__ == "__main__":
    sys.exit(main())
