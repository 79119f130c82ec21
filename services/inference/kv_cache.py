"""The KV cache: preallocated K/V tensors for the running batch plus a prefix block store.

Memory is fixed at start, so the engine can never run out of it mid-step: the scheduler admits
a request only into a free slot and otherwise keeps it waiting. By default the cache is sized
from sequences (``max_num_seqs`` slots of ``max_seq_len`` tokens in the KV dtype, plus the
prefix store's share), so a float32 cache holds as many sequences as a bf16 one; an explicit
``kv_cache_bytes`` budget instead holds as many slots as fit.

- Slots ``k, v: [layers, slots, kv_heads, slot_len, head_dim]``: one sequence per slot. The
  running batch is kept in slots ``[0, n)`` (the scheduler moves the last slot into a hole
  when a sequence leaves), so decode attention reads ``k[l, :n, :, :L]`` as a view: no
  per-step gather or copy of the cache.
- Prefix store ``pk, pv: [layers, blocks, kv_heads, block_size, head_dim]``: K/V of
  block-aligned prompt prefixes (a shared system prompt), copied into a new sequence's slot
  at admission instead of being recomputed. ``prefix_index.PrefixIndex`` says what is where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.inference.engine_config import KVCacheConfig
from services.inference.prefix_index import BlockCopy
from services.inference.slot_table import SlotMove

_MAX_SIZED_BYTES = 1 << 40  # a cache sized from sequences obeys kv_cache_bytes' own limit
INT8_SCALE_DTYPE = torch.float32  # one symmetric scale per token per head, stored beside the int8 values


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``x [..., head_dim]`` with one scale per row (per token per head):
    ``scale = max|x| / 127``, values rounded to nearest. Dequantized error per element is at most
    ``scale / 2``. Returns (int8 values, float32 scales of shape ``x.shape[:-1]``)."""
    amax = x.detach().abs().amax(dim=-1).to(INT8_SCALE_DTYPE)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x.to(INT8_SCALE_DTYPE) / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_int8`` in ``dtype`` (the attention's compute dtype)."""
    return (q.to(INT8_SCALE_DTYPE) * scale.unsqueeze(-1)).to(dtype)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one cached token costs: the model's K/V shape and the cache dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token; an int8 cache also pays one float32 scale per
        token per head for each of K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_head = self.head_dim * itemsize
        if self.dtype == torch.int8:
            per_head += torch.empty((), dtype=INT8_SCALE_DTYPE).element_size()
        return 2 * self.num_layers * self.num_kv_heads * per_head  # K and V


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Sizes that fit a config into its budget."""

    num_slots: int
    slot_len: int
    num_blocks: int
    block_size: int

    @classmethod
    def fit(cls, config: KVCacheConfig, layout: KVLayout, max_num_seqs: int,
            context_len: int) -> KVPlan:
        """The cache's sizes. By default (``kv_cache_bytes`` 0) ``max_num_seqs`` slots, whatever
        the dtype, and a prefix store of ``prefix_cache_fraction`` of the whole. With a byte
        budget: as many slots as it allows (at most ``max_num_seqs``), and the prefix store gets
        its share plus whatever the slots leave unused."""
        config.validate()
        slot_len = min(config.max_seq_len, context_len)
        per_token = layout.bytes_per_token
        slot_bytes = slot_len * per_token
        fraction = config.prefix_cache_fraction
        if config.kv_cache_bytes:
            budget = config.kv_cache_bytes
            num_slots = min(max_num_seqs, (budget - int(budget * fraction)) // slot_bytes)
            if num_slots < 1:
                need = slot_bytes + int(budget * fraction)
                raise ValueError(f"kv_cache_bytes: {budget} holds no slot of max_seq_len {slot_len}; need >= {need}")
        else:
            num_slots = max_num_seqs
            budget = num_slots * slot_bytes + int(num_slots * slot_bytes * fraction / (1 - fraction))
            if budget > _MAX_SIZED_BYTES:
                raise ValueError(f"max_num_seqs: {max_num_seqs} slots of max_seq_len {slot_len} need {budget} "
                                 f"bytes of KV cache, over 1 TiB; lower them or set kv_cache_bytes")
        num_blocks = (budget - num_slots * slot_bytes) // (config.prefix_block_size * per_token) if fraction else 0
        return cls(num_slots, slot_len, num_blocks, config.prefix_block_size)


class KVCache:
    """The preallocated K/V tensors; the runner applies the scheduler's copies to them."""

    def __init__(self, layout: KVLayout, plan: KVPlan, device: torch.device) -> None:
        self.layout, self.plan = layout, plan
        shape = (layout.num_layers, plan.num_slots, layout.num_kv_heads, plan.slot_len,
                 layout.head_dim)
        block_shape = (layout.num_layers, plan.num_blocks, layout.num_kv_heads, plan.block_size,
                       layout.head_dim)
        # zeros, not empty: commit the memory now (no surprise later) and keep every row finite
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)  # [L, S, KVH, T, D]
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)  # [L, S, KVH, T, D]
        self.pk = torch.zeros(block_shape, dtype=layout.dtype, device=device)  # [L, N, KVH, B, D]
        self.pv = torch.zeros(block_shape, dtype=layout.dtype, device=device)  # [L, N, KVH, B, D]
        # int8 storage: one scale per token per head beside the values, [L, S, KVH, T] and
        # [L, N, KVH, B] (ones: a zero row stays 0); None otherwise
        scaled = layout.dtype == torch.int8

        def scales(dims: tuple[int, ...]) -> torch.Tensor | None:
            return torch.ones(dims, dtype=INT8_SCALE_DTYPE, device=device) if scaled else None

        self.k_scale, self.v_scale = scales(shape[:-1]), scales(shape[:-1])
        self.pk_scale, self.pv_scale = scales(block_shape[:-1]), scales(block_shape[:-1])

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot tensor, prefix tensor) for the values and, with int8 storage, the scales."""
        pairs = [(self.k, self.pk), (self.v, self.pv)]
        if self.k_scale is not None:
            assert self.v_scale is not None and self.pk_scale is not None and self.pv_scale is not None
            pairs += [(self.k_scale, self.pk_scale), (self.v_scale, self.pv_scale)]
        return pairs

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (``slot_len`` tokens)."""
        return self.plan.slot_len * self.layout.bytes_per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one prefix block (``block_size`` tokens)."""
        return self.plan.block_size * self.layout.bytes_per_token

    @property
    def total_bytes(self) -> int:
        """Bytes of every slot and prefix block (allocated at start)."""
        return self.plan.num_slots * self.slot_bytes + self.plan.num_blocks * self.block_bytes

    def used_bytes(self, num_used_slots: int, num_used_blocks: int) -> int:
        """Bytes held by the running batch's slots and the stored prefix blocks."""
        return num_used_slots * self.slot_bytes + num_used_blocks * self.block_bytes

    def move(self, moves: tuple[SlotMove, ...]) -> None:
        """Fill holes left by finished sequences (in order; once per finish, not per step)."""
        for m in moves:
            if m.num_tokens:
                for slots, _ in self._pairs():
                    slots[:, m.dst, :, : m.num_tokens] = slots[:, m.src, :, : m.num_tokens]

    def load_prefix(self, copies: tuple[BlockCopy, ...]) -> None:
        """Copy stored prefix blocks into the slots of newly admitted sequences."""
        for copy in copies:
            for index, block in copy.blocks:
                span = self._span(index)
                for slots, blocks in self._pairs():
                    slots[:, copy.slot, :, span] = blocks[:, block]

    def save_prefix(self, copies: tuple[BlockCopy, ...]) -> None:
        """Copy freshly computed prompt blocks from slots into the prefix store."""
        for copy in copies:
            for index, block in copy.blocks:
                span = self._span(index)
                for slots, blocks in self._pairs():
                    blocks[:, block] = slots[:, copy.slot, :, span]

    def _span(self, block_index: int) -> slice:
        size = self.plan.block_size
        return slice(block_index * size, (block_index + 1) * size)
