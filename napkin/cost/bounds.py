"""Lower bounds, and the paper's closed-form cost transformations of H*(M) = Σ α_t·M^(−β_t):
multi-level pricing, quantisation, intermediate caching (pooled memory), cross-transfer.

Every function here takes the canonical terms either as a :class:`Canonical` or as a list of
(α, β) pairs; a β = 0 pair is the compulsory traffic no tiling removes.
"""
from __future__ import annotations

from collections.abc import Mapping

import sympy

from napkin.cost.model import Cost, bytes_per_value
from napkin.hardware import get_hardware

ZERO = sympy.Integer(0)
M_SYM = sympy.Symbol("M", positive=True)

# H800 figures the paper uses for thread-block-cluster exchange (distributed shared memory)
# against the plain GMEM <-> SMEM path.
H800_GMEM_SMEM_BYTES_PER_S = 2.04e12
H800_CLUSTER_BYTES_PER_S = {2: 3.27e12, 4: 2.65e12}


def _terms(ab) -> list:
    if hasattr(ab, "terms"):
        return list(ab.terms)
    return [(sympy.sympify(a), sympy.sympify(b)) for a, b in ab]


# --------------------------------------------------------------------------- lower bounds
def lower_bound(c: Cost, M=M_SYM) -> sympy.Expr:
    """A lower bound on the values any schedule of ``c.program`` moves with M values on chip.

    max(compulsory, the contraction bounds), where compulsory = program inputs + outputs;
    the score contraction of a softmax-contraction stream (the one that does not sum the
    streamed axis: QKᵀ) has the FlashAttention bound I·k/M = q·x·d²/M per head (constant 1
    for the Ω) and the value contraction of that stream (PV) adds nothing; a
    matrix-multiply-like contraction (two inputs, each with an output axis of its own, and a
    summed axis) has the Hong–Kung-family bound 2·I/√M (I = its whole iteration space,
    a·b·c for a matmul) only when it is the program's only one.

    Why only then: the Hong–Kung argument bounds the products of one I/O segment by the
    entries of A, B and C it can touch, each at most O(M).  In a chain — sigmoid or linear
    attention, an MLP, (A·B)·C — the rules reach fused programs where one product's result
    feeds the next on chip: its entries are made and consumed inside a segment without I/O,
    so neither product is bounded that way (streamed linear attention at d = 64 moves 0.71×
    the sum of the two bounds, and less than either alone when d < √M).  The bound must hold
    for every program the rules reach, so a chain keeps the compulsory traffic.
    """
    M = sympy.sympify(M)
    terms, products = [], []
    for rec in c.contractions:
        if rec.stream_rule and "softmax_contraction" in rec.stream_rule:
            if rec.stream_axis not in rec.reduced and rec.matmul_like:
                terms.append(rec.iterations * rec.reduced_size / M)
            continue
        if rec.matmul_like:
            products.append(2 * rec.iterations / sympy.sqrt(M))
    if len(products) == 1:
        terms += products
    if not terms:
        return c.io_values
    return sympy.Max(c.io_values, *(sympy.expand(t) for t in terms))


# --------------------------------------------------------------------------- transformations
def multilevel_transfers(alpha_beta, memories: Mapping, inv_bandwidth: Mapping) -> sympy.Expr:
    """The paper's multi-level cost H = Σ_t α_t·Σ_ℓ Ḣ_ℓ⁻¹·M_ℓ^(−β_t).

    ``memories``: {level: M_ℓ} (None or oo for the top level: M → ∞); ``inv_bandwidth``:
    {level: Ḣ_ℓ⁻¹}, the cost of moving one value into level ℓ.  A β = 0 term (compulsory
    traffic) is paid at every level with a finite M (it crosses all of them).
    """
    out = ZERO
    for a, b in _terms(alpha_beta):
        for lv, m in memories.items():
            if m is None or m == sympy.oo:
                continue
            out += a * sympy.sympify(inv_bandwidth[lv]) * sympy.sympify(m) ** (-b)
    return out


