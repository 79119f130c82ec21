"""One default per setting: the engine the benchmark measures is the engine the service builds
from the same settings (bench/engine_bench.py's sweep against the service's settings path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiserve.common.config import config_with, load_config
from bench.sweep import sweep_engine, sweep_settings
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine, machine_precision

SIZE = 1  # the sweep's smallest point: its KV cache is one slot of 256 bf16 tokens, ~5.9 MB


def service_engine(folder: Path, settings: dict[str, object]) -> BatchEngine:
    """What the service builds when its environment holds ``settings`` (AISERVE_INFERENCE_*)."""
    environ = {f"AISERVE_INFERENCE_{name.upper()}": str(value) for name, value in settings.items()}
    return build_engine(load_config(InferenceConfig, "inference", environ=environ), folder)


@pytest.fixture(scope="module")
def engines(model_dir: Path, two_torch_threads: None) -> tuple[BatchEngine, BatchEngine]:
    return service_engine(model_dir, sweep_settings(SIZE)), sweep_engine(model_dir, SIZE)


def test_the_bench_sweep_engine_is_the_service_engine(engines: tuple[BatchEngine, BatchEngine]) -> None:
    service, bench = engines
    assert service.config == bench.config  # every engine setting: scheduler, KV cache, limits
    assert service.cache.plan == bench.cache.plan  # slots, slot length, prefix blocks
    assert (service.scheduler.capacity, service.scheduler.slot_len) == (bench.scheduler.capacity,
                                                                        bench.scheduler.slot_len)
    assert service.scheduler.config == bench.scheduler.config
    assert (service.model.dtype, service.model.matmul_dtype, service.model.device) == (
        bench.model.dtype, bench.model.matmul_dtype, bench.model.device)
    assert service.model.packed_weights == bench.model.packed_weights
    assert service.eos_ids == bench.eos_ids


def test_the_sweep_settings_take_effect(engines: tuple[BatchEngine, BatchEngine]) -> None:
    """Not two engines that both ignore the settings: the sweep's values are the ones in force."""
    service, _ = engines
    settings = sweep_settings(SIZE)
    scheduler, kv = service.config.scheduler, service.config.kv_cache
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.max_queue) == (
        settings["max_num_seqs"], settings["max_num_batched_tokens"], settings["max_queue"])
    assert (kv.kv_cache_bytes, kv.max_seq_len, kv.prefix_cache_fraction) == (
        0, settings["max_seq_len"], settings["prefix_cache_fraction"])  # sized from the sequences
    assert str(service.model.dtype) == "torch." + str(settings["dtype"])
    # matmul_dtype "auto": the machine's choice (float32 copies where bf16 products are emulated)
    chosen = machine_precision(config_with(InferenceConfig, **settings))
    assert str(service.model.matmul_dtype) == "torch." + chosen.matmul
    assert service.model.packed_weights == (chosen.matmul == "bfloat16")
    plan = service.cache.plan
    assert (plan.num_slots, plan.slot_len, plan.num_blocks) == (SIZE, 256, 0)
    assert service.scheduler.prefix is None  # no prefix store
