"""The one way an engine is built from settings: the service and the benchmark both call it, so
an engine measured by the benchmark is the engine the service runs with the same settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from aiserve.common.cpu import caps_note, read_cpu_flags
from aiserve.model_facts import read_model_facts
from services.inference import native_ops
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_config import EngineConfig
from services.inference.grammar import Grammars
from services.inference.llama import LlamaModel
from services.inference.model import TORCH_DTYPES
from services.inference.precision import Precision, choose_precision


def machine_precision(config: InferenceConfig) -> Precision:
    """The precision ``config`` runs in on this machine (its CPU flags read from /proc/cpuinfo, less
    those an instruction-set cap in the environment leaves unusable, which the reason names), and
    whether it runs our CPU ops (loading them where chosen; ConfigError where the setting asks for
    them and they cannot run here)."""
    flags = read_cpu_flags()
    precision = choose_precision(config.device, flags, config.dtype, config.matmul_dtype)
    if not config.device.startswith("cuda"):
        precision = dataclasses.replace(precision, reason=precision.reason + caps_note())
    if config.engine.kv_cache.kv_dtype == "int8":
        precision = dataclasses.replace(precision, kv="int8", reason=precision.reason + " (kv_dtype=int8 set)")
    on, why = native_ops.choose(config.native_ops, torch.device(config.device), precision.weights, flags)
    return dataclasses.replace(precision, native_ops=native_ops.ON if on else native_ops.OFF, native_ops_reason=why)


def build_engine(config: InferenceConfig, folder: Path, precision: Precision | None = None) -> BatchEngine:
    """Load the (verified) model folder and build the engine the settings describe (unstarted),
    in ``precision`` (None = ``machine_precision(config)``).

    Loads and allocates on the calling thread; the service calls it on a thread that then exits
    (torch_thread.py)."""
    precision = precision or machine_precision(config)
    model = LlamaModel.load(folder, config.device, TORCH_DTYPES[precision.weights], TORCH_DTYPES[precision.matmul],
                            native_ops=precision.native_ops == native_ops.ON)
    eos_ids = read_model_facts(folder).eos_token_ids
    grammars = Grammars(folder / "tokenizer.json", model.config.vocab_size, eos_ids)
    return BatchEngine(model, eos_ids, machine_engine_config(config, precision), grammars)


def machine_engine_config(config: InferenceConfig, precision: Precision) -> EngineConfig:
    """The engine's settings with "auto" (-1) resolved for this machine: ``speculative_max_step_tokens``."""
    scheduler = config.engine.scheduler
    if scheduler.speculative_max_step_tokens >= 0:
        return config.engine
    scheduler = dataclasses.replace(scheduler, speculative_max_step_tokens=precision.draft_step_tokens)
    return dataclasses.replace(config.engine, scheduler=scheduler)
