"""Tests for napkin.hardware: built-in figures, derived quantities, TOML loading, validation."""

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from napkin.hardware import (
    A100_SXM, DTYPE_BYTES, H100_SXM, H200, PROFILES, Hardware, HardwareError, Level,
    get_hardware, hardware_from_dict, load_toml,
)

TOY_TOML = """\
name = "toy"
clock_hz = 1.0e9
[flops_per_s]
f16 = 1.0e12
[[levels]]
name = "dram"
[[levels]]
name = "sram"
capacity_bytes = 65536
bandwidth_bytes_per_s = 1.0e11
count = 4
align_bytes = 64
"""


def toy(**chip):
    """A valid two-level dict; tests mutate one field to make it invalid."""
    d = {
        "name": "toy",
        "flops_per_s": {"f16": 1e12},
        "levels": [
            {"name": "dram"},
            {"name": "sram", "capacity_bytes": 65536, "bandwidth_bytes_per_s": 1e11, "count": 4},
        ],
    }
    d.update(chip)
    return d


# -- built-in profiles ------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(PROFILES))
def test_profile_validates_and_is_well_formed(key):
    hw = PROFILES[key]
    assert dataclasses.replace(hw) == hw  # re-running validation on the same fields passes
    assert [lv.name for lv in hw.levels] == ["gmem", "l2", "smem", "registers"]
    assert hw.levels[0].capacity_bytes is None and hw.levels[0].bandwidth_bytes_per_s is None
    caps = [lv.capacity_bytes for lv in hw.levels[1:]]
    assert caps == sorted(caps, reverse=True) and len(set(caps)) == len(caps)
    assert all(lv.bandwidth_bytes_per_s > 0 for lv in hw.levels[1:])
    assert hw.sources and all(isinstance(s, str) for s in hw.sources)
    assert set(hw.flops_per_s) <= set(DTYPE_BYTES)
    hash(hw)  # usable as a cache key


def test_spot_figures():
    assert H100_SXM.peak_flops("bf16") == 989e12
    assert H100_SXM.peak_flops("f16") == 989e12
    assert H100_SXM.peak_flops("fp8") == 1979e12
    assert A100_SXM.peak_flops("bf16") == 312e12
    assert A100_SXM.peak_flops("tf32") == 156e12
    assert H200.memory_bandwidth == 4.8e12
    assert H200.level("l2").bandwidth_bytes_per_s == 4.8e12
    assert H100_SXM.memory_bandwidth == 3.35e12
    assert A100_SXM.memory_bandwidth == 2.039e12
    assert H100_SXM.sms == H200.sms == 132 and A100_SXM.sms == 108
    assert H100_SXM.level("smem").count == 132
    assert H100_SXM.smem_per_sm_bytes == 228 * 1024
    assert H100_SXM.smem_per_block_max_bytes == 227 * 1024
    assert A100_SXM.smem_per_sm_bytes == 164 * 1024
    assert A100_SXM.smem_per_block_max_bytes == 163 * 1024
    assert A100_SXM.l2_bytes == 40 * 2**20 and H100_SXM.l2_bytes == H200.l2_bytes == 50 * 2**20
    for hw in PROFILES.values():
        assert hw.registers_per_sm_bytes == 256 * 1024 == hw.level("registers").capacity_bytes * 4
        assert hw.exp_per_s == 16 * hw.sms * hw.clock_hz
    assert H100_SXM.vector_flops_per_s == 67e12 and A100_SXM.vector_flops_per_s == 19.5e12
    assert H200.flops_per_s == H100_SXM.flops_per_s  # same compute, more bandwidth


def test_clock_reproduces_headline_tensor_figures():
    # 989 TF = 4096 FLOP/clk/SM x 132 x 1.83 GHz; 312 TF = 2048 x 108 x 1.41 GHz.
    for hw, per_clock in ((H100_SXM, 4096), (A100_SXM, 2048)):
        assert hw.peak_flops("bf16") / (hw.sms * hw.clock_hz) == pytest.approx(per_clock, rel=1e-3)
    # The paper's ideal FP8/FP16 attention figure: 5461 FLOP/clk/SM -> ~1.32 PFLOP/s.
    assert 5461 * H100_SXM.sms * H100_SXM.clock_hz == pytest.approx(1.32e15, rel=2e-3)


