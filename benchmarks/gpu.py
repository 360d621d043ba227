"""GPU benchmark, sized for one 8-minute device run: napkin's generated kernels against the
references users compare with — cuDNN (``jax.nn.dot_product_attention(implementation=
"cudnn")``), JAX's bundled Pallas ``mha``, XLA, ``jnp.dot`` — each napkin row with its ratio
to the reference and the goal beside it, most valuable cases first.

    python benchmarks/gpu.py                       # every case, in order, within --budget s
    python benchmarks/gpu.py --cases attention,causal,backward
    python benchmarks/gpu.py --cpu-smoke           # tiny sizes in interpret mode (CI runs it)

Cases, in the order a run takes them (``--cases`` picks and orders):

==========  ======================================================  ==========================
attention   B=4 H=16 S=4096 D=128, bf16                             ≥ 0.9× cuDNN
causal      the same, causal                                        ≥ 0.85× cuDNN causal
gqa         32 query heads on 8 KV heads, S=4096 D=128              ≥ 0.9× cuDNN (GQA)
backward    attention forward + backward (jax.grad), S=4096 D=128   ≥ 0.7× jax.grad of cuDNN
fp8         FP8 Q, K, V; FP8 Q/K, bf16 V: against the same in bf16  ≥ 1.3× its bf16
decode      q = 1 and 16 queries, x = 128k keys, 32 heads (split-K)  against cuDNN
matmul      4096³ and 8192³                                          ≥ 0.9× jnp.dot
sweep       ~30 tilings of attention and matmul: model vs measured  Spearman ≥ 0.8
rows        query rows per block 64…256 at S = 12288 (192 and 256   the Hopper derivation's
            divide it) on Mosaic's consumer warpgroups               roofline
shapes      attention at D = 64/128, S = 1k…16k, causal or not      ≥ 0.9× cuDNN
==========  ======================================================  ==========================

Every row is printed and written to the JSON (``--out``, default
``benchmarks/results/<gpu>-<date>.json``: rows, sweep, command, devices, what was skipped)
the moment it is measured, so a run cut short keeps what it measured.  A case starts only
while ``--budget`` lasts; the napkin row says which backend ``auto`` chose (and why not
Mosaic GPU where it chose Triton).  ``dpa-xla`` is skipped where its logits (B·H·S² f32)
would not fit in a quarter of the device's memory.  Every napkin kernel is checked against
the plain-jnp reference (relative error ≤ 2e-2 in bf16, else the run exits 1).

On the device machine (it has JAX, sympy, networkx and matplotlib, not discopy): carry the
discopy wheel, see the README's "On a GPU" paragraph for the exact command.
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
TOLERANCE = 2e-2            # a napkin kernel's relative error against the reference (bf16)
FP8_P_TOLERANCE = 1e-1      # ... where P itself is rounded to e4m3 (up to 6 % an element)

# case -> (the reference its napkin rows are set against, the least ratio the issue asks)
GOALS = {"attention": ("dpa-cudnn", 0.9), "causal": ("dpa-cudnn", 0.85),
         "gqa": ("dpa-cudnn", 0.9), "backward": ("dpa-cudnn", 0.7), "fp8": ("bf16", 1.3),
         "decode": ("dpa-cudnn", None), "matmul": ("jnp.dot", 0.9),
         "shapes": ("dpa-cudnn", 0.9)}
ORDER = ("attention", "causal", "gqa", "backward", "fp8", "decode", "matmul", "sweep", "rows",
         "shapes")


class Clock:
    """The run's budget: a case starts only while time is left."""

    def __init__(self, budget_s: float, cap_s: float):
        self.end, self.cap = time.perf_counter() + budget_s, cap_s

    def left(self) -> float:
        return self.end - time.perf_counter()


class Record:
    """What the run measured, printed and written to the JSON as each row comes in."""

    def __init__(self, path: Path | None, meta: dict):
        self.path, self.meta = path, meta
        self.rows, self.sweep, self.skipped = [], [], []

    def row(self, row: dict):
        self.rows.append(row)
        print("  " + _line(row), flush=True)
        self.save()

    def point(self, point: dict):
        self.sweep.append(point)
        print("  " + json.dumps(point, default=str), flush=True)
        self.save()

    def save(self):
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({**self.meta, "rows": self.rows, "sweep": self.sweep,
                                         "skipped": self.skipped}, indent=1, default=str))


