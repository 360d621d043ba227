"""Multi-level, hardware-aware derivation on Hopper (the paper's worked example, reconstructed).

The paper takes the streamed attention program one level further down: the query group g_q of
a thread block is split into per-warpgroup tiles w_q (128 threads), arrays are recoloured to
the unit that touches them (contractions to the tensor cores, exp to the SFU, the rest to the
registers and ALUs), tile sizes pick up divisibility requirements (combined by LCM), the
memory of one block and of one warpgroup bounds how many consumer warpgroups fit on an SM, and
per-unit clock counts for one key/value step tell which unit bounds and what throughput to
expect.  :func:`hopper_attention_config` does that arithmetic for any profile and tile sizes;
:func:`derive_config` does the generic part for any streamed program (units from the cost
model's FLOP classification, memory from its liveness, divisibility from its tile rules).

Reconstruction (paper notes, "Hardware-aware derivation"; the paper's own tables are not
available here, so every figure below is re-derived and the assumptions are stated):

* **Per-SM rates.**  Tensor-core FLOP/clk/SM = peak / (SMs × clock), rounded to the nearest
  power of two (datasheet TFLOPS are rounded: 4096 × 132 × 1.83 GHz = 989.4 T is listed as
  989 T): H100 SXM FP16 4096, FP8 8192.  SFU: 16 exp/clk/SM.  ALU: non-tensor FP32 FLOP/s /
  (2 × SMs × clock), rounded the same way: 128 adds/clk/SM (an FMA counts 2 FLOPs).
* **Clocks per step** are per query row and per key/value chunk of s_x keys (a warpgroup step
  on w_q rows takes w_q times as long): QKᵀ 2·s_x·d / 8192 = **2**, exp (s_x scores + the
  rescale δ) (s_x + 1)/16 = 65/16 = **4.06**, PV 2·s_x·d / 4096 = **4** (P·V runs at the
  rate of its widest input, FP16 V), accumulate (the row sum of z, s_x adds) 64/128 = **0.5**.
  QKᵀ and PV share the tensor cores: 2 + 4 = **6 clocks** > 4.06, so the tensor cores bound.
  FLOP/clk/SM = 4·s_x·d / 6 = **5461**; × 132 SMs × 1.83 GHz = **1.32 PFLOP/s** (same on H200:
  same GH100 compute).
* **Bandwidth.**  A query group of g_q rows streams all of K and V once: x·d·(1 + 2) bytes
  against 4·g_q·x·d FLOPs, intensity 4·g_q/3 FLOP/B (Q and O, read and written once, are
  negligible for long x and left out, as in the paper).  Compute-bound iff 4·g_q/3 ≥
  1.32 PFLOP/s / HBM bandwidth: **g_q ≥ 295** on H100 (3.35 TB/s), **g_q ≥ 206** on H200
  (4.8 TB/s).
* **Memory.**  SMEM per block (shared by the consumer warpgroups): the K and V chunks,
  double-buffered by the producer (2 × s_x·d·(1 + 2) B = 48 KiB).  SMEM per consumer
  warpgroup: its Q tile (w_q·d FP8, 16 KiB) and the O tile staged for the store (w_q·d FP16,
  32 KiB) = **48 KiB**.  Registers per consumer warpgroup: the O accumulator (w_q·d FP32,
  64 KiB), the score/probability tile S → P (w_q·s_x at the QKᵀ operands' precision, FP8:
  napkin types a contraction's output at its inputs' promoted dtype, and exp overwrites it in
  place; 8 KiB) and the row statistics μ, z (FP32, 1 KiB) = 74,752 B = **74.75 KB** (10³ B).
  SMEM: (227 KiB max per block − 48 KiB) / 48 KiB = **3.73** (paper ≈ 3.7).  Registers:
  (256 KiB − 0) / 74,752 B = **3.51**; the paper's **3.4** is 256 / 74.75, dividing KiB by
  10³-byte KB — we could not find a register content that is 74.75 KiB *and* natural, and
  report the consistent-unit ratio.  Both floor to **3 consumer warpgroups** (FA3 uses 2).
  The producer warpgroup's registers are left out (FA3's producer returns them with
  ``setmaxnreg``); ``producer_registers`` puts them back.
  With the FP32 score accumulator a real wgmma produces (``dtypes={"S": "f32"}``) the
  registers are 97 KiB per warpgroup and only **2** consumer warpgroups fit — FA3's choice.
* **Divisibility** (combined by LCM): w_q — wgmma m = 64, one query row per thread of the
  128-thread warpgroup → **w_q^(128)**; s_x — wgmma n of QKᵀ = 8, wgmma k of PV = 32 B / 2 B
  = 16, exp spread over the 32 lanes of a warp (our reading of the paper's s_x^(32)) →
  **s_x^(32)**; d — 128-byte coalescing of FP8 Q, K rows = 128 (FP16 V, O: 64), wgmma k of
  QKᵀ = 32 B / 1 B = 32, wgmma n of PV = 8 → **d^(128)**.
* **FA3's utilisation** (75 % FP16, 60 % FP8) follows if about two thirds of the exp time
  stays exposed: 8 / (8 + ⅔·4.06) = 0.75 and 4 / (4 + ⅔·4.06) = 0.60
  (:meth:`HopperConfig.utilisation`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from napkin.core.errors import NapkinError
from napkin.hardware import DTYPE_BYTES, KiB, Hardware, HardwareError, get_hardware

__all__ = ["Buffer", "Constraint", "DerivedConfig", "HopperConfig", "UnitLoad",
           "derive_config", "hopper_attention_config", "per_clock"]

DEFAULT_DTYPES = {"Q": "fp8", "K": "fp8", "V": "f16"}
WARP_LANES = 32
EXPOSED_EXP = 2 / 3   # fraction of the exp time FA3 leaves exposed (paper notes)


def _pow2(x: float) -> int:
    """Nearest power of two in log scale (hardware quanta behind rounded datasheet figures)."""
    if x <= 0:
        raise NapkinError(f"per-clock rate must be positive, got {x}")
    return 2 ** round(math.log2(x))


def per_clock(hw: Hardware, what: str) -> int:
    """Per-SM, per-clock throughput of a unit: ``"tensor:<dtype>"`` (FLOP), ``"sfu"`` (exp),
    ``"alu"`` (FP32 adds)."""
    per = hw.sms * hw.clock_hz
    if what.startswith("tensor:"):
        dt = what.split(":", 1)[1]
        try:
            return _pow2(hw.peak_flops(dt) / per)
        except HardwareError:
            raise NapkinError(f"hardware {hw.name!r} has no tensor-core rate for {dt} "
                              f"(has: {', '.join(hw.flops_per_s)})") from None
    if what == "sfu":
        if hw.exp_per_s is None:
            raise NapkinError(f"hardware {hw.name!r} has no SFU exp rate (exp_per_s)")
        return _pow2(hw.exp_per_s / per)
    if what in ("alu", "vector"):
        if hw.vector_flops_per_s is None:
            raise NapkinError(f"hardware {hw.name!r} has no vector FLOP rate")
        return _pow2(hw.vector_flops_per_s / (2 * per))
    raise NapkinError(f"unknown unit {what!r} (tensor:<dtype>, sfu, alu)")


def _bytes(dt: str) -> int:
    if dt not in DTYPE_BYTES:
        raise NapkinError(f"unknown dtype {dt!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[dt]


def _widest(*dts: str) -> str:
    return max(dts, key=_bytes)


def _fmt_bytes(b: float) -> str:
    if b >= KiB:
        return f"{b / KiB:g} KiB ({b / 1000:g} KB)"
    return f"{b:g} B"


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Buffer:
    """One array of the configuration: where it lives and who shares it."""
    name: str
    shape: tuple           # ((axis, size), ...)
    dtype: str
    level: str             # "smem" | "registers"
    scope: str             # "block" (shared by the warpgroups) | "warpgroup"
    copies: int = 1        # pipeline stages
    note: str = ""

    @property
    def bytes(self) -> int:
        return self.copies * math.prod(s for _, s in self.shape) * _bytes(self.dtype)

    def describe(self) -> str:
        shape = ", ".join(a for a, _ in self.shape)
        stages = f"{self.copies} × " if self.copies > 1 else ""
        return (f"{self.name}: {stages}{self.dtype}[{shape}] = {self.bytes:,} B"
                + (f"  ({self.note})" if self.note else ""))


@dataclass(frozen=True)
class Constraint:
    """A divisibility requirement on a tile: ``tile`` must be a multiple of ``multiple``."""
    tile: str
    reason: str
    multiple: int


@dataclass(frozen=True)
class UnitLoad:
    """Work of one op per step on one unit, and the clocks it takes on one SM."""
    op: str
    unit: str              # "tensor:fp8", "tensor:f16", "sfu", "alu"
    work: float            # FLOPs (tensor), exps (sfu), adds (alu)
    rate: int              # per clock per SM
    note: str = ""

    @property
    def clocks(self) -> float:
        return self.work / self.rate


def _lcm_table(constraints, tiles: Mapping) -> dict:
    out = {}
    for t in tiles:
        ms = [c.multiple for c in constraints if c.tile == t]
        out[t] = math.lcm(1, *ms)
    return out


# --------------------------------------------------------------------------- attention
@dataclass
class HopperConfig:
    """The paper's toy-Hopper configuration of attention for one set of tile sizes."""
    hardware: Hardware
    w_q: int
    s_x: int
    d: int
    dtypes: dict
    stages: int
    buffers: list
    constraints: list
    loads: list                     # UnitLoad per query row and kv step
    smem_max: int
    regs_max: int
    producer_registers: int = 0
    g_q: int | None = None          # query rows per block (default: warpgroups × w_q)
    extras: dict = field(default_factory=dict)

    # -- memory and occupancy --------------------------------------------------------------
    def _mem(self, level, scope) -> int:
        return sum(b.bytes for b in self.buffers if b.level == level and b.scope == scope)

    @property
    def smem_block(self) -> int:
        return self._mem("smem", "block")

    @property
    def smem_warpgroup(self) -> int:
        return self._mem("smem", "warpgroup")

    @property
    def registers_block(self) -> int:
        return self._mem("registers", "block") + self.producer_registers

    @property
    def registers_warpgroup(self) -> int:
        return self._mem("registers", "warpgroup")

    @property
    def ratio_smem(self) -> float:
        """(M_max − M_block) / M_warpgroup for shared memory."""
        return (self.smem_max - self.smem_block) / self.smem_warpgroup

    @property
    def ratio_registers(self) -> float:
        return (self.regs_max - self.registers_block) / self.registers_warpgroup

    @property
    def consumer_warpgroups(self) -> int:
        return max(0, math.floor(min(self.ratio_smem, self.ratio_registers)))

    @property
    def occupancy_limit(self) -> str:
        return "smem" if self.ratio_smem <= self.ratio_registers else "registers"

    # -- divisibility ----------------------------------------------------------------------
    @property
    def multiples(self) -> dict:
        """{tile: LCM of its requirements} (w_q^(128), s_x^(32), d^(128) on H100)."""
        return _lcm_table(self.constraints, ("w_q", "s_x", "d"))

    @property
    def divisible(self) -> bool:
        m = self.multiples
        return all(getattr(self, t) % m[t] == 0 for t in m)

    # -- clocks ----------------------------------------------------------------------------
    def clocks_by_unit(self) -> dict:
        """Clocks per query row per kv step on each unit (tensor cores summed: one unit)."""
        out: dict = {}
        for ld in self.loads:
            key = "tensor" if ld.unit.startswith("tensor") else ld.unit
            out[key] = out.get(key, 0.0) + ld.clocks
        return out

    @property
    def bound_unit(self) -> str:
        c = self.clocks_by_unit()
        return max(c, key=c.get)

    @property
    def step_clocks(self) -> float:
        return max(self.clocks_by_unit().values())

    @property
    def flops_per_step(self) -> float:
        return sum(ld.work for ld in self.loads if ld.unit.startswith("tensor"))

    @property
    def flops_per_clock_per_sm(self) -> float:
        """Tensor-core FLOPs per clock per SM when the bound unit is saturated (5461)."""
        return self.flops_per_step / self.step_clocks

    @property
    def ideal_flops_per_s(self) -> float:
        hw = self.hardware
        return self.flops_per_clock_per_sm * hw.sms * hw.clock_hz

    def utilisation(self, exposed_exp: float = EXPOSED_EXP) -> float:
        """Tensor-core busy fraction if ``exposed_exp`` of the SFU time does not overlap."""
        c = self.clocks_by_unit()
        t = c.get("tensor", 0.0)
        return t / (t + exposed_exp * c.get("sfu", 0.0))

    # -- bandwidth -------------------------------------------------------------------------
    @property
    def kv_bytes_per_key(self) -> int:
        return self.d * (_bytes(self.dtypes["K"]) + _bytes(self.dtypes["V"]))

    def intensity(self, g_q: float) -> float:
        """FLOP per HBM byte of a query group of g_q rows (K and V streamed once)."""
        return 4 * g_q * self.d / self.kv_bytes_per_key

    @property
    def compute_bound_g_q(self) -> float:
        """Smallest query group that is compute-bound: 295 on H100, 206 on H200."""
        return self.ideal_flops_per_s * self.kv_bytes_per_key / (
            4 * self.d * self.hardware.memory_bandwidth)

    @property
    def block_g_q(self) -> int:
        return self.g_q if self.g_q is not None else self.consumer_warpgroups * self.w_q

    def expected_flops_per_s(self, g_q: float | None = None) -> float:
        """min(compute roof, HBM roof) at query group g_q (default: one block's rows)."""
        g = self.block_g_q if g_q is None else g_q
        return min(self.ideal_flops_per_s, self.intensity(g) * self.hardware.memory_bandwidth)

    # -- text ------------------------------------------------------------------------------
    def describe(self) -> str:
        hw = self.hardware
        m = self.multiples
        lines = [f"Hopper attention configuration on {hw.name}: w_q={self.w_q}, s_x={self.s_x}, "
                 f"d={self.d}; " + ", ".join(f"{k} {v}" for k, v in self.dtypes.items()),
                 "", "units: QKᵀ and PV → tensor cores; exp → SFU; rescale, row sums, "
                 "max → registers/ALUs", "", "divisibility (combined by LCM):"]
        for t in ("w_q", "s_x", "d"):
            rs = ", ".join(f"{c.reason} {c.multiple}" for c in self.constraints if c.tile == t)
            ok = "ok" if getattr(self, t) % m[t] == 0 else "VIOLATED"
            lines.append(f"  {t}^({m[t]}) = lcm({rs}); {t} = {getattr(self, t)}: {ok}")
        lines += ["", "memory:"]
        for lv, scope in (("smem", "block"), ("smem", "warpgroup"), ("registers", "warpgroup")):
            for b in self.buffers:
                if b.level == lv and b.scope == scope:
                    lines.append(f"  {lv:<9} per {scope:<9} {b.describe()}")
        lines += [
            f"  SMEM: block {_fmt_bytes(self.smem_block)}, per warpgroup "
            f"{_fmt_bytes(self.smem_warpgroup)}; (M_max {_fmt_bytes(self.smem_max)} − M_block) "
            f"/ M_warpgroup = {self.ratio_smem:.2f}",
            f"  registers: block {_fmt_bytes(self.registers_block)}, per warpgroup "
            f"{_fmt_bytes(self.registers_warpgroup)}; (M_max {_fmt_bytes(self.regs_max)} − "
            f"M_block) / M_warpgroup = {self.ratio_registers:.2f}",
            f"  → {self.consumer_warpgroups} consumer warpgroups per SM (limited by "
            f"{self.occupancy_limit}), plus one producer", "",
            "clocks per query row per kv step (one SM):"]
        for ld in self.loads:
            lines.append(f"  {ld.op:<11} {ld.unit:<11} {ld.work:>8g} / {ld.rate:<5} = "
                         f"{ld.clocks:.4g}" + (f"  ({ld.note})" if ld.note else ""))
        c = self.clocks_by_unit()
        lines += [
            "  per unit: " + ", ".join(f"{u} {v:.4g}" for u, v in c.items())
            + f" → bound by {self.bound_unit} ({self.step_clocks:.4g} clocks)",
            f"  {self.flops_per_step:g} FLOP / {self.step_clocks:.4g} clocks = "
            f"{self.flops_per_clock_per_sm:.0f} FLOP/clk/SM × {hw.sms} SMs × "
            f"{hw.clock_hz / 1e9:g} GHz = {self.ideal_flops_per_s / 1e15:.3f} PFLOP/s ideal",
            f"  utilisation with {EXPOSED_EXP:.2f} of the exp exposed: "
            f"{self.utilisation():.0%}", "",
            f"bandwidth: intensity 4·g_q·d / (d·(bytes K + bytes V)) = {4 * self.d}·g_q / "
            f"{self.kv_bytes_per_key} FLOP/B; compute-bound iff g_q ≥ "
            f"{self.compute_bound_g_q:.1f} (HBM {hw.memory_bandwidth / 1e12:g} TB/s)",
            f"  one block (g_q = {self.block_g_q}): "
            f"{'compute' if self.block_g_q >= self.compute_bound_g_q else 'bandwidth'}-bound, "
            f"expected {self.expected_flops_per_s() / 1e12:.0f} TFLOP/s",
        ]
        for name, other in self.extras.items():
            lines.append(f"  on {name}: ideal {other.ideal_flops_per_s / 1e15:.3f} PFLOP/s, "
                         f"compute-bound iff g_q ≥ {other.compute_bound_g_q:.1f}, one block "
                         f"expected {other.expected_flops_per_s() / 1e12:.0f} TFLOP/s")
        rows = self.paper_comparison()
        if rows:
            lines += ["", "against the paper's worked example:"]
            for what, ours, paper, note in rows:
                lines.append((f"  {what:<34} {ours:>12}  paper {paper:<12}"
                              + (f"  {note}" if note else "")).rstrip())
        return "\n".join(lines)

    def paper_comparison(self) -> list:
        """(figure, ours, paper, note) rows when this is the paper's worked configuration
        (w_q=128, s_x=64, d=128, FP8 Q/K, FP16 V on an H100/H200 profile); else []."""
        worked = (self.w_q, self.s_x, self.d) == (128, 64, 128) and \
            (self.dtypes["Q"], self.dtypes["K"], self.dtypes["V"], self.dtypes["S"]) == \
            ("fp8", "fp8", "f16", "fp8") and self.hardware.sms == 132
        if not worked:
            return []
        h200 = "H200" in self.hardware.name
        return [
            ("SMEM per warpgroup", f"{self.smem_warpgroup / KiB:g} KiB", "≈48 KB", ""),
            ("registers per warpgroup", f"{self.registers_warpgroup / 1000:.3f} KB", "74.75 KB",
             "10³-byte KB"),
            ("(M_max − M_block)/M_wg, SMEM", f"{self.ratio_smem:.2f}", "≈3.7", ""),
            ("(M_max − M_block)/M_wg, registers", f"{self.ratio_registers:.2f}", "≈3.4",
             "paper: 256/74.75, KiB over KB"),
            ("consumer warpgroups", f"{self.consumer_warpgroups}", "3", "FA3 uses 2"),
            ("clocks QKᵀ / exp / PV / accumulate",
             " / ".join(f"{ld.clocks:.3g}" for ld in self.loads), "2/4.06/4/0.5", ""),
            ("FLOP/clk/SM", f"{self.flops_per_clock_per_sm:.0f}", "5461", ""),
            ("ideal PFLOP/s", f"{self.ideal_flops_per_s / 1e15:.3f}", "≈1.32", ""),
            ("compute-bound from g_q", f"{self.compute_bound_g_q:.1f}",
             "≈206" if h200 else "≈295", "reconstructed" if h200 else ""),
        ]