def test_ridge_point():
    assert H100_SXM.ridge_point("bf16") == 989e12 / 3.35e12
    assert round(H100_SXM.ridge_point("f16")) == 295  # paper: compute-bound for b >= ~295
    assert round(H200.ridge_point("f16")) == 206      # paper: ~206 on H200
    assert A100_SXM.ridge_point("bf16") == pytest.approx(312 / 2.039)
    assert H100_SXM.ridge_point("fp8") == pytest.approx(2 * H100_SXM.ridge_point("bf16"), rel=1e-3)
    smem_bw = H100_SXM.level("smem").bandwidth_bytes_per_s
    assert H100_SXM.ridge_point("bf16", level="smem") == 989e12 / smem_bw
    with pytest.raises(HardwareError, match="gmem"):
        H100_SXM.ridge_point("bf16", level="gmem")


def test_dtype_helpers():
    assert H100_SXM.bytes_per_value("bf16") == 2
    assert H100_SXM.bytes_per_value("e4m3") == 1
    assert H100_SXM.bytes_per_value("tf32") == 4
    assert A100_SXM.peak_flops("f32") == 19.5e12  # falls back to the vector units
    with pytest.raises(HardwareError, match=r"fp8.*has: .*bf16"):
        A100_SXM.peak_flops("fp8")  # Ampere has no FP8 tensor cores
    with pytest.raises(HardwareError, match=r"unknown dtype 'fp16'.*known:.*bf16"):
        H100_SXM.peak_flops("fp16")
    with pytest.raises(HardwareError, match="unknown dtype"):
        H100_SXM.bytes_per_value("f128")
    fp8_only = hardware_from_dict(toy(flops_per_s={"fp8": 2e12}))
    assert fp8_only.peak_flops("e4m3") == 2e12


def test_level_lookup_and_instances():
    assert H100_SXM.level("smem").align_bytes == 128
    assert H100_SXM.instances("smem") == 132
    assert H100_SXM.instances("registers") == 528
    assert H100_SXM.level("registers").multiple("mma_m") == 64
    assert H100_SXM.level("smem").multiple("mma_m") == 1
    with pytest.raises(HardwareError, match=r"unknown level 'hbm'.*gmem, l2, smem, registers"):
        H100_SXM.level("hbm")


def test_two_level():
    two = H100_SXM.two_level()
    assert [lv.name for lv in two.levels] == ["gmem", "smem"]
    smem = two.level("smem")
    assert smem.capacity_bytes == 228 * 1024
    assert smem.bandwidth_bytes_per_s == 3.35e12  # HBM is the slowest hop on the path
    assert smem.count == 132 and smem.align_bytes == 128
    assert two.sms == 132 and two.flops_per_s == H100_SXM.flops_per_s
    assert two.ridge_point("bf16") == H100_SXM.ridge_point("bf16")
    regs = H200.two_level("registers")
    assert [lv.name for lv in regs.levels] == ["gmem", "registers"]
    assert regs.level("registers").count == 528
    assert regs.level("registers").bandwidth_bytes_per_s == 4.8e12
    assert regs.level("registers").multiple("mma_m") == 64
    # the tensor cores' shapes (stated on the registers level) bind tiles at any level kept
    assert smem.multiple("mma_m") == 64 and smem.multiple("mma_k_bytes") == 32
    l2 = H100_SXM.two_level("l2").level("l2")
    assert dataclasses.replace(l2, divisibility={}) == \
        dataclasses.replace(H100_SXM.level("l2"), divisibility={})
    assert l2.multiple("mma_m") == 64
    with pytest.raises(HardwareError, match="gmem"):
        H100_SXM.two_level("gmem")
    with pytest.raises(HardwareError, match="unknown level"):
        H100_SXM.two_level("l3")


def test_describe():
    text = H100_SXM.describe()
    lines = text.splitlines()
    assert "H100 SXM" in lines[0] and "132 SMs" in lines[0] and "1.83 GHz" in lines[0]
    assert len(lines) == 2 + len(H100_SXM.levels)
    for lv, line in zip(H100_SXM.levels, lines[2:]):
        assert line.split()[0] == lv.name
    assert "unbounded" in lines[2] and "3.35 TB/s" in lines[3] and "228 KiB" in lines[4]


# -- TOML -------------------------------------------------------------------------------------

def test_toml_toy(tmp_path):
    f = tmp_path / "toy.toml"
    f.write_text(TOY_TOML)
    hw = load_toml(f)
    assert hw.name == "toy"
    assert [lv.name for lv in hw.levels] == ["dram", "sram"]
    sram = hw.level("sram")
    assert (sram.capacity_bytes, sram.bandwidth_bytes_per_s, sram.count, sram.align_bytes) == (
        65536, 1e11, 4, 64)
    assert hw.peak_flops("f16") == 1e12 and hw.clock_hz == 1e9
    # Omitted chip fields get derived defaults.
    assert hw.sms == 4 and hw.smem_per_sm_bytes == hw.smem_per_block_max_bytes == 65536
    assert hw.registers_per_sm_bytes == 0 and hw.l2_bytes == 0 and hw.warpgroup_threads == 128
    assert hw.vector_flops_per_s is None and hw.exp_per_s is None
    assert hw.ridge_point("f16") == 10.0
    assert get_hardware(f) == hw and get_hardware(str(f)) == hw