def _line(r: dict) -> str:
    """A row as one readable line: time, throughput, error, the ratio against the goal."""
    if "failed" in r:
        return f"{r['case']:<44} {r['impl']:<16} failed: {r['failed']}"
    if "skipped" in r:
        return f"{r['case']:<44} {r['impl']:<16} skipped: {r['skipped']}"
    out = f"{r['case']:<44} {r['impl']:<16} {r['ms']:9.3f} ms {r.get('tflops', 0):7.1f} TFLOP/s"
    if "max_err" in r:
        out += f"  err {r['max_err']:.1e}"
        if r.get("tolerance", TOLERANCE) != TOLERANCE:
            out += f" (≤ {r['tolerance']:.0e}: P in e4m3)"
    if "ratio" in r:
        goal = r.get("goal")
        mark = "" if goal is None else (f" (goal ≥ {goal}: {'met' if r['met'] else 'NOT met'})")
        out += f"  {r['ratio']:.2f}× {r['against']}{mark}"
    if "model_ms" in r:
        out += f"  model {r['model_ms']:.3f} ms"
    if "backend" in r:
        out += f"  [{r['backend']}]"
    return out


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


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def measure(case, label, impls, args, flops, a, clock, record, err=None, modelled=None,
            tiles=None, backend=None, tolerance=None):
    """One row per implementation (references first, so a napkin row carries its ratio to
    the case's reference and the goal); every napkin kernel's error is checked (``err``: a
    float, or a function of the implementation) against ``tolerance`` (a float, or a
    function of the implementation; TOLERANCE where None)."""
    against, goal = GOALS.get(case, (None, None))
    times = {}
    for impl, f in sorted(impls.items(), key=lambda kv: kv[0].startswith("napkin")):
        row = {"case": label, "impl": impl}
        if f is None:
            record.row({**row, "skipped": "its logits do not fit in a quarter of the memory"})
            continue
        try:
            t = timeit(f, *args, cap_s=clock.cap, reps=1 if a.smoke else 20)
            times[impl] = t
            row.update(ms=t * 1e3, tflops=flops / t / 1e12)
            if impl.startswith("napkin") and err is not None:
                row.update(max_err=err(f) if callable(err) else err)
                if tolerance is not None:
                    row.update(tolerance=tolerance(f) if callable(tolerance) else tolerance)
            if impl.startswith("napkin") and against in times:
                ratio = times[against] / t
                row.update(ratio=ratio, against=against, goal=goal,
                           met=None if goal is None else bool(ratio >= goal))
            if impl == "napkin" and modelled is not None:
                row.update(model_ms=modelled * 1e3, measured_over_model=t / modelled,
                           tiles=tiles)
            if impl == "napkin" and backend:
                row.update(backend=backend)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the table
            row.update(failed=f"{type(e).__name__}: {str(e)[:160]}")
        record.row(row)


# ----------------------------------------------------------------------------- napkin kernels
STATES = {"most": None}      # --cpu-smoke: small searches (the run checks the code, not the tiles)


@functools.lru_cache(maxsize=None)
def searched(name, hw, sizes: tuple, dtype, max_states=2000):
    """napkin.optimize, once per algorithm and sizes: the cases and the sweep share it."""
    most = STATES["most"]
    return optimize(name, hw, dict(sizes), dtype,
                    max_states=max_states if most is None else min(most, max_states))


def at_tiles(opt, tiles):
    """``opt`` at other tiles: the model's time there and the launch it chooses with them."""
    from napkin.cost.optimize import optimize_tiles
    t = optimize_tiles(opt.cost, sizes={**opt.sizes, **opt.tiles, **tiles})
    return t.time_s, {k: t.launch[0][k] for k in ("num_warps", "num_stages")}


def written_at(opt, tiles, backend):
    """(modelled s, launch, tiles) of ``opt`` for ``backend``: at ``tiles`` where given (the
    Triton model's time), else at the tiles the backend writes (Mosaic GPU's own launch
    model's, where it chooses them)."""
    if tiles is not None:
        model, launch = at_tiles(opt, tiles)
        return model, launch, {**opt.tiles, **tiles}
    _, at, _ = opt.written_at(backend)
    if at == opt.tiles:
        return opt.search.best.tiles.time_s, opt.launch, at
    own = opt.backend_tiles("mosaic")
    return own.time_s, {**opt.launch, "num_stages": own.launch[0]["num_stages"]}, at


