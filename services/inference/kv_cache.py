"""The KV cache: preallocated K/V tensors for the running batch plus a prefix block store.

Memory is fixed at start from a byte budget, so the engine can never run out of it mid-step:
the scheduler admits a request only into a free slot and otherwise keeps it waiting.

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


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one cached token costs: the model's K/V shape and the cache dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize  # K and V


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Sizes that fit a config into its byte budget."""

    num_slots: int
    slot_len: int
    num_blocks: int
    block_size: int

    @classmethod
    def fit(cls, config: KVCacheConfig, layout: KVLayout, max_num_seqs: int,
            context_len: int) -> KVPlan:
        """As many slots as the budget allows (at most ``max_num_seqs``); the prefix store gets
        its share plus whatever the slots leave unused."""
        config.validate()
        slot_len = min(config.max_seq_len, context_len)
        per_token = layout.bytes_per_token
        prefix_bytes = int(config.kv_cache_bytes * config.prefix_cache_fraction)
        num_slots = min(max_num_seqs, (config.kv_cache_bytes - prefix_bytes) // (slot_len * per_token))
        if num_slots < 1:
            need = slot_len * per_token + prefix_bytes
            raise ValueError(f"kv_cache_bytes: {config.kv_cache_bytes} holds no slot of "
                             f"max_seq_len {slot_len}; need >= {need}")
        block_bytes = config.prefix_block_size * per_token
        num_blocks = 0
        if config.prefix_cache_fraction > 0:
            num_blocks = (config.kv_cache_bytes - num_slots * slot_len * per_token) // block_bytes
        return cls(num_slots, slot_len, int(num_blocks), config.prefix_block_size)


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
                self.k[:, m.dst, :, : m.num_tokens] = self.k[:, m.src, :, : m.num_tokens]
                self.v[:, m.dst, :, : m.num_tokens] = self.v[:, m.src, :, : m.num_tokens]

    def load_prefix(self, copies: tuple[BlockCopy, ...]) -> None:
        """Copy stored prefix blocks into the slots of newly admitted sequences."""
        for copy in copies:
            for index, block in copy.blocks:
                span = self._span(index)
                self.k[:, copy.slot, :, span] = self.pk[:, block]
                self.v[:, copy.slot, :, span] = self.pv[:, block]

    def save_prefix(self, copies: tuple[BlockCopy, ...]) -> None:
        """Copy freshly computed prompt blocks from slots into the prefix store."""
        for copy in copies:
            for index, block in copy.blocks:
                span = self._span(index)
                self.pk[:, block] = self.k[:, copy.slot, :, span]
                self.pv[:, block] = self.v[:, copy.slot, :, span]

    def _span(self, block_index: int) -> slice:
        size = self.plan.block_size
        return slice(block_index * size, (block_index + 1) * size)
