"""Our own forward pass for the Llama family (Llama, Mistral, Qwen2) over the slot KV cache.

One call runs a whole engine step: every sequence's new tokens are flattened into one stream
of ``N`` tokens, so the linear layers run once over all of them (decodes and prefill chunks
together). Attention then runs in two kinds of groups (``ForwardBatch``):

- one-token rows (decodes): one ``scaled_dot_product_attention`` call over the cache view
  ``k[lo:hi, :, :L]`` of their slot range, with a mask for rows of different lengths;
- multi-token rows (prefill chunks): one call each, causal from the row's first position.

Grouped-query attention needs no copy of K/V: the query heads that share a KV head are
folded into the query-length axis (``[B, H, T, D] -> [B, KVH, G*T, D]``).
Device and dtype are parameters; nothing here assumes CPU or CUDA. ``matmul_dtype`` lets a
bf16 model run its larger matrix products on float32 kernels where the CPU has no bf16 units
(there bf16 GEMMs are emulated: 4-6x slower at 64 rows, yet faster for 1-2 rows, which only read
half the bytes). Such a model keeps a float32 copy of each matmul weight, rounded to bf16 first,
and its activations stay bf16, so the products are those of a bf16 GEMM with float32
accumulation; the copy is used once a product has enough rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from aiserve.model_facts import CONFIG_FILE, CONTEXT_KEYS, context_length

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Rows from which the float32 copy beats an emulated bf16 matmul (measured, AVX2 EPYC, 2 cores)
_WIDE_MIN_ROWS = 4
_WIDE_MIN_LOGIT_ROWS = 8
_PACK_BATCH_HINT = 64  # oneDNN's layout hint; any row count runs on the packed weight
# Larger steps (a budget above this) build their few kernels when they first run: warming them
# would run products of gigabytes at start for a budget that is rarely used in full.
PREPARE_MAX_ROWS = 4096


def default_matmul_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, except float32 for 16-bit dtypes on a CPU without bf16 instructions."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return dtype
    return dtype if any(f in flags for f in _CPU_BF16_FLAGS) else torch.float32


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The architecture facts of config.json that the forward needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope: dict[str, Any] = field(default_factory=dict)
    """rope_parameters / rope_scaling: "rope_type" ("default", "linear", "llama3") and its keys."""

    @property
    def num_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        model_type = data.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        heads = int(data["num_attention_heads"])
        return cls(
            model_type=model_type,
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_context_length(data),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            rope=rope,
        )


def _context_length(data: dict[str, Any]) -> int:
    """The context length by the rule every service uses (aiserve/model_facts.py)."""
    if (length := context_length(data)) is None:
        raise ValueError(f"config.json: none of {', '.join(CONTEXT_KEYS)} is set")
    return length


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (float32) as transformers computes them for the rope type."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = config.rope.get("rope_type", config.rope.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(config.rope["factor"])
    if kind == "llama3":
        factor, low, high = (float(config.rope[k]) for k in
                             ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(config.rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type: {kind!r} is not supported (default, linear, llama3)")


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
    spans: tuple[PrefillSpan, ...]
    single_width: int = 1  # tokens per slot in the decode rows' attention call (1 + drafts)


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` [out, in] reordered once into oneDNN's blocked layout, or None where that is not
    available or not exact (only bf16 on a CPU with bf16 instructions is packed).

    ``F.linear`` on a bf16 CPU tensor runs the same oneDNN kernel but reorders the weight on
    every call; packed, a decode step's products run 1.3-2.8x faster (1 to 64 rows, measured
    on the 2-core VM) with bit-identical results, which ``_packing_is_exact`` checks at load.
    """
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return None


def bucket_rows(rows: int) -> int:
    """The row count a packed product runs with: ``rows`` up to 32, then rounded up to one of
    four steps per power of two (40, 48, 56, 64, 80, ...), so at most 25% more rows.

    oneDNN builds a kernel for each input shape (~1-1.5 ms, measured) and caches up to 1,024 of
    them; a step's row count is its number of new tokens, which varies from step to step.
    Unbucketed, serving kept building kernels, and the cache grew resident memory by ~350 MB
    over 2,000 soak requests (AMX VM, 2026-12-03). Bucketed, the default 512-token step budget
    needs 48 kernels per weight shape, all built at start (``prepare_kernels``).
    """
    if rows <= 32:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, in] @ the packed weight, run on ``bucket_rows(M)`` rows (zeros below ``x``)."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")