def test_toml_name_defaults_to_file_stem(tmp_path):
    f = tmp_path / "mychip.toml"
    f.write_text(TOY_TOML.replace('name = "toy"\n', ""))
    assert load_toml(f).name == "mychip"


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_toml_round_trip_profiles(tmp_path, key):
    f = tmp_path / f"{key}.toml"
    f.write_text(PROFILES[key].to_toml())
    assert load_toml(f) == PROFILES[key]


@st.composite
def hierarchies(draw):
    n = draw(st.integers(2, 5))
    caps = sorted(draw(st.lists(st.integers(1, 2**40), min_size=n - 1, max_size=n - 1,
                                unique=True)), reverse=True)
    levels = [Level("top")]
    for i, cap in enumerate(caps):
        levels.append(Level(
            f"l{i}", cap, draw(st.floats(1e3, 1e15)), count=draw(st.integers(1, 256)),
            align_bytes=draw(st.sampled_from([1, 32, 64, 128])),
            divisibility=draw(st.dictionaries(st.sampled_from(["m", "n", "k bytes"]),
                                              st.integers(1, 256), max_size=2))))
    flops = draw(st.dictionaries(st.sampled_from(sorted(DTYPE_BYTES)), st.floats(1e9, 1e16)))
    return Hardware(name=draw(st.text(min_size=1, max_size=12)), levels=tuple(levels),
                    flops_per_s=flops, clock_hz=draw(st.floats(1e6, 5e9)))


@settings(max_examples=60, deadline=None)
@given(hierarchies())
def test_toml_round_trip_random(tmp_path_factory, hw):
    f = tmp_path_factory.mktemp("rt") / "hw.toml"
    f.write_text(hw.to_toml(), encoding="utf-8")
    assert load_toml(f) == hw


# -- validation -------------------------------------------------------------------------------

def _sram(**kw):
    return toy(levels=[{"name": "dram"}, {"name": "sram", "capacity_bytes": 65536,
                                          "bandwidth_bytes_per_s": 1e11, **kw}])


@pytest.mark.parametrize("data, words", [
    (_sram(capacity_bytes=0), ["toy", "sram", "capacity_bytes"]),
    (_sram(capacity_bytes=-5), ["toy", "sram", "capacity_bytes"]),
    (_sram(capacity_bytes=1.5), ["toy", "sram", "capacity_bytes", "integer"]),
    (_sram(bandwidth_bytes_per_s=0.0), ["toy", "sram", "bandwidth_bytes_per_s"]),
    (_sram(bandwidth_bytes_per_s=-1e9), ["toy", "sram", "bandwidth_bytes_per_s"]),
    (_sram(bandwidth_bytes_per_s=float("nan")), ["toy", "sram", "bandwidth_bytes_per_s"]),
    (_sram(count=0), ["toy", "sram", "count"]),
    (_sram(align_bytes=0), ["toy", "sram", "align_bytes"]),
    (_sram(divisibility={"m": 0}), ["toy", "sram", "divisibility"]),
    (toy(levels=[{"name": "dram"}, {"name": "sram", "capacity_bytes": 64}]),
     ["toy", "sram", "bandwidth_bytes_per_s", "required"]),
    (toy(levels=[{"name": "dram"}, {"name": "sram", "bandwidth_bytes_per_s": 1e9}]),
     ["toy", "sram", "capacity_bytes", "required"]),
    (toy(levels=[{"name": "dram", "bandwidth_bytes_per_s": 0}, _sram()["levels"][1]]),
     ["toy", "dram", "bandwidth_bytes_per_s"]),
    (toy(levels=[{"name": "dram", "capacity_bytes": 1024},
                 {"name": "sram", "capacity_bytes": 1024, "bandwidth_bytes_per_s": 1e9}]),
     ["toy", "sram", "capacity_bytes", "smaller", "dram"]),
    (toy(levels=[{"name": "dram"},
                 {"name": "l2", "capacity_bytes": 4096, "bandwidth_bytes_per_s": 1e9},
                 {"name": "sram", "capacity_bytes": 8192, "bandwidth_bytes_per_s": 1e9}]),
     ["toy", "sram", "capacity_bytes", "smaller", "l2"]),
    (toy(levels=[{"name": "dram"}, {"name": "dram", "capacity_bytes": 8,
                                    "bandwidth_bytes_per_s": 1e9}]), ["toy", "dram", "duplicate"]),
    (toy(flops_per_s={"f17": 1e12}), ["toy", "flops_per_s", "f17", "known", "bf16", "e4m3"]),
    (toy(flops_per_s={"f16": 0.0}), ["toy", "flops_per_s", "f16"]),
    (toy(levels=[{"name": "dram"}]), ["toy", "levels", "at least 2"]),
    (toy(levels=[]), ["toy", "levels", "at least 2"]),
    (toy(clock_hz=0), ["toy", "clock_hz"]),
    (toy(sms=0), ["toy", "sms"]),
    (toy(vector_flops_per_s=-1.0), ["toy", "vector_flops_per_s"]),
    (toy(smem_per_sm_bytes=1024, smem_per_block_max_bytes=2048),
     ["toy", "smem_per_block_max_bytes"]),
    (toy(clokc_hz=1e9), ["toy", "unknown field", "clokc_hz"]),
    (_sram(capcity_bytes=1), ["toy", "sram", "unknown field", "capcity_bytes"]),
    (toy(levels=[{"name": "dram"}, {"capacity_bytes": 1}]), ["toy", "levels[1]", "name"]),
])
def test_invalid_descriptions(data, words):
    with pytest.raises(HardwareError) as e:
        hardware_from_dict(data)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_invalid_direct_construction():
    with pytest.raises(HardwareError, match=r"'bad'.*level 'x'.*capacity_bytes"):
        Hardware("bad", (Level("top"), Level("x", -1, 1e9)))
    with pytest.raises(HardwareError, match=r"'bad'.*at least 2"):
        Hardware("bad", (Level("top"),))
    with pytest.raises(HardwareError, match=r"'H100 SXM'.*'smem'.*bandwidth_bytes_per_s"):
        levels = list(H100_SXM.levels)
        levels[2] = dataclasses.replace(levels[2], bandwidth_bytes_per_s=0.0)
        dataclasses.replace(H100_SXM, levels=tuple(levels))
    with pytest.raises(HardwareError, match=r"'H100 SXM'.*'registers'.*smaller.*'smem'"):
        levels = list(H100_SXM.levels)
        levels[3] = dataclasses.replace(levels[3], capacity_bytes=256 * 1024)
        dataclasses.replace(H100_SXM, levels=tuple(levels))


