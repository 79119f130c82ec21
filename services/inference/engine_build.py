"""The one way an engine is built from settings: the service and the benchmark both call it, so
an engine measured by the benchmark is the engine the service runs with the same settings."""

from __future__ import annotations

from pathlib import Path

from aiserve.model_facts import read_model_facts
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.llama import LlamaModel
from services.inference.model import TORCH_DTYPES


def build_engine(config: InferenceConfig, folder: Path) -> BatchEngine:
    """Load the (verified) model folder and build the engine the settings describe (unstarted).

    Loads and allocates on the calling thread; the service calls it on a thread that then exits
    (torch_thread.py)."""
    dtype = TORCH_DTYPES[config.dtype]
    matmul = None if config.matmul_dtype == "auto" else TORCH_DTYPES[config.matmul_dtype]
    model = LlamaModel.load(folder, config.device, dtype, matmul)
    return BatchEngine(model, read_model_facts(folder).eos_token_ids, config.engine)
