"""The CPU kernel helpers: row buckets and packed bf16 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiserve.common.onednn import (
    PREPARE_MAX_ROWS,
    bucket_rows,
    build_kernels,
    kernel_buckets,
    pack_weight,
    packed_linear,
    packing_is_exact,
)


def test_bucketed_row_counts_are_few_and_waste_at_most_a_quarter() -> None:
    buckets = [bucket_rows(rows) for rows in range(1, 20_001)]
    assert buckets[:32] == list(range(1, 33))  # decode batches up to 32 run exactly
    for rows, bucket in enumerate(buckets, start=1):
        assert rows <= bucket <= rows * 1.25 and bucket_rows(bucket) == bucket
    assert buckets[:64] == sorted(buckets[:64])
    assert len(set(buckets[:512])) == 48  # kernels per weight shape for the default step budget
    assert len(set(buckets[:16_384])) == 68


def test_kernel_buckets_are_every_bucket_once_up_to_the_cap() -> None:
    assert kernel_buckets(512) == sorted({bucket_rows(rows) for rows in range(1, 513)})
    assert kernel_buckets(1) == [1]
    assert kernel_buckets(10**6)[-1] == PREPARE_MAX_ROWS  # larger steps build theirs when they run


def test_only_bf16_cpu_weights_are_packed() -> None:
    assert pack_weight(torch.ones(8, 8)) is None  # float32: F.linear is already fast
    w = torch.randn(8, 16).to(torch.bfloat16)
    if (packed := pack_weight(w)) is None:
        pytest.skip("no exact oneDNN bf16 packing on this CPU or torch build")
    assert packing_is_exact(w, None, packed)
    x = torch.randn(37, 16).to(torch.bfloat16)  # 37 rows run as a bucket of 40
    assert torch.equal(packed_linear(x, packed, None), F.linear(x, w))
    assert build_kernels([(w, packed, None)], 64) == len(kernel_buckets(64))
