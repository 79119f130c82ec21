"""Sizing arithmetic: checked by hand against SmolLM2-135M's config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from aiserve.common.cpu import read_cpu_flags
from aiserve.sizing import (
    LOAD_OVERHEAD,
    PACKED_KERNEL_BYTES,
    RUNTIME_BYTES,
    Shape,
    estimate,
    keeps_float32_copies,
    packs_weights,
    shape_of,
)
from services.inference.precision import AUTO, choose_precision
from suite.cli import cmd_size

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


def test_shape_of_reads_config_and_safetensors_header(tmp_path: Path) -> None:
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
              "num_hidden_layers": 3, "intermediate_size": 64, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"a": torch.zeros(100, 32), "b": torch.zeros(3, 5, 7)}, str(tmp_path / "model.safetensors"))
    shape = shape_of(tmp_path)
    assert shape == Shape(parameters=100 * 32 + 3 * 5 * 7, layers=3, kv_heads=2, head_dim=8,
                          hidden=32, intermediate=64, vocab=100)


def test_size_command_prints_the_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    test_shape_of_reads_config_and_safetensors_header(folder)
    assert cmd_size(argparse.Namespace(target="m@1", store=str(tmp_path), dtype="bf16", kv_dtype="int8",
                                       context=16, batch=2, memory=10**6, packed=None, float32_copies=None)) == 0
    out = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert out["kv_per_token"] == str(2 * 3 * 2 * 8)
    assert int(out["max_batch"]) >= 1


def test_size_command_counts_float32_copies_as_the_service_keeps_them(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 32,
                                                    "num_hidden_layers": 3, "intermediate_size": 64,
                                                    "vocab_size": 100}))
    save_file({"w": torch.zeros(512, 1024, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    resident = {}
    for copies in (None, False, True):
        assert cmd_size(argparse.Namespace(target="m@1", store=str(tmp_path), dtype="bf16", kv_dtype=None,
                                           context=16, batch=2, memory=None, packed=False,
                                           float32_copies=copies)) == 0
        out = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
        resident[copies] = float(out["resident"].removesuffix(" MiB"))
    assert resident[True] - resident[False] == 2.0  # 4 bytes for each of 512 x 1024 parameters
    assert resident[None] == resident[keeps_float32_copies("bf16", read_cpu_flags())]  # default: as on this CPU


def test_resident_adds_runtime_loading_kv_cache_and_activations() -> None:
    e = estimate(SMOL, "f32", 512, 4)
    # slots are 95% of the cache; the prefix store is whole blocks of 16 tokens
    prefix_tokens = int(e.kv_total * 0.05 / 0.95) // e.kv_per_token // 16 * 16
    assert prefix_tokens == 96  # 107.8 tokens' worth, 6 whole blocks
    assert e.kv_cache == e.kv_total + prefix_tokens * e.kv_per_token
    assert e.runtime == RUNTIME_BYTES
    assert e.resident == RUNTIME_BYTES + int(e.weights * (1 + LOAD_OVERHEAD)) + e.kv_cache + e.activations
    assert estimate(SMOL, "f32", 512, 4, prefix_fraction=0.0).kv_cache == e.kv_total
    with pytest.raises(ValueError, match="prefix_fraction"):
        estimate(SMOL, "f32", 512, 4, prefix_fraction=1.0)


def test_a_folder_without_safetensors_is_refused_not_sized_as_zero(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 32}))
    (tmp_path / "model.quantized.pt").write_bytes(b"")  # a quantized version holds only this
    with pytest.raises(ValueError, match="no safetensors weights \\(a quantized version\\?\\)"):
        shape_of(tmp_path)


def test_packed_serving_adds_the_packed_copy_and_its_kernels() -> None:
    plain, packed = estimate(SMOL, "bf16", 512, 4), estimate(SMOL, "bf16", 512, 4, packed=True)
    assert packed.resident - plain.resident == plain.weights + PACKED_KERNEL_BYTES
    assert packs_weights("bf16", frozenset({"avx2", "avx512_bf16"}))
    assert packs_weights("bfloat16", frozenset({"amx_bf16"}))
    assert packs_weights("bf16", frozenset({"avx2", "avx512f"}))  # no bf16 instructions: its float32 copies
    assert not packs_weights("f16", frozenset({"avx2", "avx512_bf16"}))  # float16 products: not packed
    assert packs_weights("f32", frozenset({"avx2"})) and packs_weights("float32", frozenset())  # oneDNN's float32
    assert not packs_weights("bf16", frozenset({"avx512_bf16"}), device="cuda")
    assert not packs_weights("f32", frozenset({"avx2"}), device="cuda")


CPUS = {"amx": frozenset({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"}),
        "avx512_bf16": frozenset({"avx512_bf16", "avx512f", "avx2"}), "avx512": frozenset({"avx512f", "avx2"}),
        "avx2": frozenset({"avx2"}), "other": frozenset()}


@pytest.mark.parametrize("cpu", sorted(CPUS))
@pytest.mark.parametrize(("dtype", "short"), [("bfloat16", "bf16"), ("float16", "f16"), ("float32", "f32")])
def test_the_float32_copies_are_counted_where_the_service_makes_them(cpu: str, dtype: str, short: str) -> None:
    """The sizing's reading of the policy is the service's: float32 copies exactly where "auto"
    multiplies a 16-bit model in float32."""
    chosen = choose_precision("cpu", CPUS[cpu], dtype, AUTO)
    expected = chosen.weights != chosen.matmul == "float32"
    assert keeps_float32_copies(dtype, CPUS[cpu]) is expected
    assert keeps_float32_copies(short, CPUS[cpu]) is expected
    assert not keeps_float32_copies(dtype, CPUS[cpu], device="cuda")
    if expected:  # the copies are packed, and counted once
        assert packs_weights(dtype, CPUS[cpu])


def test_float32_copies_add_four_bytes_a_parameter_once_whether_packed_or_not() -> None:
    plain = estimate(SMOL, "bf16", 512, 4)
    wide = estimate(SMOL, "bf16", 512, 4, wide=True)
    wide_packed = estimate(SMOL, "bf16", 512, 4, wide=True, packed=True)
    assert wide.resident - plain.resident == 4 * SMOL.parameters == 2 * plain.weights
    assert wide_packed.resident - wide.resident == PACKED_KERNEL_BYTES  # the packed copy is the float32 copy
    assert wide.weights == plain.weights and wide.kv_cache == plain.kv_cache  # only what the process holds
