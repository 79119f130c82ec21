"""The engine's settings: the scheduler's, the KV cache's and the engine's own, each default once.

The inference service's settings (``InferenceConfig``) embed these; the settings loader maps
the flat names (``AISERVE_INFERENCE_MAX_NUM_SEQS``, ``--kv-cache-bytes``) onto them, so an
engine built in a test or a benchmark from the same values is the engine the service runs.
Pure Python: no torch, no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiserve.common.config import require

DRAFT_STEP_TOKENS = 32
"""``speculative_max_step_tokens`` where it is -1 and nothing resolved it for a machine (an
engine built straight from a config); the service resolves it (engine_build.py)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler batches: the running batch, the per-step budget and the queue."""

    max_num_seqs: int = 64
    """Sequences in the running batch at once (each holds one KV slot); the knee of the
    batch-size sweep (bench/engine_bench.py, README). 1..4096."""
    max_num_batched_tokens: int = 512
    """Tokens computed per step: every decode first, then prefill chunks with what is left, so a
    long prompt is prefilled in chunks and never stalls running decodes. max_num_seqs..1048576."""
    max_queue: int = 256
    """Requests that may wait for a place in the batch at once; one more is RESOURCE_EXHAUSTED.
    1..100000."""
    batch_wait_ms: float = 5.0
    """When nothing runs, a new arrival waits this long (ms) for company before the first step (a
    full batch fires at once). Running batches take new requests at the next step. 0..10000."""
    enable_preemption: bool = True
    """When every slot is taken, a waiting request of higher priority evicts the lowest-priority
    running sequence, which is recomputed when it is admitted again."""
    num_speculative_tokens: int = 2
    """Speculative decoding for greedy requests: draft tokens a sequence may add to a step, found
    by n-gram lookup in its own prompt and output and verified in the same forward (the output is
    unchanged); 0 disables it. 0..16."""
    speculative_max_step_tokens: int = -1
    """Drafts only fill a step up to this many tokens: a small step reads the weights anyway and
    computes the drafts almost for free, a large one pays for each draft row. -1 = chosen by the
    machine (precision.draft_step_tokens: 32 where bf16 products are cheap at 32 rows, CUDA and
    AMX; 8 elsewhere; ``DRAFT_STEP_TOKENS`` where nothing chose); 0..1048576 wins."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(1 <= self.max_num_seqs <= 4096, f"max_num_seqs: must be 1..4096, got {self.max_num_seqs}")
        require(self.max_num_seqs <= self.max_num_batched_tokens <= 1 << 20,
                f"max_num_batched_tokens: must be max_num_seqs ({self.max_num_seqs})..{1 << 20}, "
                f"got {self.max_num_batched_tokens}")
        require(1 <= self.max_queue <= 100_000, f"max_queue: must be 1..100000, got {self.max_queue}")
        require(0.0 <= self.batch_wait_ms <= 10_000,
                f"batch_wait_ms: must be 0..10000 ms, got {self.batch_wait_ms}")
        require(0 <= self.num_speculative_tokens <= 16,
                f"num_speculative_tokens: must be 0..16, got {self.num_speculative_tokens}")
        require(-1 <= self.speculative_max_step_tokens <= 1 << 20,
                f"speculative_max_step_tokens: must be -1 (auto) or 0..{1 << 20}, "
                f"got {self.speculative_max_step_tokens}")


KV_DTYPES = ("auto", "int8")
"""KV cache storage: the activations' dtype, or int8 with a scale per token per head."""


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """How much memory the KV cache takes (by default: what max_num_seqs sequences need) and how
    it is split."""

    kv_cache_bytes: int = 0
    """Bytes of the KV cache (slots + prefix store), allocated once at start. 0 = sized from
    sequences: max_num_seqs slots of max_seq_len tokens (capped by the model's context) in the KV
    dtype, plus the prefix store's share, so float32 holds as many sequences as bf16 (the
    defaults: ~2.96 GiB in bf16 for the default model, twice that in float32). A non-zero
    budget wins: as many slots as it holds, at most max_num_seqs (fewer caps the batch; logged
    at start). 0, or 1 MiB..1 TiB."""
    max_seq_len: int = 2048
    """Tokens of prompt + output one sequence may hold (one KV slot); capped by the model's
    context length. Longer requests are refused; shorter slots mean more of them in the same
    budget. Info reports min(model context, max_seq_len). 16..1048576."""
    prefix_cache_fraction: float = 0.05
    """Share of the KV cache kept for reusable prompt prefixes; 0 disables prefix caching. 0..0.9."""
    prefix_block_size: int = 16
    """Tokens per prefix block; prefixes are matched in whole blocks. 1..1024."""
    kv_dtype: str = "auto"
    """How K/V are stored: "auto" = the activations' dtype; "int8" = symmetric int8 with one
    float32 scale per token per head (0.53x of bf16's bytes for head_dim 64: about 1.9x the
    sequences in the same kv_cache_bytes), dequantized by the attention each step."""
    refuse_long_above: float = 0.0
    """KV cache fill (used / total bytes) over which a new request needing more than
    long_context_tokens is refused with RESOURCE_EXHAUSTED at once, rather than queued to wait
    for or preempt what runs (thrashing). 0 = off; 0..1."""
    long_context_tokens: int = 1024
    """Prompt + max_new_tokens above which a request counts as long for refuse_long_above. 1..1048576."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(self.kv_cache_bytes == 0 or 1 << 20 <= self.kv_cache_bytes <= 1 << 40,
                f"kv_cache_bytes: must be 0 (sized from sequences) or 1 MiB..1 TiB, got {self.kv_cache_bytes}")
        require(16 <= self.max_seq_len <= 1 << 20,
                f"max_seq_len: must be 16..1048576, got {self.max_seq_len}")
        require(0.0 <= self.prefix_cache_fraction <= 0.9,
                f"prefix_cache_fraction: must be 0..0.9, got {self.prefix_cache_fraction}")
        require(1 <= self.prefix_block_size <= 1024,
                f"prefix_block_size: must be 1..1024, got {self.prefix_block_size}")
        require(self.kv_dtype in KV_DTYPES, f"kv_dtype: must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        require(0.0 <= self.refuse_long_above <= 1.0,
                f"refuse_long_above: must be 0..1, got {self.refuse_long_above}")
        require(1 <= self.long_context_tokens <= 1 << 20,
                f"long_context_tokens: must be 1..1048576, got {self.long_context_tokens}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything a ``BatchEngine`` is built from besides its model."""

    max_new_tokens_limit: int = 4096
    """Largest max_new_tokens one request may ask for (max_seq_len also bounds it). 1..1000000."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    step_delay_ms: int = 0
    """A TEST setting: every engine step waits this long before its forward, so a version can
    be made slower on purpose (the canary judgement's tests and drills); 0 = off. 0..10000."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(1 <= self.max_new_tokens_limit <= 1_000_000,
                f"max_new_tokens_limit: must be 1..1000000, got {self.max_new_tokens_limit}")
        require(0 <= self.step_delay_ms <= 10_000, f"step_delay_ms: must be 0..10000, got {self.step_delay_ms}")
        self.scheduler.validate()
        self.kv_cache.validate()
