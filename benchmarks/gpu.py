"""GPU benchmark: correctness and TFLOP/s of napkin's generated kernels against
jax.nn.dot_product_attention (xla, cudnn), JAX's bundled Pallas `mha`, and jnp.dot.

    python benchmarks/gpu.py              # on a GPU machine: the full table
    python benchmarks/gpu.py --cpu-smoke  # tiny sizes in interpret mode (CI keeps it working)

Every napkin kernel comes from the pipeline: search the plain diagram for the
device's profile, lower the best program with its tiles, run.  Prints, per case:
max error vs a float32 reference, measured time and TFLOP/s for each
implementation, and napkin's modelled time (ratio measured / modelled).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from napkin.library import get
from napkin.pipeline import optimize


def timeit(f, *args, reps=10):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def napkin_kernel(name, sizes, hw, dtype, interpret):
    """The optimiser's program for ``name`` as a kernel (napkin.optimize), its modelled time,
    and its tiles with the launch parameters the kernel was written with."""
    opt = optimize(name, hw, sizes, dtype)
    k = opt.kernel(interpret=interpret)
    shapes = [tuple(opt.sizes[a.name] for a in ob.type.axes) for ob in opt.algorithm.dom.inside]
    model = opt.cost.evaluate({**opt.sizes, **opt.tiles})
    return k, model["time_s"]["total"], {**opt.tiles, **k.plan(*shapes).launch}


def attention_cases(smoke):
    if smoke:
        return [dict(S=64, D=32, causal=False), dict(S=64, D=32, causal=True)]
    return [dict(S=s, D=d, causal=c) for d in (64, 128) for s in (512, 2048, 8192, 16384)
            for c in (False, True)]


def bench_attention(case, hw, dtype, interpret, smoke, rows):
    S, D, causal = case["S"], case["D"], case["causal"]
    name = "causal_attention" if causal else "attention"
    sizes = dict(q=S, x=S, d=D)
    k, modelled, tiles = napkin_kernel(name, sizes, hw, dtype, interpret)
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    Q, K, V = (jnp.asarray(rng.standard_normal((S, D)), dt) for _ in range(3))
    ref = get(name).reference(*(x.astype(jnp.float32) for x in (Q, K, V)))
    out = k(Q, K, V)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    flops = 4 * S * S * D / (2 if causal else 1)
    impls = {"napkin": lambda q, k_, v: k(q, k_, v)}
    if not smoke:
        for impl in ("xla", "cudnn"):
            impls[f"dpa-{impl}"] = jax.jit(lambda q, k_, v, impl=impl: jax.nn.dot_product_attention(
                q[None, :, None], k_[None, :, None], v[None, :, None], is_causal=causal,
                implementation=impl)[0, :, 0])
        try:
            from jax.experimental.pallas.ops.gpu.attention import mha
            impls["pallas-mha"] = jax.jit(lambda q, k_, v: mha(
                q[None, :, None], k_[None, :, None], v[None, :, None], None, causal=causal)[0, :, 0])
        except Exception as e:  # noqa: BLE001 - report, don't fail the table
            print(f"  (pallas mha unavailable: {e})")
    for label, f in impls.items():
        try:
            t = timeit(f, Q, K, V, reps=1 if smoke else 20)
            rows.append((f"attention S={S} D={D}{' causal' if causal else ''}", label,
                         f"{err:.1e}" if label == "napkin" else "", f"{t * 1e3:.3f}",
                         f"{flops / t / 1e12:.1f}", f"{modelled * 1e3:.3f}" if label == "napkin" else "",
                         f"{t / modelled:.2f}" if label == "napkin" else "",
                         str(tiles) if label == "napkin" else ""))
        except Exception as e:  # noqa: BLE001
            rows.append((f"attention S={S} D={D}", label, "", "failed", str(e)[:40], "", "", ""))


def bench_matmul(n, hw, dtype, interpret, smoke, rows):
    sizes = dict(a=n, b=n, c=n)
    k, modelled, tiles = napkin_kernel("matmul", sizes, hw, dtype, interpret)
    rng = np.random.default_rng(1)
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    A, B = (jnp.asarray(rng.standard_normal((n, n)), dt) for _ in range(2))
    ref = A.astype(jnp.float32) @ B.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(k(A, B).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    impls = {"napkin": k}
    if not smoke:
        impls["jnp.dot"] = jax.jit(jnp.dot)
    for label, f in impls.items():
        t = timeit(f, A, B, reps=1 if smoke else 20)
        rows.append((f"matmul {n}³", label, f"{err:.1e}" if label == "napkin" else "",
                     f"{t * 1e3:.3f}", f"{2 * n ** 3 / t / 1e12:.1f}",
                     f"{modelled * 1e3:.3f}" if label == "napkin" else "",
                     f"{t / modelled:.2f}" if label == "napkin" else "",
                     str(tiles) if label == "napkin" else ""))


def bench_gqa(smoke, hw, dtype, interpret, rows):
    sizes = dict(k=2, r=2, q=64, x=64, d=32) if smoke else dict(k=8, r=4, q=4096, x=4096, d=128)
    k, modelled, tiles = napkin_kernel("gqa", sizes, hw, dtype, interpret)
    alg = get("gqa")
    xs = [jnp.asarray(x, jnp.bfloat16 if dtype == "bf16" else jnp.float32)
          for x in alg.sample(np.random.default_rng(2), sizes)]
    ref = alg.reference(*(x.astype(jnp.float32) for x in xs))
    err = float(jnp.max(jnp.abs(k(*xs).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    t = timeit(k, *xs, reps=1 if smoke else 20)
    flops = 4 * sizes["k"] * sizes["r"] * sizes["q"] * sizes["x"] * sizes["d"]
    rows.append((f"gqa {sizes['k'] * sizes['r']}:{sizes['k']}", "napkin", f"{err:.1e}",
                 f"{t * 1e3:.3f}", f"{flops / t / 1e12:.1f}", f"{modelled * 1e3:.3f}",
                 f"{t / modelled:.2f}", str(tiles)))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--dtype", default="bf16")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    interpret = True if smoke else "auto"
    print(f"devices: {jax.devices()}; jax {jax.__version__}; hardware model {a.hardware}")
    rows = []
    runs = [lambda: bench_matmul(64 if smoke else 4096, a.hardware, a.dtype, interpret, smoke, rows)]
    runs += [lambda case=case: bench_attention(case, a.hardware, a.dtype, interpret, smoke, rows)
             for case in attention_cases(smoke)]
    runs += [lambda: bench_gqa(smoke, a.hardware, a.dtype, interpret, rows)]
    failed = 0
    for run in runs:  # each case on its own: one failure must not lose the others' rows
        done = len(rows)
        try:
            run()
        except Exception as e:  # noqa: BLE001 - report it and go on
            failed += 1
            print(f"  case failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        for r in rows[done:]:
            print("  " + " | ".join(map(str, r)), flush=True)
    head = ("case", "impl", "max err", "ms", "TFLOP/s", "model ms", "meas/model", "tiles, launch")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    bad = [r for r in rows if r[1] == "napkin" and r[2] and float(r[2]) > 2e-2]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