def _packing_is_exact(w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor) -> bool:
    """The packed product equals ``F.linear`` bit for bit on a few row counts."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 64):
        x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
        if not torch.equal(_packed_linear(x, packed, b), F.linear(x, w, b)):
            return False
    return True


@dataclass(frozen=True, slots=True)
class _Linear:
    """``x @ w.T + b`` with ``w`` [out, in] in the model dtype, plus the float32 copies
    ``w_wide``/``b_wide`` when the model has a wider matmul dtype (None otherwise), and
    ``packed``, ``w`` in oneDNN's layout, where ``pack_weight`` gives one."""

    w: torch.Tensor
    b: torch.Tensor | None = None
    w_wide: torch.Tensor | None = None
    b_wide: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, wide: bool) -> torch.Tensor:
        if wide and self.w_wide is not None:
            return F.linear(x.to(self.w_wide.dtype), self.w_wide, self.b_wide).to(x.dtype)
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.b)
        return F.linear(x, self.w, self.b)


@dataclass(frozen=True, slots=True)
class _Layer:
    ln_attn: torch.Tensor  # [hidden]
    qkv: _Linear  # [(H + 2*KVH) * D, hidden]; bias for Qwen2
    o: _Linear  # [hidden, H * D]
    ln_mlp: torch.Tensor  # [hidden]
    gate_up: _Linear  # [2 * I, hidden]
    down: _Linear  # [hidden, I]


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

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, matmul_dtype: torch.dtype | None = None, pack_weights: bool = True) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.matmul_dtype = matmul_dtype or dtype
        # Packing applies to products in the model dtype only (not the float32 copies); after
        # one weight fails to pack exactly, the rest are not tried.
        can_pack = pack_weights and self.matmul_dtype == dtype

        def packed(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
            nonlocal can_pack
            if not can_pack:
                return None
            if (p := pack_weight(w)) is None or not _packing_is_exact(w, b, p):
                can_pack = False
                return None
            return p

        def get(*names: str) -> torch.Tensor | None:
            """The named tensors, concatenated, on the device in ``dtype`` (None if absent)."""
            if not all(n in weights for n in names):
                return None
            # copy=True: never keep a buffer backed by the file mapping
            return torch.cat([weights[n] for n in names]).to(device=device, dtype=dtype, copy=True)

        def linear(names: Sequence[str], bias: bool = True) -> _Linear:
            w = get(*[n + ".weight" for n in names])
            if w is None:
                raise ValueError(f"weights: {names[0]}.weight is missing")
            b = get(*[n + ".bias" for n in names]) if bias else None
            if self.matmul_dtype == dtype:
                return _Linear(w, b, packed=packed(w, b))
            return _Linear(w, b, w.to(self.matmul_dtype), None if b is None else b.to(self.matmul_dtype))

        def vector(name: str) -> torch.Tensor:
            if (t := get(name)) is None:
                raise ValueError(f"weights: {name} is missing")
            return t

        self.embed = vector("model.embed_tokens.weight")  # [V, hidden]
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            wide = None if self.matmul_dtype == dtype else self.embed.to(self.matmul_dtype)
            # [V, hidden], shares the embedding (a packed copy is the layout's own buffer)
            self.lm_head = _Linear(self.embed, None, wide,
                                   packed=None if wide is not None else packed(self.embed, None))
        else:
            self.lm_head = linear(["lm_head"], bias=False)
        self.norm = vector("model.norm.weight")
        self.layers = [
            _Layer(
                vector(f"model.layers.{i}.input_layernorm.weight"),
                linear([f"model.layers.{i}.self_attn.{n}_proj" for n in "qkv"]),
                linear([f"model.layers.{i}.self_attn.o_proj"]),
                vector(f"model.layers.{i}.post_attention_layernorm.weight"),
                linear([f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj"], bias=False),
                linear([f"model.layers.{i}.mlp.down_proj"], bias=False),
            )
            for i in range(config.num_layers)
        ]
        self.packed_weights = all(x.packed is not None for x in self._linears())
        """Whether every matmul runs on a oneDNN-packed weight."""
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
        angles = torch.cat((angles, angles), dim=-1)  # [P, D]
        sin = angles.sin()
        half = angles.shape[-1] // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign, folded in
        self._cos, self._signed_sin = angles.cos().to(device), signed_sin.to(device)  # float32

    def _linears(self) -> list[_Linear]:
        return [self.lm_head, *(x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down))]

    def prepare_kernels(self, max_rows: int) -> int:
        """Run each packed weight shape once at every bucketed row count up to ``max_rows`` (a
        step's token budget; at most ``PREPARE_MAX_ROWS``), so oneDNN builds its kernels now and
        not while serving. Returns the number of products run (0 when nothing is packed). Call
        it on the torch thread."""
        shapes: dict[tuple[int, int], _Linear] = {}
        for x in self._linears():
            if x.packed is not None:
                shapes.setdefault((x.w.shape[0], x.w.shape[1]), x)
        buckets, limit = [bucket_rows(1)], min(max_rows, PREPARE_MAX_ROWS)
        while buckets[-1] < limit:  # each bucket once, without walking every row count
            buckets.append(bucket_rows(buckets[-1] + 1))
        with torch.inference_mode():
            for linear in shapes.values():
                for rows in buckets:
                    assert linear.packed is not None
                    _packed_linear(linear.w.new_zeros(rows, linear.w.shape[1]), linear.packed, linear.b)
        return len(shapes) * len(buckets)

    @classmethod
    def load(cls, folder: Path, device: torch.device | str, dtype: torch.dtype,
             matmul_dtype: torch.dtype | None = None, pack_weights: bool = True) -> LlamaModel:
        """Read config.json and every *.safetensors of ``folder`` (copied off the file mapping).
        ``matmul_dtype`` None = ``default_matmul_dtype(device, dtype)``; ``pack_weights``: keep
        oneDNN-packed copies of the matmul weights where ``pack_weight`` allows."""
        config = LlamaConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(path, framework="pt", device="cpu") as f:
                weights.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
        device = torch.device(device)
        return cls(config, weights, device, dtype, matmul_dtype or default_matmul_dtype(device, dtype),
                   pack_weights)

    def forward(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Write the step's K/V into the cache and return logits [R, V] of ``batch.logits_rows``.

        k_cache, v_cache: [layers, slots, KVH, T, D].
        """
        c = self.config
        n, d = batch.input_ids.shape[0], c.head_dim
        h = F.embedding(batch.input_ids, self.embed)  # [N, hidden]
        cos = self._cos[batch.positions].to(self.dtype)[:, None, :]  # [N, 1, D]
        sin = self._signed_sin[batch.positions].to(self.dtype)[:, None, :]  # [N, 1, D], rotate_half's sign in
        wide = n >= _WIDE_MIN_ROWS
        # SDPA turns a bool mask into an additive one on every call: once per step instead
        masks = _Masks(None if batch.single_mask is None else _additive(batch.single_mask, self.dtype),
                       [_additive(span.mask, self.dtype) for span in batch.spans])
        for layer, kc, vc in zip(self.layers, k_cache, v_cache, strict=True):
            x = rms_norm(h, layer.ln_attn, c.rms_norm_eps)
            qkv = layer.qkv(x, wide)  # [N, (H + 2*KVH) * D]
            q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
            q = _rotate(q.view(n, c.num_heads, d), cos, sin)  # [N, H, D]
            k = _rotate(k.view(n, c.num_kv_heads, d), cos, sin)  # [N, KVH, D]
            # Indexed assignment (index_put_) writes the scattered rows ~2x faster than index_copy_
            kc.view(-1, d)[batch.cache_rows] = k.reshape(-1, d)
            vc.view(-1, d)[batch.cache_rows] = v.reshape(-1, d)
            h = h + layer.o(self._attention(q, kc, vc, batch, masks), wide)
            x = rms_norm(h, layer.ln_mlp, c.rms_norm_eps)
            gate, up = layer.gate_up(x, wide).chunk(2, dim=-1)  # [N, I] each
            h = h + layer.down(F.silu(gate) * up, wide)
        last = rms_norm(h[batch.logits_rows], self.norm, c.rms_norm_eps)  # [R, hidden]
        return self.lm_head(last, last.shape[0] >= _WIDE_MIN_LOGIT_ROWS)  # [R, V]

    def _attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   batch: ForwardBatch, masks: _Masks) -> torch.Tensor:
        """q: [N, H, D]; kc, vc: one layer's cache [S, KVH, T, D]. Returns [N, H*D]."""
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
            out = F.scaled_dot_product_attention(
                qs, kc[lo:hi, :, :length], vc[lo:hi, :, :length], attn_mask=masks.single, scale=scale,
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
                qp, kc[span.slot : span.slot + 1, :, : span.context_len],
                vc[span.slot : span.slot + 1, :, : span.context_len], attn_mask=span_mask, scale=scale,
            )  # [1, KVH, G*t, D]
            result[a : a + t] = o.view(kvh, g, t, d).permute(2, 0, 1, 3).reshape(t, c.num_heads * d)
        return result
