"""Our CPU ops: the decode attention gives torch's SDPA's answers with the mask the forward gives
it, for every storage dtype the KV cache has, with drafts; the fused RMSNorm and rotary embedding
give torch's bits; the whole forward gives the same logits with them; and when the service
picks them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aiserve.common.config import ConfigError
from services.inference import native_ops
from services.inference.kv_cache import dequantize_int8, quantize_int8
from services.inference.llama import LlamaModel, _rotate, rms_norm
from services.inference.runner import BatchRow, build_batch

CPU = torch.device("cpu")
FLAGS = frozenset({"avx2", "fma", "avx512f"})


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    """`make` builds it; this machine (either CPU kind) has what it needs, so it must load."""
    assert native_ops.load(), f"{native_ops.library_path()} is not built"


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
@pytest.mark.parametrize(("heads", "queries", "dim"), [(3, 3, 64), (2, 12, 64), (4, 2, 128), (1, 5, 40), (2, 4, 20)])
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


SLOT_LENGTHS = {
    "equal": [60] * 9,
    "the long ones first": [60] * 4 + [3] * 5,
    "one long, at the end": [2] * 8 + [60],
    "one slot": [60],
}


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("pattern", SLOT_LENGTHS)
def test_the_threads_split_the_work_by_keys_and_give_one_threads_bits(threads: int, pattern: str) -> None:
    """The (slot, head) tasks go to the threads by the keys they read (or, to measure against, by
    count): every task is computed whole by one thread, so the bits are those of one thread
    whatever the split, the lengths and the thread count (more threads than tasks included);
    fetching the next task's keys ahead (or not, to measure against) changes no bit either."""
    longest = SLOT_LENGTHS[pattern]
    q, k, v, _ = problem(len(longest), 3, 3, 64, 60, torch.bfloat16, seed=threads)
    lens = torch.tensor([[max(1, n - 2 + i) if n > 2 else n for i in range(3)] for n in longest], dtype=torch.int32)
    lens[:, -1] = torch.tensor(longest, dtype=torch.int32)  # each slot's last query reads all its keys
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.aiserve.decode_attention(q, k, v, lens, 0.125)
        torch.set_num_threads(threads)
        by_keys = torch.ops.aiserve.decode_attention(q, k, v, lens, 0.125)
        by_count = torch.ops.aiserve.decode_attention(q, k, v, lens, 0.125, None, None, False)
        unfetched = torch.ops.aiserve.decode_attention(q, k, v, lens, 0.125, None, None, True, False)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(by_keys, alone) and torch.equal(by_count, alone) and torch.equal(unfetched, alone)
    torch.testing.assert_close(alone.double(), reference(q, k, v, lens), atol=2e-2, rtol=2e-2)


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
    with pytest.raises(RuntimeError, match="at least 1 query"):  # no query has a length to read up to
        torch.ops.aiserve.decode_attention(q[:, :, :0], k, v, lens[:, :0], 0.125)
    with pytest.raises(RuntimeError, match="at least 1 value per head"):  # no row of K or V to fetch ahead
        torch.ops.aiserve.decode_attention(q[..., :0], k[..., :0], v[..., :0], lens, 0.125)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_norm_and_rotation_give_torchs_bits(rows: int, dtype: torch.dtype) -> None:
    """bf16: bit for bit (the same roundings); float32: the RMS sum is added up in another order."""
    g = torch.Generator().manual_seed(rows)
    h, delta, weight = (torch.randn(shape, generator=g).to(dtype) for shape in ((rows, 576), (rows, 576), (576,)))
    fused_h = h.clone()
    normed = torch.ops.aiserve.rms_norm(fused_h, delta, weight, 1e-5)
    assert torch.equal(fused_h, h + delta)  # the residual add, in place
    expected = rms_norm(h + delta, weight, 1e-5)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, expected)
        assert torch.equal(torch.ops.aiserve.rms_norm(h.clone(), None, weight, 1e-5), rms_norm(h, weight, 1e-5))
    else:
        torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
    qkv = torch.randn(rows, 15 * 64, generator=g).to(dtype)  # q (9 heads) and k (3) as views of one product
    cos, sin = torch.randn(rows, 64, generator=g).to(dtype), torch.randn(rows, 64, generator=g).to(dtype)
    q = qkv[:, : 9 * 64].view(rows, 9, 64)
    expected = _rotate(q, cos[:, None], sin[:, None])
    untouched = qkv[:, 9 * 64 :].clone()
    torch.ops.aiserve.rotate_(q, cos, sin)
    assert torch.equal(q, expected) and torch.equal(qkv[:, 9 * 64 :], untouched)


