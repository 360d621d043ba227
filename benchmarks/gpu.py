"""GPU benchmark: napkin's generated kernels (backend auto, and Triton and Mosaic GPU each)
against jax.nn.dot_product_attention (xla, cudnn), JAX's bundled Pallas `mha` and jnp.dot, at
shapes that fill the chip; FP8 Q/K attention against its own bf16; a tile sweep that sets the
launch model's time beside the measured one; and the paper's hypothesis: a sweep of the query
rows per block (w_q = 64, 128, 192, 256 on Mosaic's consumer warpgroups) against the Hopper
derivation's roofline (compute-bound only from 206 rows on an H200).

    python benchmarks/gpu.py              # on a GPU machine: everything, within --budget s
    python benchmarks/gpu.py --cpu-smoke  # tiny sizes in interpret mode (CI keeps it working)

Every napkin kernel comes from the pipeline: search the plain diagram for the device's
profile (attention as multi-head attention over B·H heads, so the model sees the whole
grid), lower the best program with its tiles and launch parameters, run it over the heads
with jax.vmap (Pallas adds a grid axis).  Each case is measured for at most --case-cap
seconds; cases left when --budget runs out are listed as skipped.  Prints a table and
writes benchmarks/results/<gpu>-<date>.json (rows, sweep, command, devices).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from napkin.frontend.library import get
from napkin.pipeline import optimize

RESULTS = Path(__file__).parent / "results"


class Clock:
    """The run's budget: a case starts only while time is left."""

    def __init__(self, budget_s: float, cap_s: float):
        self.end, self.cap = time.perf_counter() + budget_s, cap_s

    def left(self) -> float:
        return self.end - time.perf_counter()


def timeit(f, *args, cap_s: float, reps: int = 20) -> float:
    """Seconds per call: one warm-up (compiles), then up to ``reps`` calls within ``cap_s``."""
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    n = max(1, min(reps, int(cap_s / max(first, 1e-9))))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


@functools.lru_cache(maxsize=None)
def searched(name, hw, sizes: tuple, dtype, max_states=2000):
    """napkin.optimize, once per algorithm and sizes: the cases and the sweep share it."""
    return optimize(name, hw, dict(sizes), dtype, max_states=max_states)


def at_tiles(opt, tiles):
    """``opt`` at other tiles: the model's time there and the launch it chooses with them."""
    from napkin.cost.optimize import optimize_tiles
    t = optimize_tiles(opt.cost, sizes={**opt.sizes, **opt.tiles, **tiles})
    return t.time_s, {k: t.launch[0][k] for k in ("num_warps", "num_stages")}


def attention_kernel(heads, S, D, causal, hw, dtype, interpret, tiles=None, backend="auto"):
    """napkin's attention over ``heads`` heads: tiles and launch from the multi-head search
    (the model sees the whole grid), the single-head kernel vmapped over the heads."""
    opt = searched("mha", hw, (("h", heads), ("q", S), ("x", S), ("d", D)), dtype)
    name = "causal_attention" if causal else "attention"
    single = searched(name, hw, (("q", S), ("x", S), ("d", D)), dtype, 50)
    model, launch = (opt.search.best.tiles.time_s, opt.launch) if tiles is None \
        else at_tiles(opt, tiles)
    chosen = {t: v for t, v in {**opt.tiles, **(tiles or {})}.items() if t in single.tiles}
    run = dataclasses.replace(single, tiles={**single.tiles, **chosen}, launch=launch)
    return (jax.jit(jax.vmap(run.kernel(backend, interpret=interpret))), model,
            {**run.tiles, **launch})


def attention_cases(smoke):
    if smoke:
        return [dict(B=1, H=2, S=64, D=32, causal=False), dict(B=1, H=2, S=64, D=32, causal=True)]
    return [dict(B=4, H=16, S=s, D=d, causal=c) for d in (128, 64)
            for s in (4096, 1024, 16384, 2048, 8192) for c in (False, True)]


