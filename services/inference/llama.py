"""Our own forward pass for the Llama family (Llama, Mistral, Qwen2) over the slot KV cache.

One call runs a whole engine step: every sequence's new tokens are flattened into one stream
of ``N`` tokens, so the linear layers run once over all of them (decodes and prefill chunks
together). Attention then runs in two kinds of groups (``ForwardBatch``):

- one-token rows (decodes): one call over the cache view ``k[lo:hi, :, :L]`` of their slot
  range: our CPU kernel (``native_ops.py``), where each slot reads only its own keys, or
  ``scaled_dot_product_attention`` with a mask for rows of different lengths;
- multi-token rows (prefill chunks): one call each, causal from the row's first position.

Grouped-query attention needs no copy of K/V: the query heads that share a KV head are
folded into the query-length axis (``[B, H, T, D] -> [B, KVH, G*T, D]``).
Device and dtype are parameters; nothing here assumes CPU or CUDA. ``matmul_dtype`` lets a
bf16 model run its larger matrix products on float32 kernels where the CPU has no bf16 units
(there bf16 GEMMs are emulated: 4-6x slower at 64 rows, yet faster for 1-2 rows, which only read
half the bytes). Such a model keeps a float32 copy of each matmul weight, rounded to bf16 first,
and its activations stay bf16, so the products are those of a bf16 GEMM with float32
accumulation; the copy is used once a product has enough rows.

The architecture facts are ``llama_config.py``, the weights ``llama_weights.py``, the CPU
kernels (packed bf16 weights) ``aiserve/common/onednn.py``; which matmul dtype a machine gets,
``precision.py``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from aiserve.common.onednn import bucket_rows, build_kernels
from aiserve.model_facts import CONFIG_FILE
from services.inference.kv_cache import dequantize_int8, quantize_int8
from services.inference.llama_config import LlamaConfig, rope_tables
from services.inference.llama_weights import Layer, Linear, build_weights, is_quantized, quantized_dtype, read_tensors
from services.inference.native_ops import unsupported

# Rows from which the float32 copy beats an emulated bf16 matmul (measured, AVX2 EPYC, 2 cores).
# Packed, a layer's copies win alone from 2 rows (0.25 against 0.39 ms for its four products),
# but one request decoding alone ran ~5% slower with 2 than with 4 (73 against 77 tokens/s,
# alternated, the avx512_bf16 EPYC capped to AVX2), so 4 stays.
WIDE_MIN_ROWS = 4
WIDE_MIN_LOGIT_ROWS = 8


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """A multi-token row: stream tokens ``[first, first + num_tokens)``, attended on their own."""

    first: int
    num_tokens: int
    slot: int
    context_len: int
    mask: torch.Tensor  # [1, 1, G*n, ctx] bool; True = may attend


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Device tensors of one step, built once (``runner.build_batch``) and shared by every layer."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    cache_rows: torch.Tensor  # [N*KVH] row of each new K/V in a layer's [S*KVH*T, D] view
    logits_rows: torch.Tensor  # [R] stream rows whose logits are returned, in row order
    num_single: int  # stream rows [0, num_single) are decode rows (a token, maybe drafts), by slot
    single_lo: int
    single_hi: int
    single_len: int  # keys read per decode row (the longest context among them)
    single_index: torch.Tensor | None  # [num_single] place in the [hi-lo, width] grid, flattened;
    # None: one token per slot and rows == slots
    single_mask: torch.Tensor | None  # [hi-lo, 1, width*G or 1, L] bool
    single_lens: torch.Tensor | None  # [hi-lo, width*G] int32: keys each query reads (the kernel's mask)
    spans: tuple[PrefillSpan, ...]
    single_width: int = 1  # tokens per slot in the decode rows' attention call (1 + drafts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers does it: statistics in float32, scale in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True, slots=True)
class _Masks:
    """A step's attention masks, additive (0 or -inf) in the model dtype."""

    single: torch.Tensor | None
    spans: list[torch.Tensor]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float mask SDPA makes of a bool one (True = attend): 0 where True, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: ``x * cos + rotate_half(x) * sin``, with rotate_half's sign folded into
    ``signed_sin`` ([-sin, sin] by halves), so the halves swap in one ``roll`` (the same bits)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LlamaModel:
    """Weights in ordinary memory on ``device`` in ``dtype``, and the batched forward."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, matmul_dtype: torch.dtype | None = None, pack_weights: bool = True,
                 native_ops: bool = False) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.native_ops = native_ops and unsupported(device, str(dtype).removeprefix("torch.")) is None
        """Whether the forward runs our CPU ops (``native_ops.py``; loaded by the caller): the decode
        attention, the residual adds with their RMSNorms, the rotary embedding. Asked for where
        they cannot run (a quantized version's dtype, a model loaded directly on another device),
        the forward keeps torch's: ``native_ops.unsupported`` is the one check."""
        self.matmul_dtype = matmul_dtype or dtype
        weights = build_weights(config, tensors, device, dtype, self.matmul_dtype, pack_weights, self.native_ops)
        self.embed, self.lm_head, self.norm, self.layers = weights.embed, weights.lm_head, weights.norm, weights.layers
        self._linears = weights.linears()
        self.packed_weights = all(x.packed is not None or x.packed_wide is not None for x in self._linears)
        """Whether every matmul runs on a oneDNN-packed weight (its float32 copy's, where it has one)."""
        self.layers_in_cpp = self.native_ops and not any(is_quantized(x.w) for x in self._linears)
        """Whether a decode-only step runs its loop over layers in one call of our op
        (``torch.ops.aiserve.decode_layers``), the same ops without the Python between them; a
        quantized version's products run on torchao's Python tensor subclasses, so not there."""
        self._norms = [w for layer in self.layers for w in (layer.ln_attn, layer.ln_mlp)]
        self._products = {wide: _product_lists(self.layers, wide) for wide in (False, True)}
        self._cos, self._signed_sin = rope_tables(config, device)  # [P, D] each, float32

    def prepare_kernels(self, max_rows: int, max_logit_rows: int | None = None) -> int:
        """Run each packed weight shape once at every bucketed row count up to ``max_rows`` (a
        step's token budget; at most ``onednn.PREPARE_MAX_ROWS``), the lm_head only up to
        ``max_logit_rows`` (the most logits a step asks for; None = ``max_rows``), so oneDNN
        builds its kernels now and not while serving. Returns the number of products run (0
        when nothing is packed). Call it on the torch thread."""
        head, *linears = _packed_products(self._linears)  # the lm_head is first
        # The lm_head at rows it never sees was ~57% of this work (0.47 of 0.82 CPU s; docs/engine.md)
        head_rows = min(max_rows, max_logit_rows or max_rows)
        num_head = build_kernels([head], head_rows) if head is not None else 0
        shapes = {(p.shape, p.dtype): (p, b) for p, b in filter(None, linears)}  # a kernel per shape and dtype
        return num_head + build_kernels(list(shapes.values()), max_rows)

    @classmethod
    def load(cls, folder: Path, device: torch.device | str, dtype: torch.dtype,
             matmul_dtype: torch.dtype | None = None, pack_weights: bool = True,
             native_ops: bool = False) -> LlamaModel:
        """Read config.json and every *.safetensors of ``folder`` (copied off the file mapping).
        ``matmul_dtype`` None = ``dtype`` (the service passes precision.py's choice); ``pack_weights``: keep
        oneDNN-packed copies of the matmul weights where ``pack_weight`` allows; ``native_ops``:
        run our CPU ops (``torch.ops.aiserve``, loaded by the caller) where torch's would run.

        A quantized version runs in the dtype it was quantized from, whatever ``dtype`` says:
        its weights compute in that dtype (torchao), and a float32 copy would undo the saving."""
        config = LlamaConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
        tensors = read_tensors(folder)
        if (qdtype := quantized_dtype(tensors)) is not None:
            dtype = matmul_dtype = qdtype
        device = torch.device(device)
        return cls(config, tensors, device, dtype, matmul_dtype, pack_weights, native_ops)

    def forward(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K/V into the cache and return logits [R, V] of ``batch.logits_rows``.

        k_cache, v_cache: [layers, slots, KVH, T, D]; an int8 cache (kv_cache.py) comes with its
        scales k_scale, v_scale: [layers, slots, KVH, T].
        """
        c = self.config
        n, d = batch.input_ids.shape[0], c.head_dim
        h = F.embedding(batch.input_ids, self.embed)  # [N, hidden]
        cos = self._cos[batch.positions].to(self.dtype)  # [N, D]
        sin = self._signed_sin[batch.positions].to(self.dtype)  # [N, D], rotate_half's sign in
        wide = n >= WIDE_MIN_ROWS
        if (self.layers_in_cpp and batch.num_single == n and batch.single_index is None
                and batch.single_lens is not None):  # decode rows only, one token a slot: no masks
            h = torch.ops.aiserve.decode_layers(
                h, self._norms, *self._products[wide], cos, sin, k_cache, v_cache, batch.cache_rows,
                batch.single_lo, batch.single_hi, batch.single_len, batch.single_lens, c.num_heads, c.num_kv_heads,
                c.rms_norm_eps, bucket_rows(n), k_scale, v_scale)
            return self._logits(h, batch)
        # SDPA turns a bool mask into an additive one on every call: once per step instead (our
        # decode attention reads single_lens instead)
        if batch.num_single and not self.native_ops and batch.single_mask is None:
            raise ValueError("batch: built without single_mask, which SDPA's decode attention reads")
        single = None if batch.single_mask is None or self.native_ops else _additive(batch.single_mask, self.dtype)
        masks = _Masks(single, [_additive(span.mask, self.dtype) for span in batch.spans])
        scales: Any = zip(k_scale, v_scale, strict=True) if k_scale is not None and v_scale is not None \
            else itertools.repeat((None, None))
        delta: torch.Tensor | None = None  # the last sublayer's output, not yet added to h
        for layer, kc, vc, (ks, vs) in zip(self.layers, k_cache, v_cache, scales, strict=False):
            h, x = self._add_norm(h, delta, layer.ln_attn)
            qkv = layer.qkv(x, wide)  # [N, (H + 2*KVH) * D]
            q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
            q = self._rotate(q.view(n, c.num_heads, d), cos, sin)  # [N, H, D]
            k = self._rotate(k.view(n, c.num_kv_heads, d), cos, sin)  # [N, KVH, D]
            # Indexed assignment (index_put_) writes the scattered rows ~2x faster than index_copy_
            _store(kc, ks, batch.cache_rows, k.reshape(-1, d))
            _store(vc, vs, batch.cache_rows, v.reshape(-1, d))
            h, x = self._add_norm(h, layer.o(self._attention(q, _KV(kc, ks), _KV(vc, vs), batch, masks), wide),
                                  layer.ln_mlp)
            gate, up = layer.gate_up(x, wide).chunk(2, dim=-1)  # [N, I] each
            delta = layer.down(F.silu(gate) * up, wide)
        return self._logits(h if delta is None else h + delta, batch)

    def _logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] of ``batch.logits_rows`` of the last layer's output ``h``."""
        last = rms_norm(h[batch.logits_rows], self.norm, self.config.rms_norm_eps)  # [R, hidden]
        return self.lm_head(last, last.shape[0] >= WIDE_MIN_LOGIT_ROWS)  # [R, V]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add ``h + delta`` (none when ``delta`` is None) and its RMSNorm: (h, normed).
        Our op adds in place and normalises in one pass per row, with the same bf16 roundings."""
        if self.native_ops:
            return h, torch.ops.aiserve.rms_norm(h, delta, weight, self.config.rms_norm_eps)
        h = h if delta is None else h + delta
        return h, rms_norm(h, weight, self.config.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of ``x [N, heads, D]`` (``cos``, ``sin``: [N, D]); our op rotates
        the view in place (into the step's qkv product, which nothing else reads)."""
        if self.native_ops:
            torch.ops.aiserve.rotate_(x, cos, sin)
            return x
        return _rotate(x, cos[:, None, :], sin[:, None, :])

    def _attention(self, q: torch.Tensor, kc: _KV, vc: _KV, batch: ForwardBatch, masks: _Masks) -> torch.Tensor:
        """q: [N, H, D]; kc, vc: one layer's cache [S, KVH, T, D] (and int8 scales). Returns [N, H*D]."""
        c = self.config
        n, kvh, g, d = q.shape[0], c.num_kv_heads, c.num_groups, c.head_dim
        scale = d**-0.5
        if batch.num_single:
            lo, hi, length, w = batch.single_lo, batch.single_hi, batch.single_len, batch.single_width
            qs = q[: batch.num_single]  # [Ns, H, D]
            if batch.single_index is not None:  # grid places without a query get zeros
                qs = q.new_zeros((hi - lo) * w, c.num_heads, d).index_copy_(0, batch.single_index, qs)
            if w == 1:
                qs = qs.view(hi - lo, kvh, g, d)
            else:  # a slot's drafts are more queries of its own: [hi-lo, KVH, w*G, D], (token, group)
                qs = qs.view(hi - lo, w, kvh, g, d).transpose(1, 2).reshape(hi - lo, kvh, w * g, d)
            if self.native_ops:  # each slot reads its own keys: no mask, int8 read as it is
                if batch.single_lens is None:
                    raise ValueError("batch: built without single_lens, which our decode attention reads")
                out = torch.ops.aiserve.decode_attention(
                    qs.contiguous(), kc.values[lo:hi, :, :length], vc.values[lo:hi, :, :length], batch.single_lens,
                    scale, kc.scale_view(lo, hi, length), vc.scale_view(lo, hi, length))
            else:
                out = F.scaled_dot_product_attention(
                    qs, kc.read(lo, hi, length, q.dtype), vc.read(lo, hi, length, q.dtype), attn_mask=masks.single,
                    scale=scale,
                )  # [hi-lo, KVH, w*G, D]
            if w != 1:
                out = out.view(hi - lo, kvh, w, g, d).transpose(1, 2)
            out = out.reshape((hi - lo) * w, c.num_heads * d)  # [(hi-lo)*w, H*D]
            if batch.single_index is not None:
                out = out[batch.single_index]
            if not batch.spans:
                return out
        result = q.new_empty(n, c.num_heads * d)
        if batch.num_single:
            result[: batch.num_single] = out
        for span, span_mask in zip(batch.spans, masks.spans, strict=True):
            t, a = span.num_tokens, span.first
            qp = q[a : a + t].view(t, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * t, d)
            o = F.scaled_dot_product_attention(
                qp, kc.read(span.slot, span.slot + 1, span.context_len, q.dtype),
                vc.read(span.slot, span.slot + 1, span.context_len, q.dtype), attn_mask=span_mask, scale=scale,
            )  # [1, KVH, G*t, D]
            result[a : a + t] = o.view(kvh, g, t, d).permute(2, 0, 1, 3).reshape(t, c.num_heads * d)
        return result


def _packed_products(linears: list[Linear]) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
    """Each product's packed weight and bias as ``onednn.build_kernels`` takes them, the float32
    copy's where there is one; None for a product that is not packed."""
    return [(x.packed_wide, x.b_wide) if x.packed_wide is not None else
            (x.packed, x.b) if x.packed is not None else None for x in linears]


def _product_lists(layers: list[Layer], wide: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
    """Weights, biases and modes of every layer's products (qkv, o, gate_up, down) as ``Linear``
    runs them for ``wide``: the layer loop's arguments (csrc/decode_layers.cpp)."""
    plans = [x.plan(wide) for layer in layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [p[0] for p in plans], [p[1] for p in plans], [p[2] for p in plans]


@dataclass(frozen=True, slots=True)
class _KV:
    """One layer's K or V cache [S, KVH, T, D], with its scales [S, KVH, T] when stored as int8."""

    values: torch.Tensor
    scale: torch.Tensor | None

    def read(self, lo: int, hi: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots [lo, hi), positions [0, length), in ``dtype`` (an int8 cache is dequantized)."""
        values = self.values[lo:hi, :, :length]
        if self.scale is None:
            return values
        return dequantize_int8(values, self.scale[lo:hi, :, :length], dtype)

    def scale_view(self, lo: int, hi: int, length: int) -> torch.Tensor | None:
        """The int8 scales of slots [lo, hi), positions [0, length) (None when not int8)."""
        return None if self.scale is None else self.scale[lo:hi, :, :length]


def _store(cache: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x [N*KVH, D]`` into ``cache`` at flat ``rows`` (quantized when it is int8)."""
    if scale is None:
        cache.view(-1, x.shape[-1])[rows] = x
        return
    q, s = quantize_int8(x)
    cache.view(-1, x.shape[-1])[rows] = q
    scale.view(-1)[rows] = s
