"""Sizing arithmetic: checked by hand against SmolLM2-135M's config."""

from __future__ import annotations

import pytest

from aiserve.sizing import Shape, estimate

SMOL = Shape(parameters=134_515_008, layers=30, kv_heads=3, head_dim=64, hidden=576,
             intermediate=1536, vocab=49152)


def test_kv_per_token_is_two_by_layers_heads_dim_bytes() -> None:
    assert estimate(SMOL, "bf16", 2048, 64).kv_per_token == 2 * 30 * 3 * 64 * 2
    assert estimate(SMOL, "bf16", 2048, 64, kv_dtype="int8").kv_per_token == 2 * 30 * 3 * 64


def test_weights_recommended_ram_and_kv_total() -> None:
    e = estimate(SMOL, "bf16", 2048, 64)
    assert e.weights == 2 * SMOL.parameters
    assert e.recommended_ram == 2 * e.weights
    assert e.kv_total == e.kv_per_token * 2048 * 64
    assert estimate(SMOL, "int4", 8, 1).weights == SMOL.parameters // 2


def test_max_batch_fits_memory() -> None:
    memory = 4 * 2**30
    e = estimate(SMOL, "bf16", 2048, 1, memory=memory)
    assert e.max_batch is not None
    per_seq = e.kv_per_token * 2048 + e.activations
    assert e.weights + e.max_batch * per_seq <= memory < e.weights + (e.max_batch + 1) * per_seq


def test_bad_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        estimate(SMOL, "fp7", 8, 1)