def hopper_attention_config(hardware="h100", w_q: int = 128, s_x: int = 64, d: int = 128,
                            dtypes: Mapping | None = None, *, stages: int = 2,
                            producer_registers: int = 0, g_q: int | None = None,
                            compare=("h200",)) -> HopperConfig:
    """The paper's worked Hopper configuration of attention (see the module docstring).

    ``dtypes``: "Q", "K", "V" (default FP8, FP8, FP16) and optionally "S" (the score tile in
    registers; default the QKᵀ operands' widest dtype), "O" (the accumulator; f32) and
    "out" (the O tile staged in SMEM for the store; default V's dtype).  ``compare``: other
    profiles whose bandwidth figures are reported alongside (H200 by default).
    """
    hw = get_hardware(hardware)
    dt = dict(DEFAULT_DTYPES)
    dt.update(dict(dtypes or {}))
    for k in ("Q", "K", "V"):
        _bytes(dt[k])
    dt.setdefault("S", _widest(dt["Q"], dt["K"]))
    dt.setdefault("O", "f32")
    dt.setdefault("out", dt["V"])
    for k, v in dt.items():
        _bytes(v)
    for name, v in (("w_q", w_q), ("s_x", s_x), ("d", d), ("stages", stages)):
        if not isinstance(v, int) or v <= 0:
            raise NapkinError(f"{name} must be a positive integer, got {v!r}")
    regs = next((lv for lv in hw.levels if lv.name == "registers"), None)
    smem = next((lv for lv in hw.levels if lv.name == "smem"), hw.levels[1])
    mma = dict(regs.divisibility) if regs is not None else {}
    kb = mma.get("mma_k_bytes", 32)
    align = smem.align_bytes
    buffers = [
        Buffer("K", (("s_x", s_x), ("d", d)), dt["K"], "smem", "block", stages,
               "chunk, pipelined by the producer"),
        Buffer("V", (("s_x", s_x), ("d", d)), dt["V"], "smem", "block", stages,
               "chunk, pipelined by the producer"),
        Buffer("Q", (("w_q", w_q), ("d", d)), dt["Q"], "smem", "warpgroup", 1,
               "the warpgroup's queries"),
        Buffer("O", (("w_q", w_q), ("d", d)), dt["out"], "smem", "warpgroup", 1,
               "output tile staged for the store"),
        Buffer("o", (("w_q", w_q), ("d", d)), dt["O"], "registers", "warpgroup", 1,
               "accumulator"),
        Buffer("S→P", (("w_q", w_q), ("s_x", s_x)), dt["S"], "registers", "warpgroup", 1,
               "scores, overwritten by exp"),
        Buffer("mu, z", (("2", 2), ("w_q", w_q)), "f32", "registers", "warpgroup", 1,
               "row max and row sum"),
    ]
    pv_dt = _widest(dt["S"], dt["V"])
    qk_dt = _widest(dt["Q"], dt["K"])
    cons = [
        Constraint("w_q", "wgmma m", mma.get("mma_m", 64)),
        Constraint("w_q", "one row per thread of a warpgroup", hw.warpgroup_threads),
        Constraint("s_x", "wgmma n of QKᵀ", mma.get("mma_n", 8)),
        Constraint("s_x", f"wgmma k of PV ({kb} B / {_bytes(pv_dt)} B)",
                   max(1, kb // _bytes(pv_dt))),
        Constraint("s_x", "exp over the lanes of a warp", WARP_LANES),
        Constraint("d", f"wgmma k of QKᵀ ({kb} B / {_bytes(qk_dt)} B)",
                   max(1, kb // _bytes(qk_dt))),
        Constraint("d", "wgmma n of PV", mma.get("mma_n", 8)),
    ]
    seen = set()
    for arr in ("Q", "K", "V", "out"):
        b = _bytes(dt[arr])
        if b in seen:
            continue
        seen.add(b)
        names = "/".join(a if a != "out" else "O" for a in ("Q", "K", "V", "out")
                         if _bytes(dt[a]) == b)
        cons.append(Constraint("d", f"coalesce {align} B of {dt[arr]} {names}",
                               max(1, align // b)))
    loads = [
        UnitLoad("QKᵀ", f"tensor:{qk_dt}", 2 * s_x * d, per_clock(hw, f"tensor:{qk_dt}"),
                 "2·s_x·d"),
        UnitLoad("exp", "sfu", s_x + 1, per_clock(hw, "sfu"), "s_x scores + the rescale δ"),
        UnitLoad("PV", f"tensor:{pv_dt}", 2 * s_x * d, per_clock(hw, f"tensor:{pv_dt}"),
                 "2·s_x·d, at the widest input's rate"),
        UnitLoad("accumulate", "alu", s_x, per_clock(hw, "alu"), "row sum z += Σ p"),
    ]
    smem_max = hw.smem_per_block_max_bytes or smem.capacity_bytes
    cfg = HopperConfig(hw, w_q, s_x, d, dt, stages, buffers, cons, loads, smem_max,
                       hw.registers_per_sm_bytes, producer_registers, g_q)
    for other in compare or ():
        o = get_hardware(other)
        if o.name != hw.name:
            cfg.extras[o.name] = hopper_attention_config(o, w_q, s_x, d, dtypes, stages=stages,
                                                         producer_registers=producer_registers,
                                                         g_q=g_q, compare=())
    return cfg


# --------------------------------------------------------------------------- generic
@dataclass
class DerivedConfig:
    """Units, divisibility, memory and occupancy of any streamed program (generic)."""
    hardware: Hardware
    tiles: dict
    constraints: list
    memory_bytes: dict          # level -> peak bytes per instance
    loads: list                 # UnitLoad per step of the innermost stream (whole group)
    step_axis: str | None
    instances: dict             # level -> how many groups fit per parent instance
    flops: float
    hbm_bytes: float

    @property
    def multiples(self) -> dict:
        return _lcm_table(self.constraints, self.tiles)

    @property
    def divisible(self) -> bool:
        m = self.multiples
        return all(int(self.tiles[t]) % m[t] == 0 for t in m)

    def clocks_by_unit(self) -> dict:
        out: dict = {}
        for ld in self.loads:
            key = "tensor" if ld.unit.startswith("tensor") else ld.unit
            out[key] = out.get(key, 0.0) + ld.clocks
        return out

    @property
    def bound_unit(self) -> str | None:
        c = self.clocks_by_unit()
        return max(c, key=c.get) if c else None

    @property
    def intensity(self) -> float:
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf

    @property
    def ridge(self) -> float:
        """FLOP/B where this program's step mix would saturate its bound unit."""
        c = self.clocks_by_unit()
        if not c:
            return math.inf
        fl = sum(ld.work for ld in self.loads if ld.unit.startswith("tensor")) or \
            sum(ld.work for ld in self.loads)
        hw = self.hardware
        return fl / max(c.values()) * hw.sms * hw.clock_hz / hw.memory_bandwidth

    def describe(self) -> str:
        hw = self.hardware
        lines = [f"derived configuration on {hw.name}: "
                 + ", ".join(f"{k}={v}" for k, v in self.tiles.items()), "",
                 "divisibility (combined by LCM):"]
        m = self.multiples
        for t in self.tiles:
            rs = ", ".join(f"{c.reason} {c.multiple}" for c in self.constraints if c.tile == t)
            ok = "ok" if int(self.tiles[t]) % m[t] == 0 else "VIOLATED"
            lines.append(f"  {t}^({m[t]}) = lcm({rs or '1'}); {t} = {self.tiles[t]}: {ok}")
        lines += ["", "memory (peak per instance) and occupancy:"]
        for lv, b in self.memory_bytes.items():
            fit = self.instances.get(lv)
            lines.append(f"  {lv:<10} {_fmt_bytes(b)}" + (f"; {fit} fit per {lv} budget"
                                                            if fit is not None else ""))
        if self.loads:
            lines += ["", f"clocks per step of stream {self.step_axis} (one group, one SM):"]
            for ld in self.loads:
                lines.append(f"  {ld.op:<18} {ld.unit:<11} {ld.work:>10g} / {ld.rate:<5} = "
                             f"{ld.clocks:.4g}")
            c = self.clocks_by_unit()
            lines.append("  per unit: " + ", ".join(f"{u} {v:.4g}" for u, v in c.items())
                         + f" → bound by {self.bound_unit}")
        lines.append(f"intensity {self.intensity:.1f} FLOP/B at HBM (ridge of the step mix "
                     f"{self.ridge:.1f}): "
                     f"{'compute' if self.intensity >= self.ridge else 'bandwidth'}-bound")
        return "\n".join(lines)


def innermost_stream(schedule):
    """The deepest stream loop of a schedule (the step the derivation prices), or None;
    the first of equally deep ones."""
    from napkin.schedule.nest import Loop
    best, best_depth = None, -1

    def visit(loop, depth):
        nonlocal best, best_depth
        for it in loop.items:
            if isinstance(it, Loop):
                d = depth + (it.kind in ("group", "stream"))
                if it.kind == "stream" and d > best_depth:
                    best, best_depth = it, d
                visit(it, d)
    visit(schedule.root, 0)
    return best


def flops_per_trip(loop) -> dict:
    """{unit: FLOPs} of one trip of ``loop``'s body, nested loops included."""
    from napkin.schedule.nest import Step
    out = {}
    for it, m in loop.walk():
        if isinstance(it, Step):
            for unit, f in it.flops.items():
                out[unit] = out.get(unit, 0) + f * m / loop.trips
    return out


def derive_config(program, hardware, tiles: Mapping, dtypes=None) -> DerivedConfig:
    """The generic half of the derivation for any streamed program at given tile sizes.

    Units: each box of the innermost stream's update goes where the cost model puts its FLOPs
    (matrix products → tensor cores at their widest input's dtype, transcendental maps → SFU,
    the rest → ALUs), priced per step at :func:`per_clock` rates; unlike the paper's toy
    count (QKᵀ, exp, PV and the row sum only), every vector op of the update counts.
    Divisibility: the cost model's tile requirements (coalescing, tensor-core shapes) plus one
    row per thread of a warpgroup for a group at the registers level.  Memory: the cost
    model's peak per instance of each level; occupancy = budget // peak.  ``tiles`` must give
    every tile symbol; ``dtypes`` is the cost model's ``dtype`` argument.
    """
    from napkin.cost import cost
    from napkin.cost import value_at

    hw = get_hardware(hardware)
    c = cost(program, hw, dtypes)
    sizes = {str(k): v for k, v in dict(tiles).items()}
    missing = [str(s) for s in c.tiles if str(s) not in sizes]
    if missing:
        raise NapkinError(f"derive_config needs a value for every tile: missing "
                          f"{', '.join(missing)}")
    cons = []
    for s, info in c.tiles.items():
        for reason, m in info.multiples:
            cons.append(Constraint(str(s), reason, m))
        if info.kind == "group" and info.level == "registers":
            cons.append(Constraint(str(s), "one row per thread of a warpgroup",
                                   hw.warpgroup_threads))
    ev = c.evaluate(sizes)
    mem = {lv: ev["memory_bytes"][lv] for lv in c.levels[1:] if ev["memory_bytes"][lv]}
    inst = {}
    for lv, b in mem.items():
        cap = hw.level(lv).capacity_bytes
        if lv == "smem" and hw.smem_per_block_max_bytes:
            cap = hw.smem_per_block_max_bytes
        if lv == "registers":
            cap = hw.registers_per_sm_bytes
        inst[lv] = int(cap // b) if b else None
    loads = []
    step = innermost_stream(c.schedule)  # the schedule the cost model folds
    axis = None
    if step is not None:
        axis = step.axis
        for unit, f in flops_per_trip(step).items():
            w = value_at(f, sizes)
            if w == 0:
                continue
            if unit.startswith("tensor:"):
                rate = per_clock(hw, unit)
            elif unit == "sfu":
                rate = per_clock(hw, "sfu")
            else:
                rate = per_clock(hw, "alu")
            loads.append(UnitLoad(f"update ({unit})", "alu" if unit == "vector" else unit, w,
                                  rate))
    flops = ev["flops"]
    top = c.levels[1]
    hbm = ev["transfers_bytes"][top]
    sizes_sym = {str(k): v for k, v in sizes.items()}
    return DerivedConfig(hw, {str(s): sizes_sym[str(s)] for s in c.tiles}, cons, mem, loads,
                         axis, inst, flops, hbm)