def test_invalid_toml_in_file_names_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text(TOY_TOML.replace("capacity_bytes = 65536", "capacity_bytes = 0"))
    with pytest.raises(HardwareError, match=r"bad\.toml.*'toy'.*'sram'.*capacity_bytes"):
        load_toml(f)


def test_missing_toml_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(HardwareError, match=r"nope\.toml.*not found"):
        load_toml(missing)
    with pytest.raises(HardwareError, match="not found"):
        get_hardware(str(missing))


def test_toml_syntax_error(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text('name = "toy"\nclock_hz = = 1\n')
    with pytest.raises(HardwareError) as e:
        load_toml(f)
    msg = str(e.value)
    assert "broken.toml" in msg and "TOML syntax error" in msg and "line 2" in msg
    assert "\n" not in msg
    assert e.value.__cause__ is not None  # tomllib's error is kept as the cause


def test_malformed_toml_shape(tmp_path):
    f = tmp_path / "shape.toml"
    f.write_text('name = "toy"\nflops_per_s = 3\n')
    with pytest.raises(HardwareError, match=r"shape\.toml.*malformed"):
        load_toml(f)


# -- name lookup -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("h100", H100_SXM), ("H100", H100_SXM), ("H100 SXM", H100_SXM), ("h100-sxm5", H100_SXM),
    ("NVIDIA H100 SXM", H100_SXM), ("a100", A100_SXM), ("A100 SXM 80GB", A100_SXM),
    ("a100_sxm4", A100_SXM), ("H200", H200), ("h200 sxm", H200),
])
def test_get_hardware_names(name, expected):
    assert get_hardware(name) is expected


def test_get_hardware_passes_hardware_through():
    assert get_hardware(H200) is H200


@pytest.mark.parametrize("name, suggestion", [("h10", "h100"), ("H2000", "h200"), ("a10", "a100")])
def test_unknown_profile_suggests(name, suggestion):
    with pytest.raises(HardwareError) as e:
        get_hardware(name)
    msg = str(e.value)
    assert f"unknown hardware profile '{name}'" in msg
    assert "known: a100, h100, h200" in msg
    assert f"did you mean '{suggestion}'?" in msg


def test_unknown_profile_without_close_match():
    with pytest.raises(HardwareError) as e:
        get_hardware("tpu-v5e")
    assert "known: a100, h100, h200" in str(e.value) and "did you mean" not in str(e.value)