def bench_attention(case, a, clock, rows):
    B, H, S, D, causal = (case[k] for k in ("B", "H", "S", "D", "causal"))
    heads = B * H
    label = f"attention B={B} H={H} S={S} D={D}{' causal' if causal else ''}"
    k, modelled, tiles = attention_kernel(heads, S, D, causal, a.hardware, a.dtype, a.interpret)
    rng = np.random.default_rng(0)
    Q, K, V = (jnp.asarray(rng.standard_normal((heads, S, D)), a.dt) for _ in range(3))
    ref = jax.vmap(get("causal_attention" if causal else "attention").reference)(
        *(x[:2].astype(jnp.float32) for x in (Q, K, V)))
    err = lambda f: rel_err(f(Q, K, V)[:2], ref)  # noqa: E731
    flops = 4 * heads * S * S * D / (2 if causal else 1)
    impls = {"napkin": k}
    if not a.smoke:
        for backend in ("triton", "mosaic"):
            impls[f"napkin-{backend}"] = attention_kernel(heads, S, D, causal, a.hardware,
                                                          a.dtype, a.interpret,
                                                          backend=backend)[0]
        bshd = lambda x: x.reshape(B, H, S, D).transpose(0, 2, 1, 3)  # noqa: E731
        for impl in ("xla", "cudnn"):
            impls[f"dpa-{impl}"] = jax.jit(lambda q, k_, v, impl=impl: jax.nn.dot_product_attention(
                bshd(q), bshd(k_), bshd(v), is_causal=causal, implementation=impl))
        try:
            from jax.experimental.pallas.ops.gpu.attention import mha
            impls["pallas-mha"] = jax.jit(lambda q, k_, v: mha(
                bshd(q), bshd(k_), bshd(v), None, causal=causal, sm_scale=D ** -0.5))
        except Exception as e:  # noqa: BLE001 - report, don't fail the table
            print(f"  (pallas mha unavailable: {e})")
    measure(label, impls, (Q, K, V), flops, err, modelled, tiles, a, clock, rows)


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def measure(label, impls, args, flops, err, modelled, tiles, a, clock, rows):
    """One row per implementation; every napkin kernel's error is checked (``err``: a float,
    or a function of the implementation), the auto one's time set beside the model's."""
    for impl, f in impls.items():
        row = {"case": label, "impl": impl}
        try:
            t = timeit(f, *args, cap_s=clock.cap, reps=1 if a.smoke else 20)
            row.update(ms=t * 1e3, tflops=flops / t / 1e12)
            if impl.startswith("napkin"):
                row.update(max_err=err(f) if callable(err) else err)
            if impl == "napkin":
                row.update(model_ms=modelled * 1e3, measured_over_model=t / modelled,
                           tiles=tiles)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the table
            row.update(failed=f"{type(e).__name__}: {str(e)[:120]}")
        rows.append(row)


def matmul_kernel(n, hw, dtype, interpret, tiles=None, backend="auto"):
    opt = searched("matmul", hw, (("a", n), ("b", n), ("c", n)), dtype)
    model, launch = (opt.search.best.tiles.time_s, opt.launch) if tiles is None \
        else at_tiles(opt, tiles)
    run = dataclasses.replace(opt, tiles={**opt.tiles, **(tiles or {})}, launch=launch)
    return run.kernel(backend, interpret=interpret), model, {**run.tiles, **launch}


def bench_matmul(n, a, clock, rows):
    k, modelled, tiles = matmul_kernel(n, a.hardware, a.dtype, a.interpret)
    rng = np.random.default_rng(1)
    A, B = (jnp.asarray(rng.standard_normal((n, n)), a.dt) for _ in range(2))
    ref = A.astype(jnp.float32) @ B.astype(jnp.float32)
    err = lambda f: rel_err(f(A, B), ref)  # noqa: E731
    impls = {"napkin": k}
    if not a.smoke:
        for backend in ("triton", "mosaic"):
            impls[f"napkin-{backend}"] = matmul_kernel(n, a.hardware, a.dtype, a.interpret,
                                                       backend=backend)[0]
        impls["jnp.dot"] = jax.jit(jnp.dot)
    measure(f"matmul {n}^3", impls, (A, B), 2 * n ** 3, err, modelled, tiles, a, clock, rows)


