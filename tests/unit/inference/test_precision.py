"""Precision chosen by the machine (CPU flags injected)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiserve.common.config import ConfigError, config_with, load_config
from services.inference.config import InferenceConfig
from services.inference.precision import CPU_KINDS, POLICY, choose_precision, machine_kind, read_cpu_flags

# The flags that matter, as /proc/cpuinfo lists them on each machine (plus a few that do not).
AMX_XEON = frozenset("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile "
                     "amx_int8".split())
AVX512_BF16_EPYC = frozenset("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni".split())
AVX512_XEON = frozenset("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni".split())
AVX2_EPYC = frozenset("fpu sse4_2 avx avx2 fma sha_ni".split())


@pytest.mark.parametrize(("flags", "kind", "matmul", "used"), [
    (AMX_XEON, "amx", "bfloat16", ("amx_bf16", "avx512_bf16", "avx512f", "avx2")),
    (AVX512_BF16_EPYC, "avx512_bf16", "bfloat16", ("avx512_bf16", "avx512f", "avx2")),
    (AVX512_XEON, "avx512", "float32", ("avx512f", "avx2")),
    (AVX2_EPYC, "avx2", "float32", ("avx2",)),
    (frozenset(), "other", "float32", ()),  # no flags line (ARM) or no /proc/cpuinfo
])
def test_auto_on_each_cpu_kind(flags: frozenset[str], kind: str, matmul: str, used: tuple[str, ...]) -> None:
    """bf16 weights and KV everywhere; bf16 products only where the CPU has bf16 instructions,
    float32 copies where bf16 products would be emulated."""
    p = choose_precision("cpu", flags, "auto", "auto")
    assert (p.weights, p.matmul, p.kv, p.cpu, p.cpu_flags) == ("bfloat16", matmul, "bfloat16", kind, used)
    assert p.reason == f"{kind}: {POLICY[kind].why}" and "\n" not in p.reason


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_is_bfloat16_everywhere_whatever_the_host_cpu(device: str) -> None:
    for flags in (AVX2_EPYC, AMX_XEON):
        p = choose_precision(device, flags, "auto", "auto")
        assert (p.weights, p.matmul, p.kv, p.cpu, p.cpu_flags) == ("bfloat16", "bfloat16", "bfloat16", "cuda", ())


@pytest.mark.parametrize(("device", "flags", "dtype", "matmul_dtype", "expected"), [
    # an explicit dtype wins; "auto" matmul then follows the rule for that dtype
    ("cpu", AMX_XEON, "float32", "auto", ("float32", "float32", "float32")),
    ("cpu", AVX2_EPYC, "float32", "auto", ("float32", "float32", "float32")),
    ("cpu", AVX2_EPYC, "float16", "auto", ("float16", "float32", "float16")),
    ("cpu", AVX512_BF16_EPYC, "float16", "auto", ("float16", "float16", "float16")),
    ("cuda", frozenset(), "float32", "auto", ("float32", "float32", "float32")),
    # an explicit matmul_dtype wins over the machine's
    ("cpu", AVX2_EPYC, "auto", "bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
    ("cpu", AMX_XEON, "auto", "float32", ("bfloat16", "float32", "bfloat16")),
    ("cpu", AMX_XEON, "bfloat16", "float32", ("bfloat16", "float32", "bfloat16")),
])
def test_explicit_settings_win_over_auto(device: str, flags: frozenset[str], dtype: str, matmul_dtype: str,
                                         expected: tuple[str, str, str]) -> None:
    p = choose_precision(device, flags, dtype, matmul_dtype)
    assert (p.weights, p.matmul, p.kv) == expected
    assert p.cpu == machine_kind(device, flags)  # the machine is still reported
    for name, value in (("dtype", dtype), ("matmul_dtype", matmul_dtype)):
        assert (f"{name}={value}" in p.reason) == (value != "auto")


def test_the_policy_has_one_row_per_kind() -> None:
    assert set(POLICY) == {kind for kind, _ in CPU_KINDS} | {"cuda", "other"}


def test_cpu_flags_are_read_from_the_first_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # ARM: no "flags" line
    assert read_cpu_flags(cpuinfo) == frozenset()
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


def test_this_machines_flags_give_a_known_kind() -> None:
    assert machine_kind("cpu", read_cpu_flags()) in POLICY


def test_auto_is_the_default_and_valid() -> None:
    config = config_with(InferenceConfig)
    assert (config.dtype, config.matmul_dtype) == ("auto", "auto")
    environ = {"AISERVE_INFERENCE_DTYPE": "float32", "AISERVE_INFERENCE_MATMUL_DTYPE": "auto"}
    loaded = load_config(InferenceConfig, "inference", environ=environ)
    assert (loaded.dtype, loaded.matmul_dtype) == ("float32", "auto")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("dtype", "Auto", r"^dtype: must be one of auto\|bfloat16\|float32\|float16, got 'Auto'"),
    ("matmul_dtype", "int8", r"^matmul_dtype: must be one of auto\|bfloat16"),
])
def test_bad_precision_values_name_the_setting(name: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_with(InferenceConfig, **{name: value})