def chosen_backend(kernel, shapes) -> str:
    """Which backend wrote the kernel (``auto``: Mosaic GPU on Hopper where it takes it)."""
    from napkin.cli.commands import written_by
    try:
        return written_by(kernel, shapes)
    except Exception as e:  # noqa: BLE001 - the row keeps its time; the reason is data
        return f"? ({type(e).__name__})"


def attention_kernel(heads, S, D, causal, a, tiles=None, backend="auto"):
    """napkin's attention over ``heads`` heads: tiles and launch from the multi-head search
    (the model sees the whole grid), the single-head kernel mapped over the heads (one
    launch: Pallas puts the heads in its grid).  (jitted kernel, modelled s, tiles, backend)"""
    opt = searched("mha", a.hardware, (("h", heads), ("q", S), ("x", S), ("d", D)), a.dtype)
    name = "causal_attention" if causal else "attention"
    single = searched(name, a.hardware, (("q", S), ("x", S), ("d", D)), a.dtype, 50)
    model, launch, at = written_at(opt, tiles, backend)
    # the single-head kernel at the multi-head program's tiles for this backend (set, so
    # that no backend chooses its own again for a program of one head)
    run = dataclasses.replace(single, launch=launch).with_tiles(
        {t: v for t, v in at.items() if t in single.tiles})
    k = run.kernel(backend, interpret=a.interpret)
    return jax.jit(k), model, {**run.tiles, **launch}, \
        chosen_backend(k, [(S, D), (S, D), (S, D)])


def matmul_kernel(n, a, tiles=None, backend="auto"):
    opt = searched("matmul", a.hardware, (("a", n), ("b", n), ("c", n)), a.dtype)
    model, launch, at = written_at(opt, tiles, backend)
    run = dataclasses.replace(opt, launch=launch).with_tiles(
        {t: v for t, v in at.items() if t in opt.tiles})  # (a small run's may have none)
    k = run.kernel(backend, interpret=a.interpret)
    return k, model, {**run.tiles, **launch}, chosen_backend(k, [(n, n), (n, n)])


def mosaic_attention(heads, S, D, g_q, s_x, hw, dtypes=("bf16", "bf16", "bf16")):
    """Mosaic GPU attention over ``heads`` heads (the multi-head program, heads on the grid) at
    g_q query rows per block and chunks of s_x; ``dtypes``: Q, K, V as declared (FP8 Q/K is
    the paper's configuration).  An FP8 V is declared (h, d, x) — an FP8 wgmma reads its B
    K-major — and the output cast to bf16 (FA3's FP8 layout)."""
    import napkin
    from napkin import ops
    from napkin.lower import lower
    h, q, x, d = napkin.axes("h q x d")
    fp8_v = dtypes[2] == "fp8"

    @napkin.algorithm(Q=napkin.Array(h, q, d, dtype=dtypes[0]),
                      K=napkin.Array(h, x, d, dtype=dtypes[1]),
                      V=napkin.Array(*((h, d, x) if fp8_v else (h, x, d)), dtype=dtypes[2]))
    def mha_typed(Q, K, V):
        s_ = ops.scale(ops.contract(Q, K, out=(h, q, x)), D ** -0.5)
        o = ops.contract(ops.softmax(s_, x), V, out=(h, q, d))
        return ops.cast(o, "bf16") if fp8_v else o
    r = optimize(mha_typed, hw, {"h": heads, "q": S, "x": S, "d": D}, None, max_states=300)
    tiles = {t: (g_q if t == "g_q" else s_x if t == "s_x" else 1 if t == "g_h" else v)
             for t, v in r.tiles.items()}
    return lower(r.program, tiles, backend="mosaic", schedule=r.schedule), tiles  # (jitted)


# ----------------------------------------------------------------------------- references
def _bshd(x, B, H):
    """(B·H, S, D) -> (B, S, H, D), jax.nn.dot_product_attention's layout."""
    return x.reshape(B, H, *x.shape[1:]).transpose(0, 2, 1, 3)


def _fits_logits(B, H, T, S) -> bool:
    """Whether XLA's attention (B·H·T·S f32 logits, and their softmax) fits in a quarter of
    the device's memory."""
    try:
        limit = jax.devices()[0].memory_stats()["bytes_limit"]
    except Exception:  # noqa: BLE001 - a device without memory stats: an H100's 80 GB
        limit = 80e9
    return 2 * 4 * B * H * T * S <= limit / 4