def test_bad_shapes_for_the_fused_ops_are_refused() -> None:
    x = torch.randn(4, 576)
    with pytest.raises(RuntimeError, match=r"weight must be \[hidden\]"):
        torch.ops.aiserve.rms_norm(x, None, torch.randn(575), 1e-5)
    with pytest.raises(RuntimeError, match="delta must be shaped and typed as x"):
        torch.ops.aiserve.rms_norm(x, torch.randn(4, 576).bfloat16(), torch.randn(576), 1e-5)
    with pytest.raises(RuntimeError, match=r"cos, signed_sin must be \[N, D\]"):
        torch.ops.aiserve.rotate_(x.view(4, 9, 64), torch.randn(4, 32), torch.randn(4, 32))


def two_steps(model: LlamaModel, drafts: int) -> torch.Tensor:
    """Logits of two steps over a fresh cache: four prompts prefilled (SDPA spans either way),
    then their decode rows (with drafts: several queries per slot), of different lengths."""
    config = model.config
    shape = (config.num_layers, 4, config.num_kv_heads, 64, config.head_dim)
    k, v = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
    lengths = (20, 7, 33, 12)
    prefill = [BatchRow(slot, 0, [(7 * t + slot) % 5000 + 100 for t in range(n)], True)
               for slot, n in enumerate(lengths)]
    decode = [BatchRow(0, 20, [5, *range(40, 40 + drafts)], True, drafts), BatchRow(1, 7, [9], True),
              BatchRow(2, 33, [11, *range(50, 50 + drafts)], True, drafts), BatchRow(3, 12, [13], True)]
    with torch.inference_mode():
        steps = [model.forward(build_batch(rows, config, 64, CPU), k, v) for rows in (prefill, decode)]
    return torch.cat(steps).float()


@pytest.mark.parametrize("drafts", [0, 2])
def test_the_forward_gives_the_same_logits_with_our_ops_in_float32(model_dir: Path, drafts: int) -> None:
    """Within float32 rounding: the RMS sums and the attention add up in another order."""
    theirs, ours = (two_steps(LlamaModel.load(model_dir, CPU, torch.float32, native_ops=native), drafts)
                    for native in (False, True))
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)


def test_in_bf16_our_ops_are_at_least_as_close_to_float32(model_dir: Path) -> None:
    """In bf16 both paths round differently (torch's flash attention rounds its probabilities to
    bf16 before the product with V; ours keeps float32 to the end), so each is set against the
    float32 model: ours must be no further from it (measured: mean |error| 0.080 against 0.114)."""
    truth = two_steps(LlamaModel.load(model_dir, CPU, torch.float32), 2)
    theirs, ours = (two_steps(LlamaModel.load(model_dir, CPU, torch.bfloat16, native_ops=native), 2)
                    for native in (False, True))
    assert (ours - truth).abs().mean() <= (theirs - truth).abs().mean()
    agree = [(x.argmax(-1) == truth.argmax(-1)).sum() for x in (theirs, ours)]
    assert agree[1] >= agree[0]


