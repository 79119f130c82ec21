"""Precision chosen by the machine (CPU flags injected) and the KV cache sized in sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiserve.common.config import ConfigError, config_with, load_config
from aiserve.common.cpu import CPU_KINDS, machine_kind, read_cpu_flags
from services.inference.config import InferenceConfig
from services.inference.draft_planning import step_limit
from services.inference.engine_build import machine_engine_config
from services.inference.engine_config import DRAFT_STEP_TOKENS, KVCacheConfig
from services.inference.kv_cache import KVLayout, KVPlan
from services.inference.precision import POLICY, choose_precision

# The flags that matter, as /proc/cpuinfo lists them on each machine (plus a few that do not).
AMX_XEON = frozenset("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile "
                     "amx_int8".split())
AVX512_BF16_EPYC = frozenset("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni".split())
AVX512_XEON = frozenset("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni".split())
AVX2_EPYC = frozenset("fpu sse4_2 avx avx2 fma sha_ni".split())
SMOLLM = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # the default model's K/V shape


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


@pytest.mark.parametrize(("device", "flags", "tokens"), [
    ("cuda", AVX2_EPYC, 32), ("cpu", AMX_XEON, 32),  # a 32-row step costs about one row's weight read
    ("cpu", AVX512_BF16_EPYC, 8), ("cpu", AVX512_XEON, 8), ("cpu", AVX2_EPYC, 8), ("cpu", frozenset(), 8),
])
def test_how_full_drafts_may_make_a_step_follows_the_machine(device: str, flags: frozenset[str],
                                                             tokens: int) -> None:
    precision = choose_precision(device, flags, "auto", "auto")
    assert precision.draft_step_tokens == tokens
    auto = config_with(InferenceConfig)
    assert auto.engine.scheduler.speculative_max_step_tokens == -1
    assert machine_engine_config(auto, precision).scheduler.speculative_max_step_tokens == tokens
    explicit = config_with(InferenceConfig, speculative_max_step_tokens=16)
    assert machine_engine_config(explicit, precision) == explicit.engine  # a number set wins
    assert step_limit(auto.engine.scheduler) == DRAFT_STEP_TOKENS  # unresolved: the old default


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


def plan(dtype: torch.dtype, config: KVCacheConfig | None = None, max_num_seqs: int = 64,
         context_len: int = 8192) -> KVPlan:
    return KVPlan.fit(config or KVCacheConfig(), KVLayout(dtype=dtype, **SMOLLM), max_num_seqs, context_len)


def total_bytes(p: KVPlan, dtype: torch.dtype) -> int:
    per_token = KVLayout(dtype=dtype, **SMOLLM).bytes_per_token
    return (p.num_slots * p.slot_len + p.num_blocks * p.block_size) * per_token


def test_by_default_float32_holds_as_many_sequences_as_bf16() -> None:
    bf16, fp32 = plan(torch.bfloat16), plan(torch.float32)
    assert (bf16.num_slots, bf16.slot_len) == (fp32.num_slots, fp32.slot_len) == (64, 2048)
    assert bf16.num_blocks == fp32.num_blocks  # the same prefix tokens too, in twice the bytes
    assert total_bytes(fp32, torch.float32) == 2 * total_bytes(bf16, torch.bfloat16)
    slots = 64 * 2048 * 23_040  # the default model's bf16 slots: 2.81 GiB
    assert slots < total_bytes(bf16, torch.bfloat16) <= slots / 0.95  # + the prefix store's 5% of the whole
    assert total_bytes(bf16, torch.bfloat16) > slots / 0.95 - 16 * 23_040  # less than one block short


def test_sized_from_sequences_follows_max_num_seqs_and_the_context() -> None:
    p = plan(torch.float32, KVCacheConfig(max_seq_len=4096, prefix_cache_fraction=0.0), max_num_seqs=3,
             context_len=1024)
    assert (p.num_slots, p.slot_len, p.num_blocks) == (3, 1024, 0)  # max_seq_len capped by the context


def test_an_explicit_byte_budget_wins() -> None:
    config = KVCacheConfig(kv_cache_bytes=3 << 30)  # the budget that used to be the default
    bf16, fp32 = plan(torch.bfloat16, config), plan(torch.float32, config)
    assert (bf16.num_slots, fp32.num_slots) == (64, 32)  # float32 gets half the sequences
    assert total_bytes(bf16, torch.bfloat16) <= 3 << 30 and total_bytes(fp32, torch.float32) <= 3 << 30


def test_a_cache_sized_over_a_tebibyte_is_refused() -> None:
    with pytest.raises(ValueError, match="^max_num_seqs: 4096 slots .* over 1 TiB"):
        plan(torch.float32, KVCacheConfig(max_seq_len=1 << 20), max_num_seqs=4096, context_len=1 << 20)


def test_auto_and_sized_from_sequences_are_the_defaults_and_valid() -> None:
    config = config_with(InferenceConfig)
    assert (config.dtype, config.matmul_dtype, config.engine.kv_cache.kv_cache_bytes) == ("auto", "auto", 0)
    environ = {"AISERVE_INFERENCE_DTYPE": "float32", "AISERVE_INFERENCE_MATMUL_DTYPE": "auto",
               "AISERVE_INFERENCE_KV_CACHE_BYTES": str(1 << 30)}
    loaded = load_config(InferenceConfig, "inference", environ=environ)
    assert (loaded.dtype, loaded.matmul_dtype, loaded.engine.kv_cache.kv_cache_bytes) == ("float32", "auto", 1 << 30)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("dtype", "Auto", r"^dtype: must be one of auto\|bfloat16\|float32\|float16, got 'Auto'"),
    ("matmul_dtype", "int8", r"^matmul_dtype: must be one of auto\|bfloat16"),
    ("kv_cache_bytes", -1, r"^kv_cache_bytes: must be 0 \(sized from sequences\) or 1 MiB\.\.1 TiB, got -1"),
    ("kv_cache_bytes", (1 << 40) + 1, r"^kv_cache_bytes: must be 0"),
])
def test_bad_precision_and_budget_values_name_the_setting(name: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_with(InferenceConfig, **{name: value})
