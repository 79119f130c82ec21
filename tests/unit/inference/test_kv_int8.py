"""int8 KV storage: the round trip's error bound, the sizing that counts the scales, the copies
that carry them, the model's next-token distribution on an int8 cache, and the engine's refusal
of long requests past its fill threshold."""

import asyncio
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from aiserve.common.errors import ResourceExhausted
from services.inference.batch_engine import BatchEngine
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.kv_cache import KVCache, KVLayout, KVPlan, dequantize_int8, quantize_int8
from services.inference.llama import LlamaModel
from services.inference.prefix_index import BlockCopy
from services.inference.request import GenerateRequest
from services.inference.runner import BatchRow, build_batch
from services.inference.slot_table import SlotMove


def test_round_trip_error_within_half_a_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 17, 64) * torch.rand(3, 4, 17, 1) * 10  # rows of very different ranges
    x[0, 0, 0] = 0  # an all-zero row must not divide by zero
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    back = dequantize_int8(q, scale, torch.float32)
    # rounding to nearest: at most half a quantization step per element (plus float slack)
    assert bool(((back - x).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all())
    assert bool((back[0, 0, 0] == 0).all())


def test_int8_bytes_count_values_and_scales() -> None:
    bf16 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    int8 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.int8)
    assert bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert int8.bytes_per_token == 2 * 30 * 3 * (64 + 4)


def test_same_budget_holds_more_int8_sequences() -> None:
    config = KVCacheConfig(kv_cache_bytes=1 << 30, max_seq_len=512, prefix_cache_fraction=0.0)
    bf16 = KVPlan.fit(config, KVLayout(30, 3, 64, torch.bfloat16), max_num_seqs=1000, context_len=8192)
    int8 = KVPlan.fit(config, KVLayout(30, 3, 64, torch.int8), max_num_seqs=1000, context_len=8192)
    # 128 bytes per head-token in bf16 against 64 + 4 in int8: ~1.88x the slots, not 2x
    assert int8.num_slots == (1 << 30) // (512 * 2 * 30 * 3 * 68)
    assert 1.8 < int8.num_slots / bf16.num_slots < 1.95


# --- the engine on an int8 cache (the real model) ------------------------------------------------

LAYOUT8 = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.int8)


def test_moves_and_prefix_copies_carry_the_scales() -> None:
    cache = KVCache(LAYOUT8, KVPlan(num_slots=3, slot_len=8, num_blocks=2, block_size=4), torch.device("cpu"))
    assert cache.k_scale is not None and cache.v_scale is not None
    cache.k[:, 2].random_(-127, 127)
    cache.k_scale[:, 2].uniform_(0.1, 1.0)
    cache.v_scale[:, 2].uniform_(0.1, 1.0)
    cache.move((SlotMove(src=2, dst=0, num_tokens=5),))
    assert torch.equal(cache.k_scale[:, 0, :, :5], cache.k_scale[:, 2, :, :5])
    assert torch.equal(cache.v_scale[:, 0, :, :5], cache.v_scale[:, 2, :, :5])
    cache.save_prefix((BlockCopy(slot=0, blocks=((0, 1),)),))
    cache.load_prefix((BlockCopy(slot=1, blocks=((0, 1),)),))
    assert torch.equal(cache.k_scale[:, 1, :, :4], cache.k_scale[:, 2, :, :4])
    assert torch.equal(cache.k[:, 1, :, :4], cache.k[:, 2, :, :4])
    assert cache.total_bytes == (3 * 8 + 2 * 4) * LAYOUT8.bytes_per_token


@pytest.fixture(scope="module")
def model(model_dir: Path, two_torch_threads: None) -> LlamaModel:
    return LlamaModel.load(model_dir, "cpu", torch.float32)


def step_logits(model: LlamaModel, kv_dtype: torch.dtype, prompt: list[int], steps: int) -> torch.Tensor:
    """Greedy decode with a cache of ``kv_dtype`` (the reference's tokens fed to both, so the two
    runs see the same contexts); the last-position logits of every step [steps, V]."""
    c = model.config
    cache = KVCache(KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype),
                    KVPlan(num_slots=1, slot_len=256, num_blocks=0, block_size=16), model.device)
    out, ids, start = [], list(prompt), 0
    with torch.inference_mode():
        for _ in range(steps):
            rows = [BatchRow(0, start, ids[start:], True)]
            logits = model.forward(build_batch(rows, c, 256, model.device), cache.k, cache.v,
                                   cache.k_scale, cache.v_scale)[-1].float()
            out.append(logits)
            start = len(ids)
            ids.append(int(logits.argmax()))
    return torch.stack(out)


def test_int8_storage_keeps_the_next_token_distribution(model: LlamaModel, model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nExplain why the sky is blue.<|im_end|>\n<|im_start|>assistant\n").ids
    exact = step_logits(model, torch.float32, prompt, 24)
    int8 = step_logits(model, torch.int8, prompt, 24)
    kl = torch.nn.functional.kl_div(int8.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)  # KL(exact || int8) per step
    assert float(kl.max()) < 0.02, kl
    assert bool((exact.argmax(-1) == int8.argmax(-1)).all())  # every greedy pick unchanged on this prompt
    assert not torch.equal(exact, int8)  # it is a different cache, not the float one


async def test_an_int8_engine_serves_and_reports_its_bytes(model: LlamaModel) -> None:
    kv = KVCacheConfig(kv_cache_bytes=32 << 20, max_seq_len=128, kv_dtype="int8", prefix_cache_fraction=0.0)
    engine = BatchEngine(model, frozenset({2}), EngineConfig(64, SchedulerConfig(max_num_seqs=64), kv))
    float_slots = KVPlan.fit(kv, KVLayout(30, 3, 64, torch.float32), 64, 8192).num_slots
    assert engine.cache.k.dtype == torch.int8 and engine.scheduler.capacity > 3 * float_slots
    engine.start()
    try:
        ids = []
        async with asyncio.timeout(60):
            async for event in engine.generate(GenerateRequest(request_id="i", prompt_token_ids=(1, 2, 3),
                                                               max_new_tokens=5, ignore_eos=True)):
                ids.extend(event.token_ids)
        assert len(ids) == 5
    finally:
        await engine.stop()


async def test_past_the_threshold_long_requests_are_refused_and_short_ones_queue(model: LlamaModel) -> None:
    kv = KVCacheConfig(kv_cache_bytes=9 << 20, max_seq_len=96, prefix_cache_fraction=0.0, refuse_long_above=0.5,
                       long_context_tokens=40)
    engine = BatchEngine(model, frozenset({2}), EngineConfig(64, SchedulerConfig(max_num_seqs=2), kv))
    assert engine.scheduler.capacity == 2
    engine.start()
    first = engine.generate(GenerateRequest(request_id="a", prompt_token_ids=(5, 6), max_new_tokens=60,
                                            ignore_eos=True))
    try:
        async with asyncio.timeout(60):
            await anext(first)  # it holds one of the two slots: 50% in use
            long = GenerateRequest(request_id="l", prompt_token_ids=(5,) * 30, max_new_tokens=20)
            with pytest.raises(ResourceExhausted, match=r"kv cache: 50% in use, over the 50% threshold.*50\)"):
                engine.submit(long, lambda event: None)
            short = [e async for e in engine.generate(GenerateRequest(request_id="s", prompt_token_ids=(5, 6),
                                                                       max_new_tokens=3, ignore_eos=True))]
            assert short[-1].finish_reason == "length"
    finally:
        await first.aclose()
        await engine.stop()
