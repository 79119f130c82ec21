"""Our decode-attention kernel: the same answers as torch's SDPA with the mask the forward gives it,
for every storage dtype the KV cache has, with drafts, and through the whole forward; and when
the service picks it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aiserve.common.config import ConfigError
from services.inference import decode_attention
from services.inference.kv_cache import dequantize_int8, quantize_int8
from services.inference.llama import LlamaModel
from services.inference.runner import BatchRow, build_batch

CPU = torch.device("cpu")
FLAGS = frozenset({"avx2", "fma", "avx512f"})


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    """`make` builds it; this machine (either CPU kind) has what it needs, so it must load."""
    assert decode_attention.load(), f"{decode_attention.library_path()} is not built"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """SDPA in float64 with query i of slot b seeing keys [0, lens[b, i])."""
    visible = torch.arange(k.shape[2]) < lens[:, None, :, None]  # [B, 1, Q, T]
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible)


def problem(slots: int, heads: int, queries: int, dim: int, length: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, H, Q, D]; k, v views [B, H, length, D] of a longer cache (strided, as the forward
    passes them); lens [B, Q] int32 in 1..length, the longest reaching ``length``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(slots, heads, queries, dim, generator=g).to(dtype)
    cache = torch.randn(2, slots, heads, length + 17, dim, generator=g).to(dtype)
    lens = torch.randint(1, length + 1, (slots, queries), generator=g, dtype=torch.int32)
    lens[0, 0] = length
    return q, cache[0, :, :, :length], cache[1, :, :, :length], lens


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "queries", "dim"), [(3, 3, 64), (2, 12, 64), (4, 2, 128), (1, 5, 40)])
def test_matches_sdpa_with_the_mask(dtype: torch.dtype, tolerance: float, heads: int, queries: int, dim: int) -> None:
    q, k, v, lens = problem(9, heads, queries, dim, 50, dtype, seed=queries)
    out = torch.ops.aiserve.decode_attention(q, k, v, lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, lens), atol=tolerance, rtol=tolerance)


def test_a_query_reads_only_its_own_keys() -> None:
    """Keys past a query's length may hold anything (another sequence's leftovers): no effect."""
    q, k, v, lens = problem(4, 3, 3, 64, 30, torch.float32, seed=1)
    before = torch.ops.aiserve.decode_attention(q, k, v, lens, 0.125)
    beyond = torch.arange(30) >= lens.min()
    k[:, :, beyond], v[:, :, beyond] = 1e4, -1e4
    after = torch.ops.aiserve.decode_attention(q, k, v, lens, 0.125)
    shortest = lens == lens.min()  # [B, Q]
    assert torch.equal(before.permute(0, 2, 1, 3)[shortest], after.permute(0, 2, 1, 3)[shortest])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_cache_is_read_with_its_scales(dtype: torch.dtype) -> None:
    q, k, v, lens = problem(6, 3, 3, 64, 40, torch.float32, seed=2)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    out = torch.ops.aiserve.decode_attention(q.to(dtype), kq, vq, lens, 0.125, ks, vs)
    # SDPA's default scale is D**-0.5 = 0.125 here too
    expected = reference(q.to(dtype), dequantize_int8(kq, ks, torch.float32), dequantize_int8(vq, vs, torch.float32),
                         lens)
    torch.testing.assert_close(out.double(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_bad_input_is_refused_with_the_limit() -> None:
    q, k, v, lens = problem(2, 3, 3, 64, 10, torch.float32, seed=3)
    with pytest.raises(RuntimeError, match=r"lens must be 1\.\.10"):
        torch.ops.aiserve.decode_attention(q, k, v, lens + 10, 0.125)
    with pytest.raises(RuntimeError, match="lens must be 1"):
        torch.ops.aiserve.decode_attention(q, k, v, lens * 0, 0.125)
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        torch.ops.aiserve.decode_attention(q, quantize_int8(k)[0], quantize_int8(v)[0], lens, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.aiserve.decode_attention(q.half(), k.half(), v.half(), lens, 0.125)


@pytest.mark.parametrize("drafts", [0, 2])
def test_the_forward_gives_the_same_logits_with_the_kernel(model_dir: Path, drafts: int) -> None:
    """The real model, float32: decode rows of different lengths (with drafts: several queries
    per slot) beside a prefill chunk, once through SDPA and once through the kernel."""
    models = [LlamaModel.load(model_dir, CPU, torch.float32, decode_kernel=kernel) for kernel in (False, True)]
    assert [m.decode_kernel for m in models] == [False, True]
    config = models[0].config
    shape = (config.num_layers, 4, config.num_kv_heads, 64, config.head_dim)
    g = torch.Generator().manual_seed(4)
    k0, v0 = torch.randn(shape, generator=g) * 0.5, torch.randn(shape, generator=g) * 0.5
    rows = [BatchRow(0, 20, [5, *range(40, 40 + drafts)], True, drafts), BatchRow(1, 7, [9], True),
            BatchRow(2, 33, [11, *range(50, 50 + drafts)], True, drafts), BatchRow(3, 0, list(range(100, 112)), True)]
    batch = build_batch(rows, config, 64, CPU)
    logits = []
    for m in models:
        k, v = k0.clone(), v0.clone()
        with torch.inference_mode():
            logits.append(m.forward(batch, k, v))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)


def test_the_setting_and_the_machine_choose_it() -> None:
    assert decode_attention.choose("auto", CPU, FLAGS) == (True, "kernel: built for avx2+fma, CPU has them")
    assert decode_attention.choose("kernel", CPU, FLAGS)[0]
    assert decode_attention.choose("sdpa", CPU, FLAGS) == (False, "sdpa: decode_attention=sdpa set")
    assert decode_attention.choose("auto", torch.device("cuda"), FLAGS) == (False, "sdpa: the model runs on cuda")
    assert decode_attention.choose("auto", CPU, frozenset({"sse4_2"})) == (False, "sdpa: this CPU lacks avx2 and fma")
    with pytest.raises(ConfigError, match="^decode_attention: kernel asked for, but this CPU lacks fma"):
        decode_attention.choose("kernel", CPU, frozenset({"avx2"}))


def test_an_unbuilt_kernel_leaves_sdpa_and_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_attention, "load", lambda: False)
    use, why = decode_attention.choose("auto", CPU, FLAGS)
    assert not use and why.startswith("sdpa: the kernel is not built") and "services.inference.decode_attention" in why
    with pytest.raises(ConfigError, match="kernel is not built"):
        decode_attention.choose("kernel", CPU, FLAGS)


def test_the_library_name_follows_the_source_and_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A changed source or torch gets a new file name: a stale build is never loaded."""
    built = decode_attention.library_path()
    assert built.exists() and built.parent.is_relative_to(Path(decode_attention.sys.prefix))
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert decode_attention.library_path() != built
    monkeypatch.undo()
    source = tmp_path / "decode_attention.cpp"
    source.write_text(decode_attention.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(decode_attention, "SOURCE", source)
    assert decode_attention.library_path() != built