def references(B, H, S, D, causal, smoke):
    """cuDNN, XLA (where its logits fit) and Pallas ``mha`` on napkin's (B·H, S, D) arrays."""
    if smoke:
        return {}
    out = {}
    for impl in ("cudnn", "xla"):
        if impl == "xla" and not _fits_logits(B, H, S, S):
            out["dpa-xla"] = None
            continue
        out[f"dpa-{impl}"] = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            _bshd(q, B, H), _bshd(k, B, H), _bshd(v, B, H), is_causal=causal,
            implementation=impl))
    try:
        from jax.experimental.pallas.ops.gpu.attention import mha
        out["pallas-mha"] = jax.jit(lambda q, k, v: mha(
            _bshd(q, B, H), _bshd(k, B, H), _bshd(v, B, H), None, causal=causal,
            sm_scale=D ** -0.5))
    except Exception as e:  # noqa: BLE001 - report, don't fail the table
        print(f"  (pallas mha unavailable: {e})")
    return out


# ----------------------------------------------------------------------------- cases
def bench_attention(case, shape, a, clock, record):
    B, H, S, D, causal = (shape[k] for k in ("B", "H", "S", "D", "causal"))
    heads = B * H
    label = f"attention B={B} H={H} S={S} D={D}{' causal' if causal else ''}"
    k, modelled, tiles, backend = attention_kernel(heads, S, D, causal, a)
    rng = np.random.default_rng(0)
    Q, K, V = (jnp.asarray(rng.standard_normal((heads, S, D)), a.dt) for _ in range(3))
    ref = jax.vmap(get("causal_attention" if causal else "attention").reference)(
        *(x[:2].astype(jnp.float32) for x in (Q, K, V)))
    impls = {"napkin": k, **references(B, H, S, D, causal, a.smoke)}
    if not a.smoke and case == "attention":
        for b in ("triton", "mosaic"):  # both backends at their own tiles, where auto
            impls[f"napkin-{b}"] = attention_kernel(heads, S, D, causal, a, backend=b)[0]
    measure(case, label, impls, (Q, K, V), 4 * heads * S * S * D / (2 if causal else 1), a,
            clock, record, err=lambda f: rel_err(f(Q, K, V)[:2], ref), modelled=modelled,
            tiles=tiles, backend=backend)


def bench_gqa(a, clock, record):
    sizes = dict(k=2, r=2, q=64, x=64, d=32) if a.smoke else dict(k=8, r=4, q=4096, x=4096,
                                                                   d=128)
    kh, r, S, D = sizes["k"], sizes["r"], sizes["q"], sizes["d"]
    opt = searched("gqa", a.hardware, tuple(sizes.items()), a.dtype, 150)
    k = opt.kernel(interpret=a.interpret)
    alg = get("gqa")
    xs = [jnp.asarray(x, a.dt) for x in alg.sample(np.random.default_rng(2), sizes)]
    ref = alg.reference(*(x.astype(jnp.float32) for x in xs))
    impls = {"napkin": jax.jit(k)}
    if not a.smoke:  # cuDNN's GQA: query head n reads KV head n // r, as Q[k, r] flattened
        impls["dpa-cudnn"] = jax.jit(lambda q, k_, v: jax.nn.dot_product_attention(
            q.reshape(kh * r, S, D).transpose(1, 0, 2)[None],
            k_.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], implementation="cudnn"))
    measure("gqa", f"gqa {kh * r}:{kh} S={S} D={D}", impls, xs,
            4 * kh * r * S * sizes["x"] * D, a, clock, record,
            err=lambda f: rel_err(f(*xs), ref), modelled=opt.search.best.tiles.time_s,
            tiles={**opt.tiles, **opt.launch},
            backend=chosen_backend(k, [tuple(opt.sizes[ax.name] for ax in ob.type.axes)
                                       for ob in opt.algorithm.dom.inside]))


