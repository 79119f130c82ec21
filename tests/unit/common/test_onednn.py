"""The CPU kernel helpers: row buckets and packed bf16 and float32 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiserve.common.onednn import (
    PREPARE_MAX_ROWS,
    bucket_rows,
    build_kernels,
    kernel_buckets,
    pack_checked,
    pack_weight,
    packed_linear,
    packing_is_close,
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


def test_bf16_weights_pack_bit_for_bit() -> None:
    assert pack_weight(torch.ones(8, 8, dtype=torch.float16)) is None  # bf16 and float32 only
    w = torch.randn(8, 16).to(torch.bfloat16)
    if (packed := pack_weight(w)) is None:
        pytest.skip("no oneDNN packing in this torch build")
    assert packing_is_exact(w, None, packed)
    x = torch.randn(37, 16).to(torch.bfloat16)  # 37 rows run as a bucket of 40
    assert torch.equal(packed_linear(x, packed, None), F.linear(x, w))
    assert build_kernels([(packed, None)], 64) == len(kernel_buckets(64))


def test_float32_weights_pack_within_float32_rounding() -> None:
    """F.linear runs MKL's sgemm in float32, the packed weight oneDNN's: another summation
    order, so the check is closeness; a wrong layout (another weight's packing) fails it."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 320, generator=g), torch.randn(96, generator=g)
    if (packed := pack_checked(w, b)) is None:
        pytest.skip("no oneDNN packing in this torch build")
    assert packed.dtype == torch.float32 and packing_is_close(w, b, packed)
    x = torch.randn(37, 320, generator=g)
    got, expected = packed_linear(x, packed, b), F.linear(x, w, b)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert not packing_is_close(w, b, pack_weight(torch.randn(96, 320, generator=g)))
    assert not packing_is_close(w, b, pack_weight(w.t().contiguous().view(96, 320)))  # the transposed layout
    assert build_kernels([(packed, b)], 40) == len(kernel_buckets(40))
