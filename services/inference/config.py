"""Settings of the inference service (``AISERVE_INFERENCE_*``, DESIGN.md §3)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from aiserve.common.config import ServiceConfig, require
from aiserve.store import DEFAULT_MODEL_REF, default_store_path
from services.inference.kv_cache import KVCacheConfig
from services.inference.scheduler import SchedulerConfig

DTYPES = ("bfloat16", "float32", "float16")
MATMUL_DTYPES = ("auto", *DTYPES)
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
    matmul_dtype: str = "auto"
    """Dtype of the large matrix products: "auto" = float32 on a CPU without bf16 instructions
    for a 16-bit model (bf16 GEMMs are emulated there), else ``dtype``; or a dtype name."""
    max_queue: int = 256
    """Requests that may wait for a place in the batch at once; one more is RESOURCE_EXHAUSTED."""
    max_new_tokens_limit: int = 4096
    """Largest max_new_tokens one request may ask for (max_seq_len also bounds it)."""
    max_num_seqs: int = 64
    """Sequences in the running batch at once (each holds one KV slot); the knee of the
    batch-size sweep (bench/engine_bench.py, README)."""
    max_num_batched_tokens: int = 512
    """Tokens computed per step: every decode first, then prefill chunks with the rest, so a long
    prompt never stalls running decodes. max_num_seqs..1048576."""
    batch_wait_ms: float = 5.0
    """When nothing runs, a new arrival waits this long (ms) for company before the first step."""
    enable_preemption: bool = True
    """A waiting request of higher priority may evict the lowest-priority running sequence
    (recomputed when it is admitted again) when every slot is taken."""
    kv_cache_bytes: int = 3 << 30
    """Bytes of the KV cache (slots + prefix store), allocated once at start. 3 GiB holds 64
    bf16 slots of 2048 tokens for the default model (32 in float32); fewer slots than
    max_num_seqs caps the batch at the slots (logged at start)."""
    max_seq_len: int = 2048
    """Tokens of prompt + output one sequence may hold (one KV slot); capped by the model's
    context length. Info reports min(model context, max_seq_len)."""
    prefix_cache_fraction: float = 0.05
    """Share of kv_cache_bytes kept for reusable prompt prefixes; 0 disables prefix caching."""
    prefix_block_size: int = 16
    """Tokens per prefix block; prefixes are matched in whole blocks."""
    num_speculative_tokens: int = 2
    """Speculative decoding for greedy requests: draft tokens a sequence may add to a step,
    found by n-gram lookup in its own prompt and output and verified in the same forward (the
    output is unchanged); 0 disables it. 0..16."""
    speculative_max_step_tokens: int = 32
    """Drafts only fill a step up to this many tokens (small steps compute them almost free;
    max_num_batched_tokens bounds every step anyway). 0..1048576."""

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
        require(self.matmul_dtype in MATMUL_DTYPES,
                f"matmul_dtype: must be one of {'|'.join(MATMUL_DTYPES)}, got {self.matmul_dtype!r}")
        self.scheduler_config().validate()
        self.kv_cache_config().validate()

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's share of these settings."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_queue,
                               self.batch_wait_ms, self.enable_preemption, self.num_speculative_tokens,
                               self.speculative_max_step_tokens)

    def kv_cache_config(self) -> KVCacheConfig:
        """The KV cache's share of these settings."""
        return KVCacheConfig(self.kv_cache_bytes, self.max_seq_len, self.prefix_cache_fraction,
                             self.prefix_block_size)

    def model_store_path(self) -> Path:
        """The store folder this config names, with "" resolved to the suite's default."""
        return Path(self.model_store) if self.model_store else default_store_path()
