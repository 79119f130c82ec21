"""The batch-size sweep: throughput and latency of the in-process engine against max_num_seqs,
and the knee of the curve."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiserve.common.config import config_with
from bench.measure import Timing, consume, percentiles, tpot
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine
from services.inference.request import GenerateRequest
from services.inference.torch_thread import run_in_fresh_thread

PROBE_TIMEOUT_S = 300


def sweep_settings(size: int) -> dict[str, Any]:
    """The inference settings of the sweep's engine at ``max_num_seqs = size``, by their flat
    names (``AISERVE_INFERENCE_<NAME>``): bf16, a KV cache of ``size`` slots of 256 tokens (sized
    from the sequences, the default), no prefix store, a queue that takes every request at once,
    and the service's defaults for everything else."""
    return {"dtype": "bfloat16", "max_num_seqs": size, "max_num_batched_tokens": max(512, size),
            "max_queue": 4096, "max_seq_len": 256, "prefix_cache_fraction": 0.0}


def sweep_engine(folder: Path, size: int) -> BatchEngine:
    """The sweep's engine at ``size``, built from its settings by the function the service uses,
    on a thread that exits (the model is loaded and the cache zero-filled there, as in the service)."""
    config = config_with(InferenceConfig, **sweep_settings(size))
    return run_in_fresh_thread(lambda: build_engine(config, folder))


async def sweep_one(folder: Path, size: int, prompt_ids: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
    engine = sweep_engine(folder, size)
    engine.start()
    n = max(8, 2 * size) if size <= 64 else size
    try:
        # As a served engine (SERVING only once warmed): its kernels built before the clock starts.
        await engine.probe(PROBE_TIMEOUT_S)

        async def one(i: int) -> Timing:
            req = GenerateRequest(request_id=f"s{i}", prompt_token_ids=tuple(prompt_ids[i % len(prompt_ids)]),
                                  max_new_tokens=new_tokens, ignore_eos=True)
            return await consume(engine.generate(req), time.perf_counter(), lambda e: len(e.token_ids))

        t0 = time.perf_counter()
        timings = await asyncio.gather(*(one(i) for i in range(n)))
        seconds = time.perf_counter() - t0
    finally:
        await engine.stop()
    tokens = sum(t.tokens for t in timings)
    return {"max_num_seqs": size, "requests": n, "tokens_per_s": tokens / seconds,
            "latency": percentiles([t.total_ms for t in timings]),
            "inter_token": percentiles([g for t in timings for g in t.gaps_ms]), "time_per_token": tpot(timings)}


def knee(points: Sequence[dict[str, Any]]) -> int:
    """The first size past which throughput grows < 10% while p50 time per output token grows
    > 50% (per token, not per message: with speculative decoding a message may carry several)."""
    for a, b in zip(points, points[1:], strict=False):
        gain = b["tokens_per_s"] / a["tokens_per_s"] - 1
        slower = b["time_per_token"]["p50_ms"] / max(a["time_per_token"]["p50_ms"], 1e-9) - 1
        if gain < 0.10 and slower > 0.50:
            return int(a["max_num_seqs"])
    return int(points[-1]["max_num_seqs"])
