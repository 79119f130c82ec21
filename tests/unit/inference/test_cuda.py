"""The engine on a CUDA device (skipped without one; scripts/device_check.sh runs it on a lent GPU).

A random 2-layer Llama (no model store needed, so the check travels to a device machine with
the working tree): concurrent greedy requests through the BatchEngine on CUDA, float32, each
give exactly transformers' greedy tokens for its prompt; the health probe runs on CUDA beside a
full batch without changing it, and the device's free memory is read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from services.inference.batch_engine import BatchEngine
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.health import free_memory_bytes
from services.inference.health_probe import device_free_bytes
from services.inference.llama import LlamaModel
from services.inference.request import GenerateRequest
from tests.unit.inference.test_llama import CUDA_ONLY, tiny

NEW = 12


@CUDA_ONLY
async def test_concurrent_greedy_requests_on_cuda_match_transformers(tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.device("cuda")
    folder = tiny("llama3", tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (3 + 4 * i,), generator=g).tolist() for i in range(6)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(cuda).eval()
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([p], device=cuda), do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    model = LlamaModel.load(folder, cuda, torch.float32)
    engine = BatchEngine(model, frozenset(), EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        kv_cache=KVCacheConfig(kv_cache_bytes=8 << 20, max_seq_len=64, prefix_cache_fraction=0.0)))
    engine.start()
    try:
        async def one(i: int) -> list[int]:
            request = GenerateRequest(request_id=f"c{i}", prompt_token_ids=tuple(prompts[i]), max_new_tokens=NEW,
                                      ignore_eos=True)
            return [t async for event in engine.generate(request) for t in event.token_ids]

        got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), timeout=120)
    finally:
        await engine.stop()
    assert got == expected  # 6 requests over 4 slots: joins, leaves and chunked prefill (16 tokens a step)


@CUDA_ONLY
async def test_the_health_probe_runs_on_cuda_beside_a_full_batch(tmp_path: Path) -> None:
    cuda = torch.device("cuda")
    model = LlamaModel.load(tiny("llama3", tmp_path), cuda, torch.float32)
    engine = BatchEngine(model, frozenset(), EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        kv_cache=KVCacheConfig(kv_cache_bytes=8 << 20, max_seq_len=64, prefix_cache_fraction=0.0)))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (3 + 2 * i,), generator=g).tolist() for i in range(4)]
    engine.start()
    try:
        async def one(i: int) -> list[int]:
            request = GenerateRequest(request_id=f"p{i}", prompt_token_ids=tuple(prompts[i]), max_new_tokens=40,
                                      ignore_eos=True)
            return [t async for event in engine.generate(request) for t in event.token_ids]

        async def probes() -> list[float]:
            return [await engine.probe(30.0) for _ in range(5)]

        alone = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), timeout=120)
        together, seconds = await asyncio.wait_for(
            asyncio.gather(asyncio.gather(*(one(i) for i in range(4))), probes()), timeout=120)
    finally:
        await engine.stop()
    assert together == alone and all(s > 0 for s in seconds)
    assert engine.stats().num_preemptions == 0 and engine.stats().num_requests == 8
    free = device_free_bytes(cuda)
    assert free is not None and 0 < free <= torch.cuda.mem_get_info(cuda)[1]
    assert device_free_bytes(torch.device("cpu")) is None
    both = free_memory_bytes(lambda: device_free_bytes(cuda))
    assert both is not None and 0 < both
