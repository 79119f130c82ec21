"""The model runner: one scheduler step on the device (prepare inputs -> run model -> sample).

Before the forward it applies the scheduler's cache copies (slot moves, prefix loads); after
it, the prefix saves. Each sampled row keeps its own ``SamplingParams`` and seeded generator,
so a seeded request gives the same text whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.inference.kv_cache import KVCache
from services.inference.llama import ForwardBatch, LlamaConfig, LlamaModel, PrefillSpan
from services.inference.sampler import SamplingParams, sample
from services.inference.scheduler import SchedulerOutput, Seq


class KVCacheError(RuntimeError):
    """A cache copy failed half-way: every running sequence's K/V may be inconsistent."""


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How one sequence picks its tokens: its parameters and its own generator."""

    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One sequence's new tokens in a step: ``token_ids`` at positions ``start``.. of ``slot``."""

    slot: int
    start: int
    token_ids: Sequence[int]
    needs_logits: bool


class ModelRunner:
    """Runs steps of one model over one KV cache."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache

    def execute(self, output: SchedulerOutput, sampling: Mapping[Seq, RowSampling]) -> list[int]:
        """Apply the step; returns one new id per sampled chunk, in chunk order.

        Raises KVCacheError when a cache copy fails, anything else from the forward/sampling
        (then only this step's sequences are affected).
        """
        try:
            self.cache.move(output.moves)
            self.cache.load_prefix(output.prefix_loads)
        except Exception as exc:
            raise KVCacheError(f"KV cache copy failed: {exc}") from exc
        ids = self._run(output, sampling) if output.chunks else []
        try:
            self.cache.save_prefix(output.prefix_saves)
        except Exception as exc:
            raise KVCacheError(f"prefix save failed: {exc}") from exc
        return ids

    def _run(self, output: SchedulerOutput, sampling: Mapping[Seq, RowSampling]) -> list[int]:
        rows = [BatchRow(c.slot, c.start, c.token_ids, c.is_sampled) for c in output.chunks]
        batch = build_batch(rows, self.model.config, self.cache.plan.slot_len, self.model.device)
        logits = self.model.forward(batch, self.cache.k, self.cache.v)  # [R, V]
        seqs = [c.seq for c in output.chunks if c.is_sampled]
        if not seqs:
            return []
        picks = [sampling[s] for s in seqs]
        ids = sample(logits, [p.params for p in picks], [p.generator for p in picks],
                     [s.token_ids for s in seqs])  # [R]
        return [int(i) for i in ids.tolist()]


def build_batch(rows: Sequence[BatchRow], config: LlamaConfig, slot_len: int,
                device: torch.device) -> ForwardBatch:
    """Rows -> the device tensors of one forward. One-token rows go first, sorted by slot, so
    they form one attention call; logits come back in ``rows`` order."""
    singles = sorted((i for i, r in enumerate(rows) if len(r.token_ids) == 1), key=lambda i: rows[i].slot)
    order = singles + [i for i, r in enumerate(rows) if len(r.token_ids) > 1]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    first: dict[int, int] = {}  # row -> its first stream position
    for i in order:
        row, n = rows[i], len(rows[i].token_ids)
        if row.start + n > slot_len:
            raise ValueError(f"row {i}: positions up to {row.start + n} exceed slot_len {slot_len}")
        first[i] = len(ids)
        ids.extend(row.token_ids)
        positions.extend(range(row.start, row.start + n))
        slots.extend([row.slot] * n)
    pos_t, slot_t = torch.tensor(positions), torch.tensor(slots)  # [N], [N]
    heads = torch.arange(config.num_kv_heads)  # [KVH]
    cache_rows = (slot_t[:, None] * config.num_kv_heads + heads) * slot_len + pos_t[:, None]  # [N, KVH]
    logits_rows = [first[i] + len(r.token_ids) - 1 for i, r in enumerate(rows) if r.needs_logits]
    lo, hi, length, index, mask = _single_rows([rows[i] for i in singles], device)
    spans = tuple(_span(first[i], rows[i], config.num_groups, device) for i in order[len(singles):])
    return ForwardBatch(
        torch.tensor(ids, device=device), pos_t.to(device), cache_rows.reshape(-1).to(device),
        torch.tensor(logits_rows, dtype=torch.long, device=device), len(singles), lo, hi, length,
        index, mask, spans)


def _single_rows(rows: Sequence[BatchRow], device: torch.device
                 ) -> tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]:
    """Slot range [lo, hi), keys read, row index (None when rows == slots) and mask of the
    one-token rows (sorted by slot)."""
    if not rows:
        return 0, 0, 0, None, None
    lo, hi = rows[0].slot, rows[-1].slot + 1
    length = max(r.start + 1 for r in rows)
    context = torch.ones(hi - lo, dtype=torch.long)  # slots without a row read key 0 (finite)
    context[[r.slot - lo for r in rows]] = torch.tensor([r.start + 1 for r in rows])
    mask = (torch.arange(length) < context[:, None])[:, None, None, :]  # [hi-lo, 1, 1, L]
    index = None
    if len(rows) != hi - lo:
        index = torch.tensor([r.slot - lo for r in rows], device=device)
    return lo, hi, length, index, mask.to(device)


def _span(first: int, row: BatchRow, num_groups: int, device: torch.device) -> PrefillSpan:
    n, ctx = len(row.token_ids), row.start + len(row.token_ids)
    causal = torch.arange(ctx)[None, :] <= (row.start + torch.arange(n))[:, None]  # [n, ctx]
    mask = causal.repeat(num_groups, 1)[None, None]  # [1, 1, G*n, ctx]; rows are (group, token)
    return PrefillSpan(first, n, row.slot, ctx, mask.to(device))
