"""The baselines: Hugging Face ``generate``, one request at a time and in static batches."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from aiserve.common.cpu import read_cpu_flags
from bench.measure import percentiles
from bench.workload import Arrival
from services.inference.precision import AUTO, choose_precision
from services.inference.torch_thread import run_in_fresh_thread


def useful(row: Sequence[int], eos: frozenset[int], limit: int) -> int:
    """Tokens up to and including the first EOS (what a server streams), at most ``limit``."""
    for i, t in enumerate(row[:limit]):
        if t in eos:
            return i + 1
    return min(len(row), limit)


def best_dtype() -> str:
    """The dtype Hugging Face runs fastest in on this CPU: the one "auto" gives the engine's
    large products (services/inference/precision.py): bf16 where the CPU has bf16 instructions,
    float32 where bf16 is emulated (several times slower batched, so a bf16 baseline there is
    both slow to run and a straw man)."""
    return choose_precision("cpu", read_cpu_flags(), AUTO, AUTO).matmul


class HF:
    """transformers' ``generate``, loaded and run on fresh threads like our engine's torch work
    (services/inference/torch_thread.py), so neither side pays for the other's thread pools."""

    def __init__(self, folder: Path, eos: frozenset[int], dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = run_in_fresh_thread(lambda: AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True).eval())
        self.eos, self.pad, self.dtype = eos, min(eos), dtype

    def generate(self, batch: Sequence[Sequence[int]], max_new: int) -> tuple[float, list[list[int]]]:
        """One static batch (left-padded); returns seconds and each row's new ids."""
        return run_in_fresh_thread(lambda: self._generate(batch, max_new))

    def _generate(self, batch: Sequence[Sequence[int]], max_new: int) -> tuple[float, list[list[int]]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                      pad_token_id=self.pad)
        return time.perf_counter() - started, out[:, width:].tolist()


def hf_static(hf: HF, batch: Sequence[Sequence[int]], max_new: int) -> dict[str, Any]:
    seconds, rows = hf.generate(batch, max_new)
    tokens = sum(useful(r, hf.eos, max_new) for r in rows)
    return {"requests": len(batch), "useful_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def hf_sequential(hf: HF, batch: Sequence[Sequence[int]], max_new: int) -> dict[str, Any]:
    seconds, tokens = 0.0, 0
    for p in batch:
        s, rows = hf.generate([p], max_new)
        seconds += s
        tokens += useful(rows[0], hf.eos, max_new)
    return {"requests": len(batch), "useful_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def static_groups(work: Sequence[Arrival], concurrency: int) -> list[Sequence[Arrival]]:
    """The static batches of a workload: ``concurrency`` requests at a time, in arrival order."""
    return [work[i : i + concurrency] for i in range(0, len(work), concurrency)]


def time_group(hf: HF, group: Sequence[Arrival]) -> tuple[float, list[list[int]]]:
    """One static batch, run until its longest request ends: seconds and each row's new ids."""
    return hf.generate([a.prompt_ids for a in group], max(a.max_new for a in group))


def static_schedule(groups: Sequence[Sequence[Arrival]], timed: Sequence[tuple[float, list[list[int]]]],
                    eos: frozenset[int]) -> dict[str, Any]:
    """The static batches replayed on a clock from their timings: a batch starts once its last
    request has arrived and the previous batch is done, and runs for its measured seconds; a
    request's first token comes at its batch's first step."""
    clock, tokens, ttft, itl, tpot = 0.0, 0, [], [], []
    for group, (seconds, rows) in zip(groups, timed, strict=True):
        start = max(clock, max(a.at_s for a in group))
        clock = start + seconds
        steps = max(len(r) for r in rows)
        for a, row in zip(group, rows, strict=True):
            n = useful(row, eos, a.max_new)
            tokens += n
            ttft.append((start - a.at_s + seconds / steps) * 1000)
            itl.extend([seconds / steps * 1000] * max(n - 1, 0))
            if n > 1:
                tpot.append(seconds / steps * 1000)
    return {"useful_tokens": tokens, "seconds": clock, "tokens_per_s": tokens / clock,
            "ttft": percentiles(ttft), "inter_token": percentiles(itl), "time_per_token": percentiles(tpot),
            "group_seconds": [round(seconds, 3) for seconds, _ in timed]}