def bench_backward(a, clock, record):
    """Forward + backward of attention (jax.value_and_grad of a loss through the kernel: the
    saving forward, then the derived backward's kernels) against jax.grad of cuDNN's."""
    B, H, S, D = (1, 2, 64, 32) if a.smoke else (4, 16, 4096, 128)
    heads = B * H
    k, _, tiles, backend = attention_kernel(heads, S, D, False, a)
    rng = np.random.default_rng(5)
    Q, K, V, dO = (jnp.asarray(rng.standard_normal((heads, S, D)), a.dt) for _ in range(4))

    def train_step(f):
        return jax.jit(lambda q, k_, v: jax.value_and_grad(
            lambda *xs: jnp.sum(f(*xs).astype(jnp.float32) * dO.astype(jnp.float32)),
            argnums=(0, 1, 2))(q, k_, v))
    ref = jax.grad(lambda *xs: jnp.sum(jax.vmap(get("attention").reference)(*xs)
                                       * dO.astype(jnp.float32)), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (Q, K, V)))

    def err(f):
        grads = f(Q, K, V)[1]
        return max(rel_err(g[:2], r[:2]) for g, r in zip(grads, ref))
    impls = {"napkin": train_step(k)}
    for impl, f in references(B, H, S, D, False, a.smoke).items():
        if impl == "dpa-cudnn":
            impls[impl] = train_step(f)
    measure("backward", f"attention fwd+bwd B={B} H={H} S={S} D={D}", impls, (Q, K, V),
            3.5 * 4 * heads * S * S * D, a, clock, record, err=err, tiles=tiles,
            backend=backend)


def bench_fp8(a, clock, record):
    """FP8 (e4m3) attention against the same kernel in bf16 (goal: ≥ 1.3×): Q, K and V in
    FP8 (V stored (d, x), both products e4m3 wgmmas — FA3's configuration), and Q, K in FP8
    with bf16 V (the paper's: P·V stays bf16)."""
    heads, S, D = (1, 128, 64) if a.smoke else (32, 8192, 128)
    flops = 4 * heads * S * S * D
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((heads, S, D)) for _ in range(3)]
    impls, errs, tiles = {}, {}, {}
    jdt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
    for impl, dts in (("bf16", ("bf16",) * 3), ("napkin", ("fp8",) * 3),
                      ("napkin-fp8-qk", ("fp8", "fp8", "bf16"))):
        k, tiles[impl] = mosaic_attention(heads, S, D, 128, 64, a.hardware, dts)
        args = [jnp.asarray(x, jdt[t]) for x, t in zip(xs, dts)]
        if dts[2] == "fp8":
            args[2] = args[2].transpose(0, 2, 1)  # V as the kernel declares it: (h, d, x)
        # the reference of the inputs as stored (FP8 rounds each by up to 6 %, and P too)
        stored = [x[:2].astype(jnp.float32) for x in args]
        if dts[2] == "fp8":
            stored[2] = stored[2].transpose(0, 2, 1)
        ref = jax.vmap(get("attention").reference)(*stored)
        call = (lambda *v, k=k: k(*v, interpret=True)) if a.smoke else k
        errs[impl] = rel_err(call(*args)[:2], ref)
        impls[impl] = (lambda k, args: lambda *_: k(*args))(call, args)
    measure("fp8", f"attention FP8 H={heads} S={S} D={D} (mosaic)", impls, (), flops, a,
            clock, record, err=lambda f: errs[next(i for i, g in impls.items() if g is f)],
            tiles=tiles["napkin"],
            tolerance=lambda f: FP8_P_TOLERANCE if f is impls["napkin"] else TOLERANCE)


def bench_decode(a, clock, record):
    """Decoding: a few queries against a long cache — the search splits the keys over the
    SMs (split-K, a merge kernel after) — against cuDNN."""
    H, D = (2, 32) if a.smoke else (32, 128)
    for q, X in (((1, 256), (4, 256)) if a.smoke else ((1, 131072), (16, 131072))):
        if clock.left() <= clock.cap:
            record.skipped.append(f"decode q={q}")
            continue
        opt = searched("mha", a.hardware, (("h", H), ("q", q), ("x", X), ("d", D)), a.dtype,
                       300)
        k = opt.kernel(interpret=a.interpret)
        rng = np.random.default_rng(6)
        Q = jnp.asarray(rng.standard_normal((H, q, D)), a.dt)
        K, V = (jnp.asarray(rng.standard_normal((H, X, D)), a.dt) for _ in range(2))
        ref = jax.vmap(get("attention").reference)(*(x[:2].astype(jnp.float32)
                                                     for x in (Q, K, V)))
        impls = {"napkin": jax.jit(k)}
        if not a.smoke:
            impls["dpa-cudnn"] = jax.jit(lambda q_, k_, v_: jax.nn.dot_product_attention(
                q_.transpose(1, 0, 2)[None], k_.transpose(1, 0, 2)[None],
                v_.transpose(1, 0, 2)[None], implementation="cudnn")[0].transpose(1, 0, 2))
        split = bool(opt.chain) and opt.chain[-1].rule == "split_stream"
        measure("decode", f"decode H={H} q={q} x={X} D={D}{' (split-K)' if split else ''}",
                impls, (Q, K, V), 4 * H * q * X * D, a, clock, record,
                err=lambda f: rel_err(f(Q, K, V)[:2], ref),
                modelled=opt.search.best.tiles.time_s, tiles={**opt.tiles, **opt.launch},
                backend=chosen_backend(k, [(H, q, D), (H, X, D), (H, X, D)]))


