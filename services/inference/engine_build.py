"""The one way an engine is built from settings: the service and the benchmark both call it, so
an engine measured by the benchmark is the engine the service runs with the same settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from aiserve.model_facts import read_model_facts
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.grammar import Grammars
from services.inference.llama import LlamaModel
from services.inference.model import TORCH_DTYPES
from services.inference.precision import Precision, choose_precision, read_cpu_flags


def machine_precision(config: InferenceConfig) -> Precision:
    """The precision ``config`` runs in on this machine (its CPU flags read from /proc/cpuinfo)."""
    precision = choose_precision(config.device, read_cpu_flags(), config.dtype, config.matmul_dtype)
    if config.engine.kv_cache.kv_dtype == "int8":
        return dataclasses.replace(precision, kv="int8", reason=precision.reason + " (kv_dtype=int8 set)")
    return precision


def build_engine(config: InferenceConfig, folder: Path, precision: Precision | None = None) -> BatchEngine:
    """Load the (verified) model folder and build the engine the settings describe (unstarted),
    in ``precision`` (None = ``machine_precision(config)``).

    Loads and allocates on the calling thread; the service calls it on a thread that then exits
    (torch_thread.py)."""
    precision = precision or machine_precision(config)
    model = LlamaModel.load(folder, config.device, TORCH_DTYPES[precision.weights], TORCH_DTYPES[precision.matmul])
    eos_ids = read_model_facts(folder).eos_token_ids
    grammars = Grammars(folder / "tokenizer.json", model.config.vocab_size, eos_ids)
    return BatchEngine(model, eos_ids, config.engine, grammars)
