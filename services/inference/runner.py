"""The model runner: one scheduler step on the device (prepare inputs -> run model -> sample).

Before the forward it applies the scheduler's cache copies (slot moves, prefix loads); after
it, the prefix saves. Each sampled row keeps its own ``SamplingParams`` and seeded generator,
so a seeded request gives the same text whatever else shares the batch.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.inference.grammar import apply_masks, new_bitmask
from services.inference.kv_cache import KVCache
from services.inference.llama import ForwardBatch, LlamaModel, PrefillSpan
from services.inference.llama_config import LlamaConfig
from services.inference.sampler import SamplingParams, TokenLogprobs, sample, token_logprobs
from services.inference.scheduler_output import ScheduledChunk, SchedulerOutput
from services.inference.sequence import Seq
from services.inference.speculative import accept


class KVCacheError(RuntimeError):
    """A cache copy failed half-way: every running sequence's K/V may be inconsistent."""


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How one sequence picks its tokens: its parameters and its own generator."""

    params: SamplingParams
    generator: torch.Generator | None
    top_logprobs: int | None = None
    """None: no log-probabilities; N: each made token's and N alternatives (sampler.token_logprobs)."""


@dataclass(frozen=True, slots=True)
class Picked:
    """What one sampled chunk made in a step: its new ids, and their log-probabilities when asked."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()


class MaskTimes:
    """Time spent on grammar masks: totals, and the last steps' seconds per masked row (the
    benchmark reads their percentiles)."""

    def __init__(self, keep: int = 4096) -> None:
        self.seconds = 0.0
        self.rows = 0
        self.per_row_s: deque[float] = deque(maxlen=keep)

    def record(self, seconds: float, rows: int) -> None:
        """One step's masks: ``rows`` rows in ``seconds`` (fill and apply)."""
        self.seconds += seconds
        self.rows += rows
        self.per_row_s.append(seconds / rows)


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One sequence's new tokens in a step: ``token_ids`` at positions ``start``.. of ``slot``.

    ``num_drafts`` > 0: the last ``num_drafts`` ids are guesses to verify (speculative decoding);
    the row then returns the logits of its last ``1 + num_drafts`` positions.
    """

    slot: int
    start: int
    token_ids: Sequence[int]
    needs_logits: bool
    num_drafts: int = 0

    @property
    def is_decode(self) -> bool:
        """One token to compute plus its drafts: it joins the decode rows' attention call."""
        return len(self.token_ids) == 1 + self.num_drafts


class ModelRunner:
    """Runs steps of one model over one KV cache."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.masks = MaskTimes()

    def execute(self, output: SchedulerOutput, sampling: Mapping[Seq, RowSampling]) -> list[Picked]:
        """Apply the step; returns, per sampled chunk in chunk order, the ids it made (one, plus
        one per draft the model confirmed) and their log-probabilities when the request asked.

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

    def _run(self, output: SchedulerOutput, sampling: Mapping[Seq, RowSampling]) -> list[Picked]:
        rows = [BatchRow(c.slot, c.start, c.token_ids, c.is_sampled, c.num_drafts) for c in output.chunks]
        batch = build_batch(rows, self.model.config, self.cache.plan.slot_len, self.model.device,
                            native_ops=self.model.native_ops)
        cache = self.cache
        # [R, V]; 1 + drafts per chunk
        logits = self.model.forward(batch, cache.k, cache.v, cache.k_scale, cache.v_scale)
        chunks = [c for c in output.chunks if c.is_sampled]
        if not chunks:
            return []
        firsts = list(itertools.accumulate((1 + c.num_drafts for c in chunks[:-1]), initial=0))  # first row each
        self._mask(logits, chunks, firsts)
        # A drafted chunk's rows pick by argmax like its sequence (drafters are only given to those).
        picks = [sampling[c.seq] for c in chunks for _ in range(1 + c.num_drafts)]
        seen = [c.seq.token_ids for c in chunks for _ in range(1 + c.num_drafts)]
        flat = sample(logits, [p.params for p in picks], [p.generator for p in picks], seen).tolist()  # [R]
        made: list[tuple[int, ...]] = []
        for c, at in zip(chunks, firsts, strict=True):
            ids = [int(i) for i in flat[at : at + 1 + c.num_drafts]]
            made.append(tuple(ids[: accept(c.drafts, ids) + 1]))
        logprobs = self._logprobs(logits, chunks, sampling, firsts, made)
        for c, made_ids in zip(chunks, made, strict=True):
            if c.seq.grammar is not None:
                c.seq.grammar.advance(made_ids)
        return [Picked(made_ids, lp) for made_ids, lp in zip(made, logprobs, strict=True)]

    def _mask(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], firsts: Sequence[int]) -> None:
        """Apply the grammar masks of the constrained chunks' rows (the others get none)."""
        constrained = [(at, c) for at, c in zip(firsts, chunks, strict=True) if c.seq.grammar is not None]
        if not constrained:
            return
        started = time.perf_counter()
        bitmask = new_bitmask(logits.shape[0], logits.shape[1])
        rows: list[int] = []
        for at, c in constrained:
            assert c.seq.grammar is not None
            c.seq.grammar.fill(bitmask, at, c.drafts)
            rows.extend(range(at, at + 1 + c.num_drafts))
        apply_masks(logits, bitmask.to(logits.device), rows)
        self.masks.record(time.perf_counter() - started, len(rows))

    def _logprobs(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], sampling: Mapping[Seq, RowSampling],
                  firsts: Sequence[int], made: Sequence[tuple[int, ...]]) -> list[tuple[TokenLogprobs, ...]]:
        """Per chunk, the log-probabilities of the ids it made, for the chunks that asked."""
        rows: list[int] = []
        params, seen, picked, tops = [], [], [], []
        for c, at, ids in zip(chunks, firsts, made, strict=True):
            row = sampling[c.seq]
            if row.top_logprobs is None:
                continue
            for j, token in enumerate(ids):  # the row after draft j - 1 was fed: its context has the drafts
                rows.append(at + j)
                params.append(row.params)
                seen.append([*c.seq.token_ids, *ids[:j]])
                picked.append(token)
                tops.append(row.top_logprobs)
        if not rows:
            return [() for _ in chunks]
        computed = iter(token_logprobs(logits, rows, params, seen, picked, tops))
        return [tuple(next(computed) for _ in ids) if sampling[c.seq].top_logprobs is not None else ()
                for c, ids in zip(chunks, made, strict=True)]


