"""The device level on a CPU mesh: modelled against counted communication as devices grow.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/devices.py

For attention (searched at q = x = 4096, d = 128 on the H200 profile, run at q = 64, x = 256,
d = 16 in interpret mode) and each strategy napkin prices — a shard of the queries, a ring,
a gather — on 2, 4 and 8 host devices: the bytes one device sends, counted from the
program's collectives (``ppermute``, ``all_gather``), beside the model's link bytes, and
the error against float64; then causal attention's contiguous and zigzag rings the same way.
Not wall time: CPU host devices share the cores.  Then the modelled tables at scale: S = 1M
tokens on 8 H200s, sequence-parallel inputs, attention and causal attention.
"""
from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # host devices before JAX starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> int:
    import jax
    import numpy as np
    from napkin.devices import Strategy, distribute
    from napkin.devices.spmd import communication
    from napkin.frontend.library import get
    big, small = {"q": 4096, "x": 4096, "d": 128}, {"q": 64, "x": 256, "d": 16}
    alg = get("attention")
    xs = [np.asarray(a, np.float32) for a in alg.sample(np.random.default_rng(0), small)]
    with jax.enable_x64(True):
        want = np.asarray(alg.reference(*(np.float64(a) for a in xs)))
    print(f"attention, searched at {big} on H200, run at {small} (interpret mode); "
          f"{len(jax.devices())} host devices")
    print(f"{'strategy':<48} {'counted B':>10} {'modelled B':>10} {'ratio':>6} {'error':>8}")
    for n in (2, 4, 8):
        if n > len(jax.devices()):
            continue
        strategies = [Strategy("shard", n, shard="q"), Strategy("ring", n, shard="q", stream="x"),
                      Strategy("gather", n, stream="x")]
        priced = distribute("attention", "h200", big, "f32", n, strategy=strategies)
        for s in strategies:
            d = priced.choose(s).fit(small)
            k = d.kernel("triton", interpret=True)
            counted = sum(communication(k, *xs).values())
            modelled = d.best.link_bytes
            err = float(np.max(np.abs(np.asarray(k(*xs)) - want)) / np.max(np.abs(want)))
            ratio = f"{counted / modelled:.3f}" if modelled else "-"
            print(f"{str(s):<48} {counted:>10.0f} {modelled:>10.0f} {ratio:>6} {err:>8.1e}")
    # causal attention: the contiguous ring against zigzag order, counted and run the same way
    calg = get("causal_attention")
    cxs = [np.asarray(a, np.float32) for a in calg.sample(np.random.default_rng(1), small)]
    with jax.enable_x64(True):
        cwant = np.asarray(calg.reference(*(np.float64(a) for a in cxs)))
    print(f"\ncausal_attention, the same sizes: contiguous and zigzag rings")
    for n in (2, 4, 8):
        if n > len(jax.devices()):
            continue
        strategies = [Strategy("ring", n, shard="q", stream="x"),
                      Strategy("ring", n, shard="q", stream="x", zigzag=True)]
        priced = distribute("causal_attention", "h200", big, "f32", n, strategy=strategies)
        for s in strategies:
            label = f"{s.kind} over {n}{' (zigzag)' if s.zigzag else ''}"
            p = next(p for p in priced.priced if p.strategy == s)
            if not p.applies:
                print(f"{label:<48} not applicable: {p.why}")
                continue
            d = priced.choose(s).fit(small)
            k = d.kernel("triton", interpret=True)
            counted = sum(communication(k, *cxs).values())
            modelled = d.best.link_bytes
            err = float(np.max(np.abs(np.asarray(k(*cxs)) - cwant)) / np.max(np.abs(cwant)))
            print(f"{label:<48} {counted:>10.0f} {modelled:>10.0f} "
                  f"{counted / modelled:>6.3f} {err:>8.1e}")
    for name in ("attention", "causal_attention"):
        print(f"\nmodelled at scale: {name}, q = x = 2^20, d = 128, bf16, 8 × H200, inputs cut "
              f"along q and x")
        print(distribute(name, "h200", {"q": 2 ** 20, "x": 2 ** 20, "d": 128}, "bf16", 8,
                         arrive=("q", "x")).explain())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