def bench_matmul(a, clock, record):
    for n in ((64,) if a.smoke else (4096, 8192)):
        if clock.left() <= clock.cap:
            record.skipped.append(f"matmul {n}")
            continue
        k, modelled, tiles, backend = matmul_kernel(n, a)
        rng = np.random.default_rng(1)
        A, B = (jnp.asarray(rng.standard_normal((n, n)), a.dt) for _ in range(2))
        ref = A.astype(jnp.float32) @ B.astype(jnp.float32)
        impls = {"napkin": k}
        if not a.smoke:
            for b in ("triton", "mosaic"):
                impls[f"napkin-{b}"] = matmul_kernel(n, a, backend=b)[0]
            impls["jnp.dot"] = jax.jit(jnp.dot)
        measure("matmul", f"matmul {n}^3", impls, (A, B), 2 * n ** 3, a, clock, record,
                err=lambda f: rel_err(f(A, B), ref), modelled=modelled, tiles=tiles,
                backend=backend)


def bench_shapes(a, clock, record):
    shapes = [dict(B=1, H=2, S=64, D=32, causal=True)] if a.smoke else [
        dict(B=4, H=16, S=s, D=d, causal=c) for d in (64, 128) for s in (1024, 2048, 8192, 16384)
        for c in (False, True) if (s, d) != (4096, 128)]
    for shape in shapes:
        if clock.left() <= clock.cap:
            record.skipped.append(f"shapes {shape}")
            continue
        bench_attention("shapes", shape, a, clock, record)


def bench_sweep(a, clock, record):
    """Model time against measured time over ~30 tilings of attention (d = 128, S = 4096,
    64 heads) and matmul 4096³, and each kind's Spearman rank correlation (goal ≥ 0.8)."""
    if a.smoke:
        points = [("matmul", 64, dict(g_a=64, g_c=64, s_b=32))]
    else:
        points = [("attention", 4096, dict(g_q=q, s_x=s)) for q in (64, 128, 256)
                  for s in (32, 64, 128, 256)]
        points += [("matmul", 4096, dict(g_a=m, g_c=c, s_b=s)) for m in (64, 128, 256)
                   for c in (128, 256) for s in (32, 64, 128)]
    for kind, n, tiles in points:
        if clock.left() <= clock.cap:
            record.point({"kind": kind, "tiles": tiles, "skipped": "budget"})
            continue
        try:
            if kind == "attention":
                k, model, used, _ = attention_kernel(64, n, 128, False, a, tiles)
                args = [jnp.ones((64, n, 128), a.dt)] * 3
            else:
                k, model, used, _ = matmul_kernel(n, a, tiles)
                args = [jnp.ones((n, n), a.dt)] * 2
            t = timeit(k, *args, cap_s=clock.cap, reps=1 if a.smoke else 10)
            record.point({"kind": kind, "tiles": used, "model_s": model, "measured_s": t})
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is data too
            record.point({"kind": kind, "tiles": tiles,
                          "failed": f"{type(e).__name__}: {str(e)[:120]}"})
    for kind in ("attention", "matmul"):
        pts = [(p["model_s"], p["measured_s"]) for p in record.sweep
               if p.get("kind") == kind and "measured_s" in p]
        if len(pts) >= 3:
            rho = spearman(*zip(*pts))
            print(f"  sweep {kind}: Spearman {rho:.2f} over {len(pts)} tilings (goal ≥ 0.8: "
                  f"{'met' if rho >= 0.8 else 'NOT met'})", flush=True)