def build_batch(rows: Sequence[BatchRow], config: LlamaConfig, slot_len: int,
                device: torch.device, *, native_ops: bool | None = None) -> ForwardBatch:
    """Rows -> the device tensors of one forward. Decode rows (one token, maybe with drafts) go
    first, sorted by slot, so they form one attention call; prefill chunks follow, one span
    each. Logits come back in ``rows`` order (a drafted row's ``1 + num_drafts`` in a run).

    ``native_ops``: the decode rows' attention runs our op, which reads ``single_lens`` (True),
    or torch's SDPA, which reads ``single_mask`` (False); None builds both (a batch for either)."""
    singles = sorted((i for i, r in enumerate(rows) if r.is_decode), key=lambda i: rows[i].slot)
    order = singles + [i for i, r in enumerate(rows) if not r.is_decode]
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
    logits_rows = [j for i, r in enumerate(rows) if r.needs_logits
                   for j in range(first[i] + len(r.token_ids) - 1 - r.num_drafts, first[i] + len(r.token_ids))]
    decode = _decode_rows([rows[i] for i in singles], config.num_groups, device,
                          mask=native_ops is not True, lens=native_ops is not False)
    spans = tuple(_span(first[i], rows[i], config.num_groups, device) for i in order[len(singles):])
    return ForwardBatch(
        torch.tensor(ids, device=device), pos_t.to(device), cache_rows.reshape(-1).to(device),
        torch.tensor(logits_rows, dtype=torch.long, device=device), sum(len(rows[i].token_ids) for i in singles),
        decode.lo, decode.hi, decode.length, decode.index, decode.mask, decode.lens, spans, decode.width)


@dataclass(frozen=True, slots=True)
class _DecodeRows:
    lo: int = 0
    hi: int = 0
    length: int = 0
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    width: int = 1


def _decode_rows(rows: Sequence[BatchRow], num_groups: int, device: torch.device, *, mask: bool = True,
                 lens: bool = True) -> _DecodeRows:
    """Slot range [lo, hi), keys read, grid index and mask of the decode rows (sorted by slot);
    the bool ``mask`` (SDPA's) and the per-query ``lens`` (our op's) only where asked for.

    The attention call sees a grid of ``width`` (the most tokens in a row) queries per slot of
    [lo, hi); the index places each token in it (None when every slot has one token). A query
    attends to its own context; grid places without a token read key 0 (finite, discarded).
    """
    if not rows:
        return _DecodeRows()
    lo, hi = rows[0].slot, rows[-1].slot + 1
    width = max(len(r.token_ids) for r in rows)
    length = max(r.start + len(r.token_ids) for r in rows)
    context = torch.ones(hi - lo, width, dtype=torch.long)  # [hi-lo, width]
    places = [(r.slot - lo) * width + j for r in rows for j in range(len(r.token_ids))]
    context.view(-1)[places] = torch.tensor([r.start + j + 1 for r in rows for j in range(len(r.token_ids))])
    bool_mask = query_lens = index = None
    if mask:
        visible = torch.arange(length) < context[..., None]  # [hi-lo, width, L]
        if width == 1:
            bool_mask = visible[:, None].to(device)  # [hi-lo, 1, 1, L]: the same for every group
        else:  # queries are (token, group) in that order: [hi-lo, 1, width*G, L]
            bool_mask = visible.repeat_interleave(num_groups, dim=1)[:, None].to(device)
    if lens:  # [hi-lo, width*G], (token, group)
        query_lens = context.repeat_interleave(num_groups, dim=1).to(torch.int32).to(device)
    if len(places) != hi - lo or width != 1:
        index = torch.tensor(places, device=device)
    return _DecodeRows(lo, hi, length, index, bool_mask, query_lens, width)


def _span(first: int, row: BatchRow, num_groups: int, device: torch.device) -> PrefillSpan:
    n, ctx = len(row.token_ids), row.start + len(row.token_ids)
    causal = torch.arange(ctx)[None, :] <= (row.start + torch.arange(n))[:, None]  # [n, ctx]
    mask = causal.repeat(num_groups, 1)[None, None]  # [1, 1, G*n, ctx]; rows are (group, token)
    return PrefillSpan(first, n, row.slot, ctx, mask.to(device))
