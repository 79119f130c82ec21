"""The inference service's settings: every validate() runs, and a bad value names its setting."""

from __future__ import annotations

import pytest

from aiserve.common.config import ConfigError, config_with, load_config, settings_of
from services.inference.config import InferenceConfig
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig

# One value out of range (or malformed) for each setting that has a limit, by group.
BAD_VALUES: dict[str, object] = {
    # every service
    "host": " ", "port": 70000, "metrics_port": -1, "log_level": "loud", "grace_s": 601.0, "announce_fd": -2,
    # the model and where it runs
    "model": "no-version", "device": "tpu", "dtype": "int8", "matmul_dtype": "float64", "torch_threads": -1,
    "native_ops": "sometimes",
    # the scheduler
    "max_num_seqs": 0, "max_num_batched_tokens": 1 << 21, "max_queue": 0, "batch_wait_ms": -1.0,
    "num_speculative_tokens": 17, "speculative_max_step_tokens": -2,
    # the KV cache
    "kv_cache_bytes": 1 << 19, "max_seq_len": 15, "prefix_cache_fraction": 0.95, "prefix_block_size": 0,
    "kv_dtype": "fp4", "refuse_long_above": 1.5, "long_context_tokens": 0,
    # the engine's limit
    "max_new_tokens_limit": 0, "step_delay_ms": 10_001,
    # health
    "health_probe_interval_s": 0.0, "health_probe_timeout_s": 601.0, "min_free_memory_bytes": -1,
}
UNBOUNDED = {"model_store", "enable_preemption", "fault_file"}  # any string / either boolean is valid


def test_the_defaults_are_valid() -> None:
    config = config_with(InferenceConfig)
    assert config.engine == EngineConfig()
    assert (config.engine.scheduler, config.engine.kv_cache) == (SchedulerConfig(), KVCacheConfig())


def test_every_limited_setting_has_a_bad_value_here() -> None:
    assert set(BAD_VALUES) | UNBOUNDED == set(settings_of(InferenceConfig))


@pytest.mark.parametrize(("name", "value"), BAD_VALUES.items())
def test_a_bad_value_raises_config_error_naming_the_setting(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}: must"):
        config_with(InferenceConfig, **{name: value})


@pytest.mark.parametrize(("name", "value"), [("max_num_seqs", "0"), ("prefix_cache_fraction", "0.95"),
                                             ("device", "tpu"), ("port", "70000")])
def test_the_environment_path_validates_too(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}: must be"):
        load_config(InferenceConfig, "inference", environ={f"AISERVE_INFERENCE_{name.upper()}": value})


def test_the_step_budget_must_hold_every_running_sequence() -> None:
    with pytest.raises(ConfigError, match=r"^max_num_batched_tokens: must be max_num_seqs \(64\)"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32).validate()
    SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64).validate()


@pytest.mark.parametrize(("component", "name"), [
    (SchedulerConfig(max_queue=0), "max_queue"),
    (KVCacheConfig(prefix_cache_fraction=1.5), "prefix_cache_fraction"),
    (EngineConfig(max_new_tokens_limit=0), "max_new_tokens_limit"),
    (EngineConfig(scheduler=SchedulerConfig(max_num_seqs=0)), "max_num_seqs"),
    (EngineConfig(kv_cache=KVCacheConfig(max_seq_len=8)), "max_seq_len"),
])
def test_component_configs_validate_on_their_own(component: SchedulerConfig | KVCacheConfig | EngineConfig,
                                                 name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}: must be"):
        component.validate()


def test_a_malformed_value_names_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"^max_num_seqs: expected int"):
        load_config(InferenceConfig, "inference", environ={"AISERVE_INFERENCE_MAX_NUM_SEQS": "many"})