def bench_gqa(a, clock, rows):
    sizes = dict(k=2, r=2, q=64, x=64, d=32) if a.smoke else dict(k=8, r=4, q=4096, x=4096,
                                                                   d=128)
    opt = searched("gqa", a.hardware, tuple(sizes.items()), a.dtype, 150)
    k = opt.kernel(interpret=a.interpret)
    alg = get("gqa")
    xs = [jnp.asarray(x, a.dt) for x in alg.sample(np.random.default_rng(2), sizes)]
    ref = alg.reference(*(x.astype(jnp.float32) for x in xs))
    err = float(jnp.max(jnp.abs(k(*xs).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    flops = 4 * sizes["k"] * sizes["r"] * sizes["q"] * sizes["x"] * sizes["d"]
    measure(f"gqa {sizes['k'] * sizes['r']}:{sizes['k']}", {"napkin": k}, xs, flops, err,
            opt.search.best.tiles.time_s, {**opt.tiles, **opt.launch}, a, clock, rows)


def mosaic_attention(heads, S, D, g_q, s_x, hw, dtypes=("bf16", "bf16", "bf16")):
    """Mosaic GPU attention over ``heads`` heads (the multi-head program, heads on the grid) at
    g_q query rows per block and chunks of s_x; ``dtypes``: Q, K, V as declared (FP8 Q/K is
    the paper's configuration)."""
    import napkin
    from napkin import ops
    from napkin.lower import lower
    h, q, x, d = napkin.axes("h q x d")

    @napkin.algorithm(Q=napkin.Array(h, q, d, dtype=dtypes[0]),
                      K=napkin.Array(h, x, d, dtype=dtypes[1]),
                      V=napkin.Array(h, x, d, dtype=dtypes[2]))
    def mha_typed(Q, K, V):
        s_ = ops.scale(ops.contract(Q, K, out=(h, q, x)), D ** -0.5)
        return ops.contract(ops.softmax(s_, x), V, out=(h, q, d))
    r = optimize(mha_typed, hw, {"h": heads, "q": S, "x": S, "d": D}, None, max_states=300)
    tiles = {t: (g_q if t == "g_q" else s_x if t == "s_x" else 1 if t == "g_h" else v)
             for t, v in r.tiles.items()}
    return lower(r.program, tiles, backend="mosaic", schedule=r.schedule), tiles  # (jitted)


def sweep_rows(a, clock) -> list:
    """The paper's hypothesis on Mosaic's warp-specialised kernel: measured TFLOP/s against
    the Hopper derivation's min(compute roof, HBM roof) over the query rows per block."""
    from napkin.views.hopper import hopper_attention_config
    heads, S, D = (1, 128, 64) if a.smoke else (32, 8192, 128)
    cfg = hopper_attention_config(a.hardware, w_q=64, s_x=64, d=D,
                                  dtypes={"Q": "bf16", "K": "bf16", "V": "bf16"})
    out = []
    for g_q in ((128,) if a.smoke else (64, 128, 192, 256)):
        row = {"kind": "rows", "g_q": g_q, "model_tflops": cfg.expected_flops_per_s(g_q) / 1e12,
               "compute_bound_from": cfg.compute_bound_g_q}
        if clock.left() <= clock.cap:
            out.append({**row, "skipped": "budget"})
            continue
        try:
            k, tiles = mosaic_attention(heads, S, D, g_q, 64, a.hardware)
            args = [jnp.ones((heads, S, D), jnp.bfloat16)] * 3
            interp = {"interpret": True} if a.smoke else {}
            t = timeit(lambda *xs: k(*xs, **interp), *args, cap_s=clock.cap,
                       reps=1 if a.smoke else 10)
            out.append({**row, "tiles": tiles, "ms": t * 1e3,
                        "tflops": 4 * heads * S * S * D / t / 1e12})
        except Exception as e:  # noqa: BLE001 - a refused tiling is data too
            out.append({**row, "failed": f"{type(e).__name__}: {str(e)[:160]}"})
    return out


def bench_fp8(a, clock, rows):
    """FP8 (e4m3) Q and K with bf16 V against the same kernel in bf16 (target: >= 1.3x)."""
    heads, S, D = (1, 128, 64) if a.smoke else (32, 8192, 128)
    flops = 4 * heads * S * S * D
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((heads, S, D)) for _ in range(3)]
    for label, dts in (("bf16", ("bf16",) * 3), ("fp8 Q/K", ("fp8", "fp8", "bf16"))):
        k, tiles = mosaic_attention(heads, S, D, 128, 64, a.hardware, dts)
        jdt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
        args = [jnp.asarray(x, jdt[t]) for x, t in zip(xs, dts)]
        # the reference of the inputs as stored (FP8 rounds Q and K by up to 6 %)
        ref = jax.vmap(get("attention").reference)(*(x[:2].astype(jnp.float32) for x in args))
        call = (lambda *v: k(*v, interpret=True)) if a.smoke else k
        err = rel_err(call(*args)[:2], ref)
        measure(f"attention {label} H={heads} S={S} D={D} (mosaic)", {"napkin-mosaic": call},
                args, flops, err, float("nan"), tiles, a, clock, rows)


def sweep(a, clock) -> list:
    """Model time against measured time over ~30 tilings of attention (d = 128, S = 4096,
    64 heads) and matmul 4096^3: the data a CPU test ranks the model by."""
    out = []
    if a.smoke:
        points = [("matmul", 64, dict(g_a=64, g_c=64, s_b=32))]
    else:
        points = [("attention", 4096, dict(g_q=q, s_x=s)) for q in (64, 128, 256)
                  for s in (32, 64, 128, 256)]
        points += [("matmul", 4096, dict(g_a=m, g_c=c, s_b=s)) for m in (64, 128, 256)
                   for c in (128, 256) for s in (32, 64, 128)]
    for kind, n, tiles in points:
        if clock.left() <= clock.cap:
            out.append({"kind": kind, "tiles": tiles, "skipped": "budget"})
            continue
        try:
            if kind == "attention":
                k, model, used = attention_kernel(64, n, 128, False, a.hardware, a.dtype,
                                                  a.interpret, tiles)
                args = [jnp.ones((64, n, 128), a.dt)] * 3
            else:
                k, model, used = matmul_kernel(n, a.hardware, a.dtype, a.interpret, tiles)
                args = [jnp.ones((n, n), a.dt)] * 2
            t = timeit(k, *args, cap_s=clock.cap, reps=1 if a.smoke else 10)
            out.append({"kind": kind, "tiles": used, "model_s": model, "measured_s": t})
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is data too
            out.append({"kind": kind, "tiles": tiles, "failed": f"{type(e).__name__}: "
                                                               f"{str(e)[:120]}"})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--case-cap", type=float, default=2.0, help="seconds measuring one case")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--out", default=None, help="JSON file (default: results/<gpu>-<date>.json)")
    a = p.parse_args(argv)
    a.smoke = a.cpu_smoke
    a.interpret = True if a.smoke else "auto"
    a.dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    clock = Clock(a.budget, a.case_cap)
    device = jax.devices()[0]
    print(f"devices: {jax.devices()}; jax {jax.__version__}; hardware model {a.hardware}")
    rows, failed, skipped = [], 0, []
    runs = [(f"matmul {n}", lambda n=n: bench_matmul(n, a, clock, rows))
            for n in ((64,) if a.smoke else (4096, 8192))]
    runs += [(str(case), lambda case=case: bench_attention(case, a, clock, rows))
             for case in attention_cases(a.smoke)]
    runs += [("gqa", lambda: bench_gqa(a, clock, rows)), ("fp8", lambda: bench_fp8(a, clock, rows))]
    for label, run in runs:  # each case on its own: one failure must not lose the others
        if clock.left() <= 0:
            skipped.append(label)
            continue
        done = len(rows)
        try:
            run()
        except Exception as e:  # noqa: BLE001 - report it and go on
            failed += 1
            print(f"  case failed: {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        for r in rows[done:]:
            print("  " + json.dumps(r), flush=True)
    points = [] if a.no_sweep else sweep(a, clock) + sweep_rows(a, clock)
    head = ("case", "impl", "max err", "ms", "TFLOP/s", "model ms", "meas/model", "tiles, launch")
    table = [(r["case"], r["impl"], f"{r['max_err']:.1e}" if "max_err" in r else "",
              f"{r['ms']:.3f}" if "ms" in r else r.get("failed", ""),
              f"{r['tflops']:.1f}" if "tflops" in r else "",
              f"{r['model_ms']:.3f}" if "model_ms" in r else "",
              f"{r['measured_over_model']:.2f}" if "measured_over_model" in r else "",
              str(r.get("tiles", ""))) for r in rows]
    widths = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    for r in [head, *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    for p_ in points:
        if p_.get("kind") == "rows":
            print(f"rows per block {p_['g_q']}: measured "
                  + (f"{p_['tflops']:.1f}" if "tflops" in p_ else p_.get("failed", p_.get(
                      "skipped", "?")))
                  + f" TFLOP/s; the Hopper derivation's roofline {p_['model_tflops']:.0f} "
                  f"(compute-bound from {p_['compute_bound_from']:.0f} rows)")
    if skipped:
        print(f"skipped (budget {a.budget:g} s spent): {', '.join(skipped)}")
    if not a.smoke:
        kind = getattr(device, "device_kind", device.platform).replace(" ", "_")
        path = Path(a.out) if a.out else RESULTS / f"{kind}-{datetime.date.today()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"command": " ".join(sys.argv), "devices": str(jax.devices()),
                                    "jax": jax.__version__, "hardware_model": a.hardware,
                                    "rows": rows, "sweep": points, "skipped": skipped},
                                   indent=1, default=str))
        print(f"wrote {path}")
    bad = [r for r in rows if r["impl"].startswith("napkin") and r.get("max_err", 0) > 2e-2]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
