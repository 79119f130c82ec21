"""The prefix store's index: which block-aligned prompt prefixes have K/V stored (no torch).

Kept apart from the scheduler, which consults it at admission; the KV cache does the copies
the scheduler emits as ``BlockCopy``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy K/V between ``slot`` and the prefix store: (block index in the sequence, store block)."""

    slot: int
    blocks: tuple[tuple[int, int], ...]


@dataclass(slots=True)
class _Block:
    block_id: int
    parent: int | None  # key of the block before it (chain hash), None for the first
    token_ids: tuple[int, ...]
    is_pending: bool  # K/V is written by the step in flight; not matchable until commit()


class PrefixIndex:
    """Which block-aligned prompt prefixes have K/V in the prefix store (LRU, bounded).

    A block's key hashes its tokens and the key of the block before it, so a key names the whole
    prefix up to it. Tokens are compared on a hit, so a hash collision is a miss, never wrong K/V.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending: list[int] = []
        self.num_lookups = 0
        self.num_hits = 0
        """Lookups that found at least one block."""
        self.num_hit_tokens = 0

    @property
    def num_used_blocks(self) -> int:
        """Store blocks holding a prefix (committed or pending)."""
        return self.num_blocks - len(self._free)

    def match(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Store blocks holding the longest stored prefix of ``token_ids`` (<= max_tokens)."""
        hits: list[int] = []
        for key, parent, tokens in self._chain(token_ids, max_tokens // self.block_size):
            block = self._blocks.get(key)
            if block is None or block.is_pending or (block.parent, block.token_ids) != (parent, tokens):
                break
            self._blocks.move_to_end(key)
            hits.append(block.block_id)
        self.num_lookups += 1
        self.num_hits += bool(hits)
        self.num_hit_tokens += len(hits) * self.block_size
        return tuple(hits)

    def insert(self, token_ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Reserve store blocks for the full blocks of ``token_ids`` not stored yet; returns
        (block index in the sequence, store block) pairs to save after this step's forward."""
        new: list[tuple[int, int]] = []
        for i, (key, parent, tokens) in enumerate(self._chain(token_ids, len(token_ids) // self.block_size)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            block_id = self._allocate()
            if block_id is None:
                break
            self._blocks[key] = _Block(block_id, parent, tokens, is_pending=True)
            self._pending.append(key)
            new.append((i, block_id))
        return tuple(new)

    def commit(self) -> None:
        """The step's forward wrote the pending blocks: they may be matched now."""
        for key in self._pending:
            if (block := self._blocks.get(key)) is not None:
                block.is_pending = False
        self._pending.clear()

    def rollback(self) -> None:
        """The step failed: forget the blocks it was to write."""
        for key in self._pending:
            if (block := self._blocks.pop(key, None)) is not None:
                self._free.append(block.block_id)
        self._pending.clear()

    def clear(self) -> None:
        """Forget every block (the store's K/V may be inconsistent after a failed copy)."""
        self._blocks.clear()
        self._pending.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def _chain(self, token_ids: Sequence[int], num_blocks: int) -> Iterator[tuple[int, int | None, tuple[int, ...]]]:
        parent: int | None = None
        size = self.block_size
        for i in range(num_blocks):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            key = hash((parent, tokens))
            yield key, parent, tokens
            parent = key

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((k for k, b in self._blocks.items() if not b.is_pending), None)
        return None if victim is None else self._blocks.pop(victim).block_id
