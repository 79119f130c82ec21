"""Settings of the inference service (``AISERVE_INFERENCE_*``, DESIGN.md §3)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from aiserve.common.config import ServiceConfig, require
from aiserve.store import DEFAULT_MODEL_REF, default_store_path

DTYPES = ("bfloat16", "float32", "float16")
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class InferenceConfig(ServiceConfig):
    """Settings of the inference service: which model, where it runs, how much it queues."""

    port: int = 50053
    """gRPC port (internal network only; the gateway calls it)."""
    metrics_port: int = 9103
    """Prometheus HTTP port; 0 disables it."""
    model: str = DEFAULT_MODEL_REF
    """The model to load, ``name@version``; its files are verified against the manifest."""
    model_store: str = ""
    """Model store folder; "" = ``AISERVE_MODEL_STORE`` or ``$AISERVE_HOME/models``."""
    device: str = "cpu"
    """Torch device: "cpu", "cuda" or "cuda:N"."""
    dtype: str = "bfloat16"
    """Weight and activation dtype: "bfloat16", "float32" or "float16"."""
    torch_threads: int = 0
    """Torch intra-op threads; 0 leaves torch's default (the suite runner sets it)."""
    max_queue: int = 256
    """Requests that may wait for the model at once; one more is RESOURCE_EXHAUSTED."""
    max_new_tokens_limit: int = 4096
    """Largest max_new_tokens one request may ask for (the context length also bounds it)."""

    def validate(self) -> None:
        super().validate()
        require("@" in self.model, f"model: must be 'name@version', got {self.model!r}")
        require(bool(_DEVICE_RE.fullmatch(self.device)),
                f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        require(self.dtype in DTYPES, f"dtype: must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        require(0 <= self.torch_threads <= 1024,
                f"torch_threads: must be 0..1024 (0 = torch default), got {self.torch_threads}")
        require(1 <= self.max_queue <= 100_000, f"max_queue: must be 1..100000, got {self.max_queue}")
        require(1 <= self.max_new_tokens_limit <= 1_000_000,
                f"max_new_tokens_limit: must be 1..1000000, got {self.max_new_tokens_limit}")

    def model_store_path(self) -> Path:
        """The store folder this config names, with "" resolved to the suite's default."""
        return Path(self.model_store) if self.model_store else default_store_path()
