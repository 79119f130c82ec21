"""The model run in-process, without the engine's scheduler or threads: what ``aiserve eval`` and
``aiserve models quantize`` measure with.

It runs the service's own forward (``LlamaModel.forward`` over batches from
``runner.build_batch``) on a small KV cache of its own, so what it measures is the code that
serves: logits of every position of a text, greedy answers to a batch of prompts (decode rows
together, as the engine batches them), and a timed greedy decode at batch 1.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from services.inference.kv_cache import KVCache, KVLayout, KVPlan
from services.inference.llama import LlamaModel
from services.inference.runner import BatchRow, build_batch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` intra-op threads inside the block, the previous count restored after.

    The measurements default to one: on the shared 2-core VM, two OpenMP threads competing with
    other work made a 10 s evaluation take 120 s (each step waits for its slower thread)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True, slots=True)
class DecodeSpeed:
    """A timed greedy decode: ``tokens`` decode steps after the prompt, batch 1."""

    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class OfflineModel:
    """One loaded model and the forwards the measurements need (call from one thread)."""

    def __init__(self, model: LlamaModel, kv_dtype: str = "auto") -> None:
        self.model = model
        self.kv_dtype = torch.int8 if kv_dtype == "int8" else model.dtype
        """The KV cache's storage, as the service's ``kv_dtype`` setting chooses it."""

    def _cache(self, slots: int, slot_len: int) -> KVCache:
        """A zeroed KV cache of ``slots`` slots of ``slot_len`` tokens (no prefix store)."""
        c = self.model.config
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype)
        return KVCache(layout, KVPlan(slots, slot_len, 0, 16), self.model.device)

    def _forward(self, rows: Sequence[BatchRow], slot_len: int, cache: KVCache,
                 all_rows: bool = False) -> torch.Tensor:
        """Logits [R, V] in float32 of the rows' last tokens (every token when ``all_rows``)."""
        batch = build_batch(rows, self.model.config, slot_len, self.model.device)
        if all_rows:
            batch = dataclasses.replace(batch, logits_rows=torch.arange(batch.input_ids.shape[0],
                                                                        device=self.model.device))
        with torch.inference_mode():
            return self.model.forward(batch, cache.k, cache.v, cache.k_scale, cache.v_scale).float()

    def text_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] (float32) after each of ``ids``: one prefill of the whole text."""
        cache = self._cache(1, len(ids))
        return self._forward([BatchRow(0, 0, list(ids), needs_logits=True)], len(ids), cache, all_rows=True)

    def greedy(self, prompts: Sequence[Sequence[int]], max_new: int, eos: frozenset[int]) -> list[list[int]]:
        """Each prompt's greedy continuation (up to ``max_new`` tokens, EOS included when met):
        all prompts prefilled in one step, then their decode rows together each step."""
        slot_len = max(len(p) for p in prompts) + max_new
        cache = self._cache(len(prompts), slot_len)
        rows = [BatchRow(i, 0, list(p), needs_logits=True) for i, p in enumerate(prompts)]
        answers: list[list[int]] = [[] for _ in prompts]
        while rows:
            picks = self._forward(rows, slot_len, cache).argmax(dim=-1).tolist()
            following = []
            for row, token in zip(rows, picks, strict=True):
                answers[row.slot].append(token)
                if token not in eos and len(answers[row.slot]) < max_new:
                    following.append(BatchRow(row.slot, row.start + len(row.token_ids), [token], True))
            rows = following
        return answers

    def decode_speed(self, prompt: Sequence[int], tokens: int) -> DecodeSpeed:
        """Time ``tokens`` greedy decode steps after a prefill of ``prompt`` (batch 1, no EOS
        stop: every step is timed)."""
        slot_len = len(prompt) + tokens + 1
        cache = self._cache(1, slot_len)
        token = int(self._forward([BatchRow(0, 0, list(prompt), True)], slot_len, cache).argmax())
        started = time.perf_counter()
        for step in range(tokens):
            row = BatchRow(0, len(prompt) + step, [token], True)
            token = int(self._forward([row], slot_len, cache).argmax())
        return DecodeSpeed(tokens, time.perf_counter() - started)
