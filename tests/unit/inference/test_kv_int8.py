"""int8 KV storage: the round trip's error bound and the sizing that counts the scales."""

import torch

from services.inference.engine_config import KVCacheConfig
from services.inference.kv_cache import KVLayout, KVPlan, dequantize_int8, quantize_int8


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
