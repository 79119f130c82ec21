"""Settings of the inference service (``AISERVE_INFERENCE_*``; how settings load: aiserve/common/config.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from aiserve.common.config import ServiceConfig, require
from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, is_model_ref
from services.inference.engine_config import EngineConfig
from services.inference.health import HealthConfig
from services.inference.precision import AUTO, DTYPES

SETTING_DTYPES = (AUTO, *DTYPES)
NATIVE_OPS_CHOICES = (AUTO, "on", "off")
"""Values of ``native_ops`` (services/inference/native_ops.py)."""
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
    dtype: str = AUTO
    """Weight, activation and KV cache dtype: "auto" = chosen by the machine (bfloat16 on CUDA and
    on CPUs today: services/inference/precision.py), or "bfloat16", "float32", "float16"."""
    torch_threads: int = 0
    """Torch intra-op threads; 0 leaves torch's default (the suite runner sets it)."""
    matmul_dtype: str = AUTO
    """Dtype of the large matrix products: "auto" = chosen by the machine (float32 copies for a
    16-bit model on a CPU without bf16 instructions, where bf16 GEMMs are emulated; else the
    weights' dtype: services/inference/precision.py), or a dtype name, which wins."""
    native_ops: str = AUTO
    """Our CPU ops for the decode attention, the RMSNorms and the rotary embedding: "auto" = where
    they are built and the model runs on a CPU with AVX2 + FMA in bfloat16 or float32, else
    torch's; "on" = ours or refuse to start; "off" = torch's (services/inference/native_ops.py)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's settings (scheduler, KV cache, limits), given by their own flat names:
    ``max_num_seqs``, ``kv_cache_bytes``, ... (services/inference/engine_config.py)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """How the service checks itself, by flat names too: ``health_probe_interval_s``,
    ``health_probe_timeout_s``, ``min_free_memory_bytes``, ``fault_file`` (services/inference/health.py)."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        super().validate()
        require(is_model_ref(self.model), f"model: must be 'name@version', got {self.model!r}")
        require(bool(_DEVICE_RE.fullmatch(self.device)),
                f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        require(self.dtype in SETTING_DTYPES,
                f"dtype: must be one of {'|'.join(SETTING_DTYPES)}, got {self.dtype!r}")
        require(0 <= self.torch_threads <= 1024,
                f"torch_threads: must be 0..1024 (0 = torch default), got {self.torch_threads}")
        require(self.matmul_dtype in SETTING_DTYPES,
                f"matmul_dtype: must be one of {'|'.join(SETTING_DTYPES)}, got {self.matmul_dtype!r}")
        require(self.native_ops in NATIVE_OPS_CHOICES,
                f"native_ops: must be one of {'|'.join(NATIVE_OPS_CHOICES)}, got {self.native_ops!r}")
        self.engine.validate()
        self.health.validate()

    def model_store_path(self) -> Path:
        """The store folder this config names, with "" resolved to the suite's default."""
        return model_store_path(self.model_store)
