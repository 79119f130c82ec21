"""KV cache sizing, accounting and the copies the scheduler asks for."""

from __future__ import annotations

import pytest
import torch

from services.inference.engine_config import KVCacheConfig
from services.inference.kv_cache import KVCache, KVLayout, KVPlan
from services.inference.prefix_index import BlockCopy
from services.inference.slot_table import SlotMove

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32)
CPU = torch.device("cpu")


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    assert LAYOUT.bytes_per_token == 2 * 2 * 3 * 4 * 4
    smollm = KVLayout(30, 3, 64, torch.bfloat16)
    assert smollm.bytes_per_token == 23_040


def test_plan_fits_the_byte_budget() -> None:
    per_token = LAYOUT.bytes_per_token  # 192
    config = KVCacheConfig(kv_cache_bytes=1 << 20, max_seq_len=64, prefix_cache_fraction=0.25,
                           prefix_block_size=8)
    plan = KVPlan.fit(config, LAYOUT, max_num_seqs=1000, context_len=8192)
    slot_bytes = 64 * per_token
    assert plan.num_slots == int((1 << 20) * 0.75) // slot_bytes
    assert plan.num_blocks == ((1 << 20) - plan.num_slots * slot_bytes) // (8 * per_token)
    cache = KVCache(LAYOUT, plan, CPU)
    assert cache.total_bytes <= 1 << 20
    real = sum(t.numel() * t.element_size() for t in (cache.k, cache.v, cache.pk, cache.pv))
    assert real == cache.total_bytes


def test_plan_caps_slots_and_length() -> None:
    config = KVCacheConfig(kv_cache_bytes=1 << 24, max_seq_len=4096, prefix_cache_fraction=0.0)
    plan = KVPlan.fit(config, LAYOUT, max_num_seqs=3, context_len=128)
    assert (plan.num_slots, plan.slot_len, plan.num_blocks) == (3, 128, 0)


def test_plan_refuses_a_budget_without_one_slot() -> None:
    config = KVCacheConfig(kv_cache_bytes=1 << 20, max_seq_len=1 << 16)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        KVPlan.fit(config, LAYOUT, max_num_seqs=8, context_len=1 << 16)


def test_used_and_free_bytes() -> None:
    plan = KVPlan(num_slots=4, slot_len=16, num_blocks=10, block_size=4)
    cache = KVCache(LAYOUT, plan, CPU)
    assert cache.used_bytes(0, 0) == 0
    assert cache.used_bytes(2, 3) == 2 * 16 * 192 + 3 * 4 * 192
    assert cache.total_bytes - cache.used_bytes(4, 10) == 0


def test_move_copies_only_the_moved_sequences_tokens() -> None:
    plan = KVPlan(num_slots=3, slot_len=8, num_blocks=0, block_size=4)
    cache = KVCache(LAYOUT, plan, CPU)
    cache.k[:, 2].normal_()
    cache.v[:, 2].normal_()
    pointer = cache.k.data_ptr()
    cache.move((SlotMove(src=2, dst=0, num_tokens=5),))
    assert torch.equal(cache.k[:, 0, :, :5], cache.k[:, 2, :, :5])
    assert torch.equal(cache.v[:, 0, :, :5], cache.v[:, 2, :, :5])
    assert not cache.k[:, 0, :, 5:].any()
    assert cache.k.data_ptr() == pointer  # in place: the cache is never reallocated


def test_prefix_blocks_round_trip_through_the_store() -> None:
    plan = KVPlan(num_slots=2, slot_len=12, num_blocks=4, block_size=4)
    cache = KVCache(LAYOUT, plan, CPU)
    cache.k[:, 0].normal_()
    cache.v[:, 0].normal_()
    cache.save_prefix((BlockCopy(slot=0, blocks=((0, 3), (1, 1))),))
    cache.load_prefix((BlockCopy(slot=1, blocks=((0, 3), (1, 1))),))
    assert torch.equal(cache.k[:, 1, :, :8], cache.k[:, 0, :, :8])
    assert torch.equal(cache.v[:, 1, :, :8], cache.v[:, 0, :, :8])
    assert not cache.k[:, 1, :, 8:].any()
