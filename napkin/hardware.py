"""Hardware profiles: the memory hierarchy and throughputs the cost model prices against.

A profile is a chain of memory levels, top (GMEM/HBM, unbounded) to bottom (registers), each
with a capacity per instance, the bandwidth from its parent into it, how many instances sit
under one parent, and its transfer granularity; plus chip-wide compute throughputs.  The
multi-level cost H = sum_t alpha_t * sum_l Hdot_l^-1 * M_l^-beta_t (paper notes, "Costs") reads
M_l from ``capacity_bytes`` and Hdot_l from ``bandwidth_bytes_per_s``.

Conventions (one meaning per field, so cost code can rely on them):
  * capacity_bytes is per instance; None only for the top level (M -> infinity).
  * bandwidth_bytes_per_s is the aggregate over the whole chip, parent -> this level.
  * KB/MB in NVIDIA documents are binary here (164 KB = 164 * 1024 B; the CUDA device
    properties report 40 MB of A100 L2 as 41943040 B).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from napkin.core.errors import NapkinError

KiB = 1024
MiB = 1024 * KiB

# The memory levels programs and rules name, top to bottom.  A profile has some of them
# (two_level keeps gmem and smem); a group at a level the profile lacks runs at the
# deepest profile level not below it.
CANONICAL_LEVELS = ("gmem", "l2", "smem", "registers")


def resolve_level(names, name: str) -> int:
    """Where a partition at level ``name`` runs on a profile with levels ``names``: that
    level, or for a canonical level the profile lacks, the deepest profile level not below
    it (a two-level profile puts registers-level groups at its on-chip level); an unknown
    name, the deepest level."""
    if name in names:
        return names.index(name)
    if name in CANONICAL_LEVELS:
        want = CANONICAL_LEVELS.index(name)
        best = None
        for i, lv in enumerate(names):
            if lv in CANONICAL_LEVELS and CANONICAL_LEVELS.index(lv) <= want:
                best = i
        if best is not None:
            return best
    return len(names) - 1

# Storage size of one value; tf32 is computed at 19 bits but stored and moved as 32.
DTYPE_BYTES: dict[str, int] = {
    "f64": 8, "f32": 4, "tf32": 4, "bf16": 2, "f16": 2,
    "fp8": 1, "e4m3": 1, "e5m2": 1, "int8": 1,
}


class HardwareError(NapkinError):
    """An invalid or unknown hardware description; the message is one line."""


class FrozenMap(Mapping):
    """A read-only, hashable dict (so Level and Hardware stay hashable cache keys)."""

    __slots__ = ("_d", "_items")

    def __init__(self, items: Mapping | Iterable[tuple] = ()):
        d = dict(items.items() if isinstance(items, Mapping) else items)
        self._d = d
        self._items = tuple(sorted(d.items()))

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self) -> Iterator:
        return iter(k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self._items)!r})"


@dataclass(frozen=True)
class Level:
    name: str
    capacity_bytes: int | None = None        # per instance; None = unbounded (top only)
    bandwidth_bytes_per_s: float | None = None  # parent -> here, whole chip; None at the top
    count: int = 1                           # instances under one parent instance
    align_bytes: int = 1                     # transfer granularity (coalescing)
    divisibility: FrozenMap = FrozenMap()    # (what, multiple) pairs, e.g. tensor-core tiles

    def __post_init__(self):
        object.__setattr__(self, "divisibility", FrozenMap(self.divisibility))

    def multiple(self, what: str) -> int:
        """The required multiple for ``what`` at this level (1 when unconstrained)."""
        return self.divisibility.get(what, 1)


@dataclass(frozen=True)
class Hardware:
    name: str
    levels: tuple[Level, ...]                 # top (GMEM/HBM) -> bottom
    flops_per_s: FrozenMap = FrozenMap()      # dtype -> dense tensor-core FLOP/s, whole chip
    vector_flops_per_s: float | None = None   # non-tensor fp32 FLOP/s; None = unknown
    exp_per_s: float | None = None            # SFU exp throughput, whole chip; None = unknown
    clock_hz: float = 1.0e9
    # Chip fields left as None are derived from the levels in __post_init__ (see _defaults).
    sms: int | None = None
    registers_per_sm_bytes: int | None = None
    smem_per_sm_bytes: int | None = None
    smem_per_block_max_bytes: int | None = None
    l2_bytes: int | None = None
    # L2 -> SM bandwidth: re-reads of operands the L2 holds (napkin.cost.launch); derived
    # from the level under 'l2', None where the hierarchy has none
    l2_bytes_per_s: float | None = None
    warpgroup_threads: int = 128
    # The launch model (napkin.cost.launch); register_budget None = a roofline only.
    register_budget: int | None = None     # 4-byte registers of data one thread may hold
    registers_per_thread_max: int = 255
    warps_per_block: tuple[int, ...] = (4, 8)  # the launch choices, fewest first
    pipeline_stages: int = 2               # most chunk buffers in flight per stream
    max_blocks_per_sm: int = 32
    # A warp-specialised block (Mosaic GPU's): ``producer_warps`` warps only issue copies,
    # keeping ``producer_registers`` per thread; its consumer warps (``warps_per_block``)
    # hold the data and share the rest of the SM's register file (setmaxnreg), one block
    # an SM.  0: every warp holds data (Triton's).
    producer_warps: int = 0
    producer_registers: int = 0
    tile_max: int | None = None            # the largest tile along an axis (a TMA box's)
    launch_s: float = 0.0                  # fixed cost of one kernel launch
    step_s: float = 0.0                    # least time of one sequential step of a block
    memory_latency_s: float = 0.0          # a load from memory, issue to use (a block's first)
    # The device level (napkin.devices): chips of this kind joined by links, each with its
    # own memory hierarchy above; None = one chip, no link stated.
    devices: int = 1                       # chips in the system (a node: 8 on HGX boards)
    hbm_bytes: int | None = None           # one chip's memory (the top level's capacity)
    link_bytes_per_s: float | None = None  # one chip to one peer, one direction
    link_latency_s: float = 0.0            # least time of one cross-device transfer
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        def set_(k, v):  # frozen: __post_init__ is the one place fields are normalised
            object.__setattr__(self, k, v)
        set_("levels", tuple(self.levels))
        set_("sources", tuple(self.sources))
        set_("warps_per_block", tuple(self.warps_per_block))
        set_("flops_per_s", FrozenMap(self.flops_per_s))
        _validate_levels(self)
        for k, v in _defaults(self).items():
            set_(k, v)
        _validate_chip(self)

    # -- lookups ---------------------------------------------------------------------------
    def level(self, name: str) -> Level:
        for lv in self.levels:
            if lv.name == name:
                return lv
        known = ", ".join(lv.name for lv in self.levels)
        raise HardwareError(f"hardware {self.name!r}: unknown level {name!r} (levels: {known})")

    def instances(self, name: str) -> int:
        """Instances of level ``name`` on the whole chip (product of counts down to it)."""
        idx = self.levels.index(self.level(name))
        return math.prod(lv.count for lv in self.levels[:idx + 1])

    def bytes_per_value(self, dtype: str) -> int:
        return DTYPE_BYTES[_known_dtype(dtype, self.name)]

    def peak_flops(self, dtype: str) -> float:
        """Dense FLOP/s for ``dtype``; fp8 variants fall back to 'fp8', f32 to the vector units."""
        d = _known_dtype(dtype, self.name)
        if d in self.flops_per_s:
            return self.flops_per_s[d]
        if d in ("e4m3", "e5m2") and "fp8" in self.flops_per_s:
            return self.flops_per_s["fp8"]
        if d == "f32" and self.vector_flops_per_s is not None:
            return self.vector_flops_per_s
        have = ", ".join(self.flops_per_s) or "none"
        raise HardwareError(
            f"hardware {self.name!r}: field flops_per_s has no figure for {d!r} (has: {have})")

    @property
    def memory_bandwidth(self) -> float:
        """Bytes/s out of the top level (HBM bandwidth on a GPU)."""
        return self.levels[1].bandwidth_bytes_per_s

    def ridge_point(self, dtype: str, level: str | None = None) -> float:
        """FLOP per byte at which compute and transfers into ``level`` take equal time.

        Default: the level just below the top, i.e. the HBM roofline ridge.
        """
        bw = self.memory_bandwidth if level is None else self.level(level).bandwidth_bytes_per_s
        if bw is None:
            raise HardwareError(
                f"hardware {self.name!r}: level {level!r}: "
                "has no bandwidth_bytes_per_s (top level)")
        return self.peak_flops(dtype) / bw

    # -- derived profiles ------------------------------------------------------------------
    def two_level(self, on_chip: str = "smem") -> Hardware:
        """GMEM + ``on_chip`` only, as in the paper's two-level costs.

        Intermediate levels are folded into the path: bandwidth = the slowest hop, count =
        instances under the top, alignment = LCM of the hops' requirements.  Divisibility is
        the LCM over every level below the top, the ones below ``on_chip`` included: the
        tensor cores' tile shapes (stated on the registers level) bind a contraction's tiles
        whichever levels the model keeps.
        """
        idx = self.levels.index(self.level(on_chip))
        if idx == 0:
            raise HardwareError(
                f"hardware {self.name!r}: level {on_chip!r}: two_level needs a level below the top")
        path = self.levels[1:idx + 1]
        div: dict[str, int] = {}
        for lv in self.levels[1:]:
            for k, m in lv.divisibility.items():
                div[k] = math.lcm(div.get(k, 1), m)
        lv = replace(
            path[-1],
            bandwidth_bytes_per_s=min(p.bandwidth_bytes_per_s for p in path),
            count=math.prod(p.count for p in path),
            align_bytes=math.lcm(*(p.align_bytes for p in path)),
            divisibility=div,
        )
        return replace(self, name=f"{self.name} [{self.levels[0].name}+{on_chip}]",
                       levels=(self.levels[0], lv))

    # -- text ------------------------------------------------------------------------------
    def describe(self) -> str:
        flops = ", ".join(f"{d} {v / 1e12:g}T" for d, v in self.flops_per_s.items())
        lines = [
            f"{self.name}: {self.sms} SMs @ {self.clock_hz / 1e9:g} GHz; FLOP/s {flops or '-'}",
            f"{'level':<10} {'capacity':>12} {'count':>6} {'bandwidth in':>14} {'align':>6}",
        ]
        for lv in self.levels:
            cap = "unbounded" if lv.capacity_bytes is None else _fmt_bytes(lv.capacity_bytes)
            bw = lv.bandwidth_bytes_per_s
            bw = "-" if bw is None else f"{bw / 1e12:.3g} TB/s"
            lines.append(f"{lv.name:<10} {cap:>12} {lv.count:>6} {bw:>14} {lv.align_bytes:>6}")
        return "\n".join(lines)

    def to_toml(self) -> str:
        """TOML text that ``load_toml`` reads back to an equal Hardware."""
        out = [f"name = {_toml_str(self.name)}"]
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "levels", "flops_per_s") or v is None:
                continue
            out.append(f"{f.name} = {_toml_value(v)}")
        out.append("\n[flops_per_s]")
        out += [f"{_toml_str(k)} = {_toml_value(v)}" for k, v in self.flops_per_s.items()]
        for lv in self.levels:
            out.append("\n[[levels]]")
            for f in fields(lv):
                v = getattr(lv, f.name)
                if v is not None and v != {}:
                    out.append(f"{f.name} = {_toml_value(v)}")
        return "\n".join(out) + "\n"


# -- validation ------------------------------------------------------------------------------

def _bad_num(v, integer: bool, allow_zero: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        return True
    return not (v >= 0 if allow_zero else v > 0)  # also rejects NaN


def _checkers(hw: Hardware):
    def fail(msg):
        raise HardwareError(f"hardware {hw.name!r}: {msg}")

    def need(v, where, fld, integer=False, allow_zero=False):
        if _bad_num(v, integer, allow_zero):
            kind = "an integer" if integer else "a number"
            fail(f"{where}field {fld} must be {kind} {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return fail, need


def _validate_levels(hw: Hardware) -> None:
    fail, need = _checkers(hw)
    if len(hw.levels) < 2:
        fail(f"field levels: needs at least 2 levels (top memory and one below it), "
             f"got {len(hw.levels)}")
    seen = set()
    for i, lv in enumerate(hw.levels):
        if not isinstance(lv, Level):
            fail(f"field levels: entry {i} is not a Level: {lv!r}")
        at = f"level {lv.name!r}: "
        if lv.name in seen:
            fail(f"{at}duplicate level name")
        seen.add(lv.name)
        if i == 0:
            if lv.capacity_bytes is not None:
                need(lv.capacity_bytes, at, "capacity_bytes", integer=True)
            if lv.bandwidth_bytes_per_s is not None:
                need(lv.bandwidth_bytes_per_s, at, "bandwidth_bytes_per_s")
        else:
            if lv.capacity_bytes is None:
                fail(f"{at}field capacity_bytes is required below the top level")
            need(lv.capacity_bytes, at, "capacity_bytes", integer=True)
            if lv.bandwidth_bytes_per_s is None:
                fail(f"{at}field bandwidth_bytes_per_s is required below the top level")
            need(lv.bandwidth_bytes_per_s, at, "bandwidth_bytes_per_s")
            parent = hw.levels[i - 1]
            if parent.capacity_bytes is not None and lv.capacity_bytes >= parent.capacity_bytes:
                fail(f"{at}field capacity_bytes {lv.capacity_bytes} must be smaller than parent "
                     f"level {parent.name!r} capacity_bytes {parent.capacity_bytes} (per instance)")
        need(lv.count, at, "count", integer=True)
        need(lv.align_bytes, at, "align_bytes", integer=True)
        for what, m in lv.divisibility.items():
            need(m, at, f"divisibility[{what!r}]", integer=True)


def _validate_chip(hw: Hardware) -> None:
    fail, need = _checkers(hw)
    known = ", ".join(sorted(DTYPE_BYTES))
    for d, v in hw.flops_per_s.items():
        if d not in DTYPE_BYTES:
            fail(f"field flops_per_s: unknown dtype {d!r} (known: {known})")
        need(v, "", f"flops_per_s[{d!r}]")
    need(hw.clock_hz, "", "clock_hz")
    need(hw.warpgroup_threads, "", "warpgroup_threads", integer=True)
    for f in ("vector_flops_per_s", "exp_per_s", "l2_bytes_per_s"):
        if getattr(hw, f) is not None:
            need(getattr(hw, f), "", f)
    for f in ("sms", "smem_per_sm_bytes", "smem_per_block_max_bytes"):
        if getattr(hw, f) is not None:
            need(getattr(hw, f), "", f, integer=True)
    for f in ("registers_per_sm_bytes", "l2_bytes"):
        if getattr(hw, f) is not None:
            need(getattr(hw, f), "", f, integer=True, allow_zero=True)
    if hw.register_budget is not None:
        need(hw.register_budget, "", "register_budget", integer=True)
    for f in ("registers_per_thread_max", "pipeline_stages", "max_blocks_per_sm"):
        need(getattr(hw, f), "", f, integer=True)
    for f in ("producer_warps", "producer_registers"):
        need(getattr(hw, f), "", f, integer=True, allow_zero=True)
    if hw.producer_warps:  # setmaxnreg's range a thread, and room for the consumers
        left = (hw.registers_per_sm_bytes or 0) // 4 // hw.warpgroup_threads
        most = max(1, max(hw.warps_per_block) * 32 // hw.warpgroup_threads)
        top = min(SETMAXNREG[1], left - 8 * most)
        if not SETMAXNREG[0] <= hw.producer_registers <= top:
            fail(f"field producer_registers must be {SETMAXNREG[0]} to {top} (what "
                 f"setmaxnreg takes, leaving {most} consumer warpgroups 8 each of the "
                 f"{left} a thread the SM's registers give), got {hw.producer_registers}")
    if hw.tile_max is not None:
        need(hw.tile_max, "", "tile_max", integer=True)
    for f in ("launch_s", "step_s", "memory_latency_s", "link_latency_s"):
        need(getattr(hw, f), "", f, allow_zero=True)
    need(hw.devices, "", "devices", integer=True)
    if hw.hbm_bytes is not None:
        need(hw.hbm_bytes, "", "hbm_bytes", integer=True)
    if hw.link_bytes_per_s is not None:
        need(hw.link_bytes_per_s, "", "link_bytes_per_s")
    if not hw.warps_per_block:
        fail("field warps_per_block must list at least one warp count")
    for w in hw.warps_per_block:
        need(w, "", "warps_per_block", integer=True)
    if (hw.smem_per_block_max_bytes or 0) > (hw.smem_per_sm_bytes or math.inf):
        fail(f"field smem_per_block_max_bytes {hw.smem_per_block_max_bytes} exceeds "
             f"smem_per_sm_bytes {hw.smem_per_sm_bytes}")
    if not all(isinstance(s, str) for s in hw.sources):
        fail("field sources must be a list of strings")


def _defaults(hw: Hardware) -> dict:
    """Fill omitted chip fields from the levels: 'smem' (else the level under the top) is the
    per-SM memory, 'registers' and 'l2' by name (0 bytes when the hierarchy has none)."""
    names = {lv.name: lv for lv in hw.levels}
    sm = names.get("smem", hw.levels[1])
    regs = names.get("registers")
    derived = {
        "sms": hw.instances(sm.name),
        "smem_per_sm_bytes": sm.capacity_bytes,
        "registers_per_sm_bytes": regs.capacity_bytes * regs.count if regs else 0,
        "l2_bytes": names["l2"].capacity_bytes if "l2" in names else 0,
        "l2_bytes_per_s": _below(hw, "l2").bandwidth_bytes_per_s if "l2" in names
        and _below(hw, "l2") is not None else None,
    }
    out = {k: v for k, v in derived.items() if getattr(hw, k) is None}
    if hw.smem_per_block_max_bytes is None:
        out["smem_per_block_max_bytes"] = out.get("smem_per_sm_bytes", hw.smem_per_sm_bytes)
    return out


def _below(hw: Hardware, name: str):
    """The level under level ``name`` (None at the bottom)."""
    i = [lv.name for lv in hw.levels].index(name)
    return hw.levels[i + 1] if i + 1 < len(hw.levels) else None


def _known_dtype(dtype: str, profile: str) -> str:
    if dtype not in DTYPE_BYTES:
        raise HardwareError(f"hardware {profile!r}: unknown dtype {dtype!r} "
                            f"(known: {', '.join(sorted(DTYPE_BYTES))})")
    return dtype


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _toml_str(s: str) -> str:
    # TOML basic strings forbid raw control characters and DEL: escape them as \uXXXX.
    esc = (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F
           else "\\" + c if c in '"\\' else c for c in s)
    return '"' + "".join(esc) + '"'


def _toml_value(v) -> str:
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "nan")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_toml_str(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


# -- TOML ------------------------------------------------------------------------------------

_LEVEL_KEYS = {f.name for f in fields(Level)}
_CHIP_KEYS = {f.name for f in fields(Hardware)}


def hardware_from_dict(data: Mapping, default_name: str = "custom") -> Hardware:
    """Build a Hardware from parsed TOML (or any dict of the same shape)."""
    name = data.get("name", default_name)
    for key in data:
        if key not in _CHIP_KEYS:
            raise HardwareError(f"hardware {name!r}: unknown field {key!r} "
                                f"(known: {', '.join(sorted(_CHIP_KEYS))})")
    levels = []
    for i, raw in enumerate(data.get("levels", [])):
        lname = raw.get("name") if isinstance(raw, Mapping) else None
        if not isinstance(lname, str):
            raise HardwareError(f"hardware {name!r}: levels[{i}]: field name is required")
        bad = sorted(set(raw) - _LEVEL_KEYS)
        if bad:
            raise HardwareError(f"hardware {name!r}: level {lname!r}: unknown field {bad[0]!r} "
                                f"(known: {', '.join(sorted(_LEVEL_KEYS))})")
        levels.append(Level(**{k: _as_float(k, v) for k, v in raw.items()}))
    chip = {k: _as_float(k, v) for k, v in data.items() if k not in ("levels", "flops_per_s")}
    chip["name"] = name
    flops = {k: _as_float("flops", v) for k, v in data.get("flops_per_s", {}).items()}
    return Hardware(levels=tuple(levels), flops_per_s=flops, **chip)


_FLOAT_KEYS = {"bandwidth_bytes_per_s", "vector_flops_per_s", "exp_per_s", "clock_hz", "flops",
               "launch_s", "step_s", "memory_latency_s", "link_bytes_per_s", "link_latency_s"}


def _as_float(key, v):
    # TOML writes 1e12 as a float but 1000 as an int; throughputs are floats either way.
    if key in _FLOAT_KEYS and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v


def load_toml(path: str | os.PathLike) -> Hardware:
    """A hardware hierarchy from a TOML file; every way the file can be wrong
    (missing, a directory, unreadable, not UTF-8, not TOML, not a hierarchy) is
    a one-line HardwareError naming the file."""
    p = Path(path)
    want = "want a TOML hierarchy like the built-in profiles' Hardware.to_toml()"
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise HardwareError(f"hardware file '{p}' not found") from None
    except IsADirectoryError:
        raise HardwareError(f"hardware file '{p}' is a directory ({want}, or a profile: "
                            f"{', '.join(PROFILES)})") from None
    except tomllib.TOMLDecodeError as e:
        msg = " ".join(str(e).split())
        raise HardwareError(f"hardware file '{p}': TOML syntax error: {msg}") from e
    except UnicodeDecodeError as e:
        raise HardwareError(f"hardware file '{p}': not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                            f"at offset {e.start}); {want}") from None
    except RecursionError:
        raise HardwareError(f"hardware file '{p}': nested too deeply ({want})") from None
    except OSError as e:
        raise HardwareError(f"hardware file '{p}': cannot read it: {e.strerror or e}") from None
    except ValueError as e:  # e.g. an integer beyond Python's int-parsing limit
        raise HardwareError(f"hardware file '{p}': {' '.join(str(e).split(';')[0].split())} "
                            f"({want})") from None
    try:
        return hardware_from_dict(data, default_name=p.stem)
    except HardwareError as e:
        raise HardwareError(f"hardware file '{p}': {e}") from e
    except (TypeError, AttributeError, ValueError, RecursionError) as e:
        # e.g. a level or table given as a scalar
        raise HardwareError(f"hardware file '{p}': malformed: {' '.join(str(e).split())}") from e


# -- built-in profiles -----------------------------------------------------------------------

# Sources (cited next to each figure below):
#   [A100-WP]  NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020)
#   [A100-DS]  NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column)
#   [H100-WP]  NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022)
#   [H100-DS]  NVIDIA H100 Tensor Core GPU datasheet (SXM column)
#   [H200-DS]  NVIDIA H200 Tensor Core GPU datasheet / product page (SXM column)
#   [CUDA]     CUDA C++ Programming Guide: compute capabilities table (CC 8.0, 9.0) and the
#              arithmetic-instruction throughput table
#   [EST]      our estimate, derived as stated; not a published figure
# Datasheet tensor figures marked "with sparsity" are halved here: the cost model is dense.

_SRC = {
    "A100-WP": "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020)",
    "A100-DS": "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM",
    "H100-WP": "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022)",
    "H100-DS": "NVIDIA H100 Tensor Core GPU datasheet, SXM",
    "H200-DS": "NVIDIA H200 Tensor Core GPU datasheet, SXM",
    "CUDA": "CUDA C++ Programming Guide: compute capabilities and instruction throughput tables",
}

SFU_EXP_PER_CLOCK_PER_SM = 16    # [CUDA] exp2f/ex2.approx: 16 results/clk/SM on CC 8.0 and 9.0
SMEM_BYTES_PER_CLOCK_PER_SM = 128  # [EST] 32 banks x 4 B; shared memory -> registers
SETMAXNREG = (24, 256)           # [PTX] setmaxnreg: registers a thread, in multiples of 8
REGISTER_PARTITIONS = 4          # [A100-WP][H100-WP] 4 SM sub-partitions, 64 KB registers each


def _nvidia(name, *, sms, clock_hz, l2_bytes, hbm_bytes_per_s, l2_bytes_per_s, smem_per_sm,
            smem_per_block, flops, vector, mma, sources, nvlink_bytes_per_s,
            hbm_bytes) -> Hardware:
    """GMEM -> L2 -> SMEM (one per SM) -> registers (one per SM sub-partition).

    Registers are modelled per sub-partition (64 KB) rather than per SM (256 KB, more than
    SMEM): each partition's file is private to its warps, and it keeps capacities decreasing.
    """
    return Hardware(
        name=name,
        levels=(
            Level("gmem"),  # HBM: unbounded in the model (paper: top level M -> infinity)
            Level("l2", l2_bytes, hbm_bytes_per_s, count=1, align_bytes=32),  # 32-B L2 sectors
            # 128-B transfers coalesce (paper notes, "Hardware-aware derivation").
            Level("smem", smem_per_sm, l2_bytes_per_s, count=sms, align_bytes=128),
            Level("registers", 256 * KiB // REGISTER_PARTITIONS,
                  SMEM_BYTES_PER_CLOCK_PER_SM * sms * clock_hz,  # [EST] SMEM bank bandwidth
                  count=REGISTER_PARTITIONS, align_bytes=4, divisibility=mma),
        ),
        flops_per_s=flops,
        vector_flops_per_s=vector,
        exp_per_s=SFU_EXP_PER_CLOCK_PER_SM * sms * clock_hz,
        clock_hz=clock_hz,
        sms=sms,
        registers_per_sm_bytes=256 * KiB,  # [A100-WP][H100-WP] 64K 32-bit registers per SM
        smem_per_sm_bytes=smem_per_sm,
        smem_per_block_max_bytes=smem_per_block,
        l2_bytes=l2_bytes,
        l2_bytes_per_s=l2_bytes_per_s,   # re-reads of operands the L2 holds (the launch model)
        # [EST] registers of data a thread may hold, calibrated on ptxas for sm_90 (triton
        # 3.9): the schedule counts a value and its in-place successor once where the
        # compiler keeps both (scores in f32 beside P in bf16), so tiles above ~128 spill
        register_budget=128, registers_per_thread_max=255, warps_per_block=(4, 8),
        pipeline_stages=2,              # double buffering: the next chunk loads during this one
        max_blocks_per_sm=32,           # [CUDA] CC 8.0 and 9.0: 32 resident blocks per SM
        launch_s=3e-6,                  # [EST] a kernel launch, a few microseconds
        step_s=200 / clock_hz,          # [EST] ~200 cycles of loop, barrier and issue per step
        # [EST] ~1000 cycles (~0.5 us) from issuing a load from HBM to using it (published
        # microbenchmarks of A100 and H100 put a DRAM access at 450-650 ns)
        memory_latency_s=1000 / clock_hz,
        # the device level: an HGX board's 8 GPUs, all-to-all through NVSwitch; a link's
        # figure is one direction (the datasheets quote both directions summed)
        devices=8,                      # [A100-DS][H100-DS][H200-DS] HGX 8-GPU boards
        hbm_bytes=hbm_bytes,
        link_bytes_per_s=nvlink_bytes_per_s,
        link_latency_s=5e-6,            # [EST] a few microseconds per NVLink message (NCCL)
        sources=tuple(_SRC[s] for s in sources),
    )


_A100_CLOCK = 1.41e9  # [A100-WP] boost clock 1410 MHz; 312 TF = 2048 FLOP/clk/SM x 108 x 1.41 GHz
A100_SXM = _nvidia(
    "A100 SXM 80GB",
    sms=108,                        # [A100-WP] 108 SMs enabled
    clock_hz=_A100_CLOCK,
    l2_bytes=40 * MiB,              # [A100-WP] 40 MB L2
    hbm_bytes_per_s=2.039e12,       # [A100-DS] 80GB SXM HBM2e 2,039 GB/s
    l2_bytes_per_s=5120 * _A100_CLOCK,  # [A100-WP] L2 read bandwidth 5120 B/clk
    smem_per_sm=164 * KiB,          # [A100-WP][CUDA] up to 164 KB shared memory per SM
    smem_per_block=163 * KiB,       # [CUDA] CC 8.0: 163 KB max per block (opt-in)
    flops={                         # [A100-WP][A100-DS] dense tensor core
        "bf16": 312e12, "f16": 312e12, "tf32": 156e12, "int8": 624e12,
        "f64": 19.5e12,             # FP64 tensor core
    },
    vector=19.5e12,                 # [A100-DS] FP32 non-tensor 19.5 TF
    # [CUDA/PTX] mma.sync m16n8k16 (16-bit); dot_min: no dot dimension under 16 (Triton's
    # tl.dot, and the tensor cores' smallest useful shape)
    mma={"mma_m": 16, "mma_n": 8, "mma_k_bytes": 32, "dot_min": 16},
    nvlink_bytes_per_s=300e9,       # [A100-DS] NVLink 3: 600 GB/s both directions
    hbm_bytes=80 * 10 ** 9,         # [A100-DS] 80 GB HBM2e
    sources=("A100-WP", "A100-DS", "CUDA"),
)

# H100 SXM clock: 1.83 GHz, not the 1.98 GHz max boost in the datasheet.  The headline
# tensor figures are 4096 FLOP/clk/SM x 132 SMs x 1.83 GHz = 989 TF, and the paper's own
# arithmetic (5461 FLOP/clk/SM x 132 x 1.83 GHz) uses it; at 1.98 GHz the same cores would be
# 1070 TF.  (The 67 TF FP32 figure, 128 FMA/clk/SM x 2 x 132, corresponds to 1.98 GHz.)
_HOPPER_CLOCK = 1.83e9
_HOPPER_SMS = 132                   # [H100-WP][H100-DS] H100 SXM5: 132 SMs (H200 SXM the same)
_HOPPER = dict(
    sms=_HOPPER_SMS,
    clock_hz=_HOPPER_CLOCK,
    l2_bytes=50 * MiB,              # [H100-WP] 50 MB L2
    # [EST] no published Hopper L2 bandwidth: A100's 5120 B/clk scaled by SM count.
    l2_bytes_per_s=5120 * _HOPPER_SMS / 108 * _HOPPER_CLOCK,
    smem_per_sm=228 * KiB,          # [H100-WP][CUDA] CC 9.0: 228 KB shared memory per SM
    smem_per_block=227 * KiB,       # [CUDA] CC 9.0: 227 KB max per block (opt-in)
    flops={                         # [H100-DS] SXM, sparsity figures halved (= [H100-WP] dense)
        "bf16": 989e12, "f16": 989e12,
        "tf32": 494e12,             # datasheet 989 sparse / 2 = 494.5; [H100-WP] 494.7
        "fp8": 1979e12, "e4m3": 1979e12, "e5m2": 1979e12,
        "int8": 1979e12,            # TOPS
        "f64": 67e12,               # FP64 tensor core
    },
    vector=67e12,                   # [H100-DS] FP32 non-tensor 67 TF
    # [PTX] wgmma m64nNk(32 B), N % 8 == 0; dot_min: no dot dimension under 16 (Triton)
    mma={"mma_m": 64, "mma_n": 8, "mma_k_bytes": 32, "dot_min": 16},
    nvlink_bytes_per_s=450e9,       # [H100-DS][H200-DS] NVLink 4: 900 GB/s both directions
)
H100_SXM = _nvidia("H100 SXM", hbm_bytes_per_s=3.35e12,  # [H100-DS] HBM3 3.35 TB/s
                   hbm_bytes=80 * 10 ** 9,                # [H100-DS] 80 GB
                   sources=("H100-WP", "H100-DS", "CUDA"), **_HOPPER)
# H200: same GH100 compute as H100 SXM ([H200-DS] lists the same TFLOPS); HBM3e 141 GB.
H200 = _nvidia("H200 SXM", hbm_bytes_per_s=4.8e12,        # [H200-DS] HBM3e 4.8 TB/s
               hbm_bytes=141 * 10 ** 9,                   # [H200-DS] 141 GB
               sources=("H200-DS", "H100-WP", "CUDA"), **_HOPPER)

PROFILES: dict[str, Hardware] = {"a100": A100_SXM, "h100": H100_SXM, "h200": H200}


def _norm(s: str) -> str:
    s = re.sub(r"[^a-z0-9]", "", s.lower())
    return s.removeprefix("nvidia")


# Accepted spellings, normalised: the keys, each profile's display name, and its bare family
# plus "sxm"/"sxm4"/"sxm5" (so 'H100 SXM', 'h100-sxm5', 'NVIDIA A100' all resolve).
_ALIASES: dict[str, str] = {}
for _key, _hw in PROFILES.items():
    for _a in (_key, _hw.name, _key + "sxm", _key + "sxm4", _key + "sxm5"):
        _ALIASES[_norm(_a)] = _key


def get_hardware(name_or_path: str | os.PathLike | Hardware) -> Hardware:
    """A built-in profile by name (case/space-insensitive), or a TOML file by path."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    s = os.fspath(name_or_path)
    if (not isinstance(name_or_path, str) or s.endswith(".toml") or os.sep in s or "/" in s
            or os.path.isfile(s)):
        return load_toml(s)
    key = _ALIASES.get(_norm(s))
    if key is not None:
        return PROFILES[key]
    close = difflib.get_close_matches(_norm(s), _ALIASES, n=1, cutoff=0.5)
    hint = f"; did you mean {_ALIASES[close[0]]!r}?" if close else ""
    raise HardwareError(f"unknown hardware profile {s!r} (known: {', '.join(PROFILES)}){hint}")
