"""The structured-output bench's rounds, which the KV cache bench's int8 side rides on
(bench/constrained_kv.py): every side once a round, in turns, each side's runs kept apart."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from bench import constrained_bench
from services.inference.batch_engine import BatchEngine


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name = name


def test_every_side_runs_once_a_round_in_an_order_reversed_every_other_round(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    calls: list[str] = []

    async def batch(engine: FakeEngine, kind: str, prompts: Sequence[tuple[int, ...]], n: int,
                    max_tokens: int) -> dict[str, Any]:
        calls.append(f"{engine.name}:{kind}")
        return {"tokens_per_s": float(len(calls)), "requests": n, "max_tokens": max_tokens}

    monkeypatch.setattr(constrained_bench, "_batch", batch)
    auto, int8 = cast(BatchEngine, FakeEngine("auto")), cast(BatchEngine, FakeEngine("int8"))
    sides = {kind: (auto, kind) for kind in constrained_bench.WORKLOADS} | {"free, int8 KV": (int8, "free")}
    args = argparse.Namespace(rounds=3, concurrency=32, max_tokens=96)
    runs = asyncio.run(constrained_bench.run_rounds(sides, [(1, 2, 3)], args))
    one = ["auto:free", "auto:logprobs", "auto:json_schema", "int8:free"]
    assert calls == [*one, *reversed(one), *one]
    # each side's runs are its own, in round order: the int8 side ran 4th, 5th and 12th
    assert [r["tokens_per_s"] for r in runs["free, int8 KV"]] == [4.0, 5.0, 12.0]
    assert [r["tokens_per_s"] for r in runs["free"]] == [1.0, 8.0, 9.0]
    assert all(r["requests"] == 32 and r["max_tokens"] == 96 for side in runs.values() for r in side)