def multilevel_time(alpha_beta, hardware, dtype: str = "f16", levels=None) -> sympy.Expr:
    """Seconds of data movement by the multi-level formula on a profile: M_ℓ = capacity_ℓ / q
    values, Ḣ_ℓ⁻¹ = q / bandwidth_ℓ seconds per value (q = bytes per value of ``dtype``).
    α in values."""
    hw = get_hardware(hardware)
    q = bytes_per_value(dtype)
    lvls = [lv for lv in hw.levels[1:] if levels is None or lv.name in levels]
    mem = {lv.name: sympy.Rational(lv.capacity_bytes, q) for lv in lvls}
    inv = {lv.name: sympy.Float(q / lv.bandwidth_bytes_per_s) for lv in lvls}
    return multilevel_transfers(alpha_beta, mem, inv)


def quantisation_factor(beta, bytes_from: int = 2, bytes_to: int = 1):
    """Bytes-moved ratio of a β term going from ``bytes_from`` to ``bytes_to`` per value.

    With q bytes per value M = M_bytes/q values, and each value costs q: bytes ∝ q^(1+β).
    FP16 → FP8: ×4 for β = 1 (attention's broadcast term), ×2^1.5 for β = ½ (matmul tiling).
    """
    return (sympy.Rational(bytes_from, bytes_to)) ** (1 + sympy.sympify(beta))


def quantised(alpha_beta, q: int, M_bytes=M_SYM) -> sympy.Expr:
    """H* in bytes with q bytes per value, for α in values and a capacity of M_bytes bytes:
    Σ q·α·(M_bytes/q)^(−β)."""
    return sum((q * a * (M_bytes / q) ** (-b) for a, b in _terms(alpha_beta)), ZERO)


def pooled_transfers(alpha_beta, M=M_SYM, N=1) -> sympy.Expr:
    """Intermediate caching: N concurrently resident children sharing a cache level make the
    upper level's traffic behave as if their memories were pooled, H*(a, N·M)."""
    return sum((a * (N * M) ** (-b) for a, b in _terms(alpha_beta)), ZERO)


def cross_transfer_saving(alpha_beta, M_c, N: int, bw_cross: float | None = None,
                          bw_base: float = H800_GMEM_SMEM_BYTES_PER_S) -> sympy.Expr:
    """ΔH* = ΔḢ⁻¹(N)·Σ_t α_t·M_c^(−β_t)·(1 − N^(−β_t)): what N children exchanging data over a
    cross level (thread-block cluster, NVLink) save.  The bracket is H*(M_c) − H*(N·M_c), the
    traffic pooling moves off the base path; ΔḢ⁻¹(N) = 1/bw_base − 1/bw_cross(N) is the cost
    difference per unit moved (seconds per byte with α and M_c in bytes).  ``bw_cross``
    defaults to the paper's H800 figures (3.27 TB/s at N = 2, 2.65 TB/s at N = 4)."""
    if bw_cross is None:
        bw_cross = H800_CLUSTER_BYTES_PER_S[N]
    dinv = sympy.Float(1 / bw_base - 1 / bw_cross)
    return dinv * sum((a * sympy.sympify(M_c) ** (-b) * (1 - sympy.Integer(N) ** (-b))
                       for a, b in _terms(alpha_beta)), ZERO)


# --------------------------------------------------------------------------- rooflines
def crossover(c: Cost, name: str, sizes: Mapping, lo: float = 1.0, hi: float = 2.0 ** 24,
              tied: tuple = ()) -> float:
    """The value of size ``name`` (a tile or an axis) where the program turns compute-bound:
    compute time = the slowest transfer time (bisection in log space; nan if it never
    crosses in [lo, hi]).  ``tied``: other sizes set equal to it (e.g. a chunk = its axis)."""
    from napkin.cost.model import CostError, sym_subs
    ts = c.time_s
    var = sympy.Symbol("_v", positive=True)
    names = (name, *tied)

    def fn(expr):
        e = sym_subs(expr, {k: v for k, v in sizes.items() if k not in names})
        e = e.subs({s: var for s in e.free_symbols if s.name in names})
        if e.free_symbols - {var}:
            raise CostError(f"crossover: no size for "
                            f"{', '.join(sorted(map(str, e.free_symbols - {var})))}")
        return sympy.lambdify(var, e, "math")
    comp = fn(ts["compute"])
    mems = [fn(ts[lv]) for lv in c.levels[1:]]

    def gap(v):
        return comp(v) - max(m(v) for m in mems)
    glo, ghi = gap(lo), gap(hi)
    if (glo >= 0) == (ghi >= 0):
        return float("nan")
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        if (gap(mid) >= 0) == (ghi >= 0):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-10:
            break
    return (lo * hi) ** 0.5