def spearman(a, b) -> float:
    ra, rb = (np.argsort(np.argsort(np.asarray(x))) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def bench_rows(a, clock, record):
    """The paper's hypothesis on Mosaic's warp-specialised kernel: measured TFLOP/s against
    the Hopper derivation's min(compute roof, HBM roof) over the query rows per block, at
    S = 12288 where 192 and 256 rows divide the queries (compute-bound from 206 rows on an
    H200)."""
    from napkin.views.hopper import hopper_attention_config
    heads, S, D = (1, 128, 64) if a.smoke else (32, 12288, 128)
    cfg = hopper_attention_config(a.hardware, w_q=64, s_x=64, d=D,
                                  dtypes={"Q": "bf16", "K": "bf16", "V": "bf16"})
    for g_q in ((128,) if a.smoke else (64, 128, 192, 256)):
        row = {"kind": "rows", "g_q": g_q, "model_tflops": cfg.expected_flops_per_s(g_q) / 1e12,
               "compute_bound_from": cfg.compute_bound_g_q}
        if clock.left() <= clock.cap:
            record.point({**row, "skipped": "budget"})
            continue
        try:
            k, tiles = mosaic_attention(heads, S, D, g_q, 64, a.hardware)
            args = [jnp.ones((heads, S, D), jnp.bfloat16)] * 3
            interp = {"interpret": True} if a.smoke else {}
            t = timeit(lambda *xs: k(*xs, **interp), *args, cap_s=clock.cap,
                       reps=1 if a.smoke else 10)
            record.point({**row, "tiles": tiles, "ms": t * 1e3,
                          "tflops": 4 * heads * S * S * D / t / 1e12})
        except Exception as e:  # noqa: BLE001 - a refused tiling is data too
            record.point({**row, "failed": f"{type(e).__name__}: {str(e)[:160]}"})


CASES = {
    "attention": lambda a, c, r: bench_attention(
        "attention", dict(B=1, H=2, S=64, D=32, causal=False) if a.smoke else
        dict(B=4, H=16, S=4096, D=128, causal=False), a, c, r),
    "causal": lambda a, c, r: bench_attention(
        "causal", dict(B=1, H=2, S=64, D=32, causal=True) if a.smoke else
        dict(B=4, H=16, S=4096, D=128, causal=True), a, c, r),
    "gqa": bench_gqa, "backward": bench_backward, "fp8": bench_fp8, "decode": bench_decode,
    "matmul": bench_matmul, "sweep": bench_sweep, "rows": bench_rows, "shapes": bench_shapes,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated, run in this order (default: {','.join(ORDER)}; "
                        f"--cpu-smoke: all but shapes, which is attention's code again)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    p.add_argument("--case-cap", type=float, default=2.0, help="seconds measuring one row")
    p.add_argument("--out", default=None, help="JSON file (default: results/<gpu>-<date>.json)")
    a = p.parse_args(argv)
    default = [c for c in ORDER if c != "shapes"] if a.cpu_smoke else list(ORDER)
    cases = default if a.cases is None else [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}; the cases: {', '.join(ORDER)}")
    a.smoke = a.cpu_smoke
    STATES["most"] = 40 if a.smoke else None
    a.interpret = True if a.smoke else "auto"
    a.dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    clock = Clock(a.budget, a.case_cap)
    device = jax.devices()[0]
    print(f"devices: {jax.devices()}; jax {jax.__version__}; hardware model {a.hardware}; "
          f"cases {', '.join(cases)}; budget {a.budget:g} s", flush=True)
    kind = getattr(device, "device_kind", device.platform).replace(" ", "_")
    path = None if a.smoke and a.out is None else \
        Path(a.out) if a.out else RESULTS / f"{kind}-{datetime.date.today()}.json"
    record = Record(path, {"command": " ".join(sys.argv), "devices": str(jax.devices()),
                           "jax": jax.__version__, "hardware_model": a.hardware})
    failed = 0
    for case in cases:  # each case on its own: one failure must not lose the others
        if clock.left() <= 0:
            record.skipped.append(case)
            continue
        print(f"{case}:", flush=True)
        try:
            CASES[case](a, clock, record)
        except Exception as e:  # noqa: BLE001 - report it and go on
            failed += 1
            print(f"  case failed: {case}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    record.save()
    if record.skipped:
        print(f"skipped (budget {a.budget:g} s spent): {', '.join(record.skipped)}")
    if path is not None:
        print(f"wrote {path}")
    bad = [r for r in record.rows if r["impl"].startswith("napkin")
           and r.get("max_err", 0) > r.get("tolerance", TOLERANCE)]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