def test_a_batch_carries_only_what_its_attention_reads(model_dir: Path) -> None:
    """Built for our op, a step has the per-query lengths and no bool mask (nor its copy to the
    device); built for SDPA, the reverse; a forward given the wrong one says what is missing."""
    rows = [BatchRow(0, 20, [5, 40, 41], True, 2), BatchRow(2, 7, [9], True)]
    config = LlamaModel.load(model_dir, CPU, torch.float32).config
    ours, sdpa, both = (build_batch(rows, config, 64, CPU, native_ops=native) for native in (True, False, None))
    assert ours.single_mask is None and ours.single_lens is not None
    assert sdpa.single_lens is None and sdpa.single_mask is not None
    assert both.single_mask is not None and both.single_lens is not None
    assert torch.equal(ours.single_lens, both.single_lens) and torch.equal(sdpa.single_mask, both.single_mask)
    shape = (config.num_layers, 3, config.num_kv_heads, 64, config.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    for native, batch, missing in ((True, sdpa, "single_lens"), (False, ours, "single_mask")):
        model = LlamaModel.load(model_dir, CPU, torch.float32, native_ops=native)
        with torch.inference_mode(), pytest.raises(ValueError, match=f"built without {missing}"):
            model.forward(batch, k, v)


def test_the_model_applies_the_same_check_as_the_choice(model_dir: Path) -> None:
    """Asked for our ops in a dtype they do not run, a model keeps torch's, for the reason
    ``choose`` gives."""
    assert native_ops.unsupported(CPU, "float16") == "they run bfloat16 and float32, not float16"
    assert native_ops.unsupported(CPU, "bfloat16") is None
    assert LlamaModel.load(model_dir, CPU, torch.bfloat16, native_ops=True).native_ops
    assert not LlamaModel.load(model_dir, CPU, torch.float16, native_ops=True).native_ops


def decode_step(model: LlamaModel, slots: int, in_cpp: bool, int8: bool = False) -> tuple[torch.Tensor, ...]:
    """Logits and caches (and an int8 cache's scales) after one decode-only step of ``slots`` rows
    (one token each, contexts of different lengths) over a random cache, the loop over layers in
    C++ or in Python."""
    config = model.config
    shape = (config.num_layers, slots, config.num_kv_heads, 64, config.head_dim)
    g = torch.Generator().manual_seed(slots)
    k, v = (torch.randn(shape, generator=g).to(model.dtype) for _ in range(2))
    scales: tuple[torch.Tensor, ...] = ()
    if int8:
        (k, k_scale), (v, v_scale) = quantize_int8(k), quantize_int8(v)
        scales = (k_scale, v_scale)
    rows = [BatchRow(slot, 3 + (7 * slot) % 50, [(11 * slot) % 5000 + 100], True) for slot in range(slots)]
    model.layers_in_cpp = in_cpp
    with torch.inference_mode(), torch.profiler.profile() as prof:
        logits = model.forward(build_batch(rows, config, 64, CPU, native_ops=True), k, v, *scales)
    assert any(e.name == "aiserve::decode_layers" for e in prof.events()) == in_cpp
    return logits, k, v, *scales


@pytest.mark.parametrize(("dtype", "matmul_dtype", "pack"), [
    (torch.bfloat16, None, True), (torch.float32, None, True), (torch.float32, None, False),
    (torch.bfloat16, torch.float32, True), (torch.bfloat16, torch.float32, False)])
@pytest.mark.parametrize("slots", [1, 5, 33])  # 1: products on the bf16 weights; 5 on the float32 copy; 33 padded
def test_the_layer_loop_in_cpp_gives_the_python_loops_bits(model_dir: Path, dtype: torch.dtype,
                                                           matmul_dtype: torch.dtype | None, pack: bool,
                                                           slots: int) -> None:
    """The same logits and the same K/V written, bit for bit, for each way a product runs (oneDNN
    on packed weights, bf16 or float32; F.linear on the float32 copy of a bf16 model, packed or
    not, or on a float32 model unpacked) and a row count that the packed products pad to their
    bucket (33 -> 40)."""
    model = LlamaModel.load(model_dir, CPU, dtype, matmul_dtype, pack_weights=pack, native_ops=True)
    assert model.layers_in_cpp
    python, cpp = (decode_step(model, slots, in_cpp) for in_cpp in (False, True))
    for theirs, ours in zip(python, cpp, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots", [1, 5, 33])
def test_the_layer_loop_in_cpp_writes_and_reads_an_int8_cache_as_the_python_loop(model_dir: Path,
                                                                                  dtype: torch.dtype,
                                                                                  slots: int) -> None:
    """With K/V stored as int8, the step's rows are quantized as kv_cache.quantize_int8 does and
    read with their scales: the same logits, int8 values and scales, bit for bit."""
    model = LlamaModel.load(model_dir, CPU, dtype, native_ops=True)
    python, cpp = (decode_step(model, slots, in_cpp, int8=True) for in_cpp in (False, True))
    assert python[1].dtype == torch.int8 and len(python) == 5
    for theirs, ours in zip(python, cpp, strict=True):
        assert torch.equal(ours, theirs)


def test_the_layer_loop_refuses_arguments_that_do_not_fit_the_cache() -> None:
    h, cache = torch.randn(2, 8), torch.zeros(1, 2, 1, 4, 8)
    lens, rows = torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.long)
    norms = [torch.ones(8)] * 2
    weights = [torch.randn(24, 8), torch.eye(8), torch.randn(16, 8), torch.eye(8)]  # one head of 8, one KV head
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="2 norms and 4 products"):
        torch.ops.aiserve.decode_layers(h, norms[:1], weights, [None] * 4, [0] * 4, cos, sin, cache, cache.clone(),
                                        rows, 0, 2, 1, lens, 1, 1, 1e-5, 2)
    with pytest.raises(RuntimeError, match=r"cache row 99 outside 0..7"):
        torch.ops.aiserve.decode_layers(h, norms, weights, [None] * 4, [0] * 4, cos, sin, cache, cache.clone(),
                                        torch.tensor([0, 99]), 0, 2, 1, lens, 1, 1, 1e-5, 2)
    with pytest.raises(RuntimeError, match=r"one row per slot of \[lo, hi\)"):
        torch.ops.aiserve.decode_layers(h, norms, weights, [None] * 4, [0] * 4, cos, sin, cache, cache.clone(),
                                        rows, 1, 2, 1, lens, 1, 1, 1e-5, 2)
    int8, scale = torch.zeros(1, 2, 1, 4, 8, dtype=torch.int8), torch.ones(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="an int8 cache comes with k_scale and v_scale"):
        torch.ops.aiserve.decode_layers(h, norms, weights, [None] * 4, [0] * 4, cos, sin, int8, int8.clone(),
                                        rows, 0, 2, 1, lens, 1, 1, 1e-5, 2)
    with pytest.raises(RuntimeError, match=r"k_scale, v_scale must be contiguous \[layers, S, KVH, T\] float32"):
        torch.ops.aiserve.decode_layers(h, norms, weights, [None] * 4, [0] * 4, cos, sin, int8, int8.clone(),
                                        rows, 0, 2, 1, lens, 1, 1, 1e-5, 2, scale[..., :2], scale.clone())


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize(("n", "k"), [(1733, 576), (64, 37), (5, 8)])  # rows not in whole blocks; K % 8 left over
def test_gemv_is_the_product_within_float32_rounding_and_each_rows_own(x_dtype: torch.dtype, w_dtype: torch.dtype,
                                                                       n: int, k: int) -> None:
    """Up to four rows, with and without a bias: within float32 rounding of the float64
    product (then rounded to x's dtype), and each row's result the same alone, beside other
    rows and on any number of threads (a fixed order of sums over K)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    b = torch.randn(n, generator=g).to(w_dtype)
    x = torch.randn(4, k, generator=g).to(x_dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [torch.ops.aiserve.gemv(x[i : i + 1], w, b) for i in range(4)]
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4):
                together = torch.ops.aiserve.gemv(x[:rows], w, b)
                assert together.dtype == x_dtype and together.shape == (rows, n)
                for i in range(rows):
                    assert torch.equal(together[i : i + 1], alone[i])
    finally:
        torch.set_num_threads(previous)
    exact = x.double() @ w.double().T
    for bias in (b, None):
        got = torch.ops.aiserve.gemv(x, w, bias).double()
        expected = (exact + (0 if bias is None else bias.double())).to(x_dtype).double()
        ulp = 1e-2 if x_dtype == torch.bfloat16 else 1e-5  # the output's rounding, and float32 sums of K terms
        torch.testing.assert_close(got, expected, atol=ulp * k**0.5, rtol=ulp)


def test_gemv_refuses_what_it_does_not_take() -> None:
    w, x = torch.randn(16, 8), torch.randn(2, 8)
    for bad, match in ((torch.randn(5, 8), "x takes at most 4 rows, got 5"), (torch.randn(2, 9), "the same K"),
                       (x.half(), "bfloat16 or float32")):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.aiserve.gemv(bad, w)
    with pytest.raises(RuntimeError, match=r"w in x's dtype or bfloat16"):
        torch.ops.aiserve.gemv(x.bfloat16(), w)
    with pytest.raises(RuntimeError, match=r"b must be \[N\], N = 16"):
        torch.ops.aiserve.gemv(x, w, torch.randn(15))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.aiserve.gemv(x, torch.randn(8, 16).t())
    assert torch.ops.aiserve.gemv(x[:0], w).shape == (0, 16)  # the lm_head of a step that wants no logits


def test_a_prefill_chunk_without_logits_runs_with_gemv_on(model_dir: Path) -> None:
    """A long prompt's first chunk wants no logits: its lm_head runs on no rows, which the few-row
    product takes (it refused them once, failing every prompt split into chunks); the next
    chunk's one logit row is the same as the whole prompt's in one step."""
    model = LlamaModel.load(model_dir, CPU, torch.float32, native_ops=True)  # float32: the chunks' sums within 1e-3
    assert model.lm_head.gemv
    config = model.config
    shape = (config.num_layers, 1, config.num_kv_heads, 64, config.head_dim)
    prompt = [(13 * t) % 5000 + 100 for t in range(40)]
    logits = []
    for chunks in (((0, 40, True),), ((0, 24, False), (24, 40, True))):
        k, v = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
        with torch.inference_mode():
            steps = [model.forward(build_batch([BatchRow(0, a, prompt[a:b], wants)], config, 64, CPU, native_ops=True),
                                   k, v) for a, b, wants in chunks]
        assert [s.shape[0] for s in steps] == [int(c[2]) for c in chunks]
        logits.append(steps[-1])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=1e-4)


def test_a_models_products_of_few_rows_run_on_gemv(model_dir: Path) -> None:
    """With our ops, a product of up to four rows that is not wide runs on gemv (one slot's
    decode step: every product); with torch's ops, or more rows, on oneDNN or F.linear."""
    for native, slots, expected in ((True, 1, True), (False, 1, False), (True, 33, False)):
        model = LlamaModel.load(model_dir, CPU, torch.bfloat16, native_ops=native)
        assert all(x.gemv == native for x in (model.lm_head, model.layers[0].qkv, model.layers[-1].down))
        config = model.config
        shape = (config.num_layers, slots, config.num_kv_heads, 64, config.head_dim)
        k, v = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
        rows = [BatchRow(slot, 3, [100 + slot], True) for slot in range(slots)]
        model.layers_in_cpp = False  # the Python loop: each product is its own op in the profile
        with torch.inference_mode(), torch.profiler.profile() as prof:
            model.forward(build_batch(rows, config, 64, CPU, native_ops=native), k, v)
        gemvs = sum(e.name == "aiserve::gemv" for e in prof.events())
        assert gemvs == (4 * config.num_layers + 1 if expected else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_gives_torch_max_indices_ties_and_nans_included(dtype: torch.dtype) -> None:
    """The first of equal maxima, the first NaN where there is one, a row of -inf's first id."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 49152, generator=g).to(dtype)
    x[1, [7, 700, 40000]] = 50.0  # a tie: the first
    x[2, [5, 9000]] = float("nan")  # NaN beats everything: the first NaN
    x[3] = float("-inf")
    x[4, 0] = 60.0  # the very first id
    x[5, -1] = 60.0  # the very last id
    x[6] = 0.0
    x[6, 100] = -0.0  # equal to 0.0: still the first
    logits = x[:, :-3]  # strided rows (unit stride in a row)
    for rows in (x, logits, x[:1]):
        assert torch.equal(torch.ops.aiserve.argmax_rows(rows), torch.max(rows, dim=-1).indices)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.aiserve.argmax_rows(x.half())
    with pytest.raises(RuntimeError, match="unit stride"):
        torch.ops.aiserve.argmax_rows(x.t())


def test_the_setting_and_the_machine_choose_them() -> None:
    assert native_ops.choose("auto", CPU, "bfloat16", FLAGS) == (True, "on: built for avx2+fma, CPU has them")
    assert native_ops.choose("on", CPU, "float32", FLAGS)[0]
    assert native_ops.choose("off", CPU, "bfloat16", FLAGS) == (False, "off: native_ops=off set")
    assert native_ops.choose("auto", torch.device("cuda"), "bfloat16", FLAGS) == (False, "off: the model runs on cuda")
    assert native_ops.choose("auto", CPU, "float16", FLAGS) == \
        (False, "off: they run bfloat16 and float32, not float16")
    assert native_ops.choose("auto", CPU, "bfloat16", frozenset({"sse4_2"})) == \
        (False, "off: this CPU lacks avx2 and fma")
    with pytest.raises(ConfigError, match="^native_ops: on asked for, but this CPU lacks fma"):
        native_ops.choose("on", CPU, "bfloat16", frozenset({"avx2"}))


def test_an_unbuilt_library_leaves_torchs_ops_and_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_ops, "load", lambda: False)
    use, why = native_ops.choose("auto", CPU, "bfloat16", FLAGS)
    assert not use and why.startswith("off: they are not built") and "python -m services.inference.native_ops" in why
    with pytest.raises(ConfigError, match="they are not built"):
        native_ops.choose("on", CPU, "bfloat16", FLAGS)


def test_the_library_name_follows_the_sources_and_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A changed source or torch gets a new file name: a stale build is never loaded."""
    built = native_ops.library_path()
    assert built.exists() and built.parent.is_relative_to(Path(native_ops.sys.prefix))
    assert {p.name for p in native_ops.SOURCES} == {"decode_attention.cpp", "decode_layers.cpp", "fused_ops.cpp",
                                                    "gemv.cpp"}
    assert [p.name for p in native_ops.HEADERS] == ["ops.h"]
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert native_ops.library_path() != built
    monkeypatch.undo()
    assert native_ops.library_path(native_ops.SOURCES + native_ops.HEADERS) == built
    for i, source in enumerate(files := native_ops.SOURCES + native_ops.HEADERS):
        changed = tmp_path / source.name
        changed.write_text(source.read_text() + "\n// changed\n")
        assert native_ops.library_path((*files[:i], changed, *files[i + 1:])) != built
