"""The continuous-batching engine on the real model (float32, small KV cache)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from aiserve.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from services.inference.batch_engine import BatchEngine
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.llama import LlamaModel
from services.inference.request import GenerateRequest, TokenEvent
from services.inference.sampler import SamplingParams
from tests.unit.inference.engine_probes import Events, StepLog, clock_past

MAX_NEW = 10


@pytest.fixture(scope="module")
def model(model_dir: Path, two_torch_threads: None) -> LlamaModel:
    return LlamaModel.load(model_dir, "cpu", torch.float32)


@pytest.fixture
async def engine(model: LlamaModel) -> AsyncIterator[BatchEngine]:
    engine = make_engine(model)
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def make_engine(model: LlamaModel, **settings: object) -> BatchEngine:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 128, **settings})  # type: ignore[arg-type]
    kv = KVCacheConfig(kv_cache_bytes=96 << 20, max_seq_len=128, prefix_block_size=8)
    return BatchEngine(model, frozenset({2}), EngineConfig(64, config, kv))


def prompts(count: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 49152, (4 + 5 * i,), generator=g).tolist()) for i in range(count)]


def request(prompt: Sequence[int], name: str = "r", max_new: int = MAX_NEW, **fields: object) -> GenerateRequest:
    return GenerateRequest(request_id=name, prompt_token_ids=tuple(prompt), max_new_tokens=max_new,
                           ignore_eos=True, **fields)  # type: ignore[arg-type]


async def collect(engine: BatchEngine, req: GenerateRequest) -> tuple[list[int], TokenEvent]:
    ids: list[int] = []
    async for event in engine.generate(req):
        ids.extend(event.token_ids)
    return ids, event


async def test_concurrent_greedy_requests_match_each_alone(engine: BatchEngine) -> None:
    reqs = [request(p, f"r{i}") for i, p in enumerate(prompts(8))]
    together = await asyncio.gather(*(collect(engine, r) for r in reqs))
    assert engine.stats().num_steps < 8 * MAX_NEW  # they really shared steps
    for req, (ids, last) in zip(reqs, together, strict=True):
        alone, _ = await collect(engine, req)
        assert ids == alone and len(ids) == MAX_NEW
        assert last.finish_reason == "length" and last.completion_tokens == MAX_NEW
        assert last.prompt_tokens == len(req.prompt_token_ids)


async def test_same_seed_gives_the_same_text_whatever_the_batch(engine: BatchEngine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    target = request(prompts(1, seed=3)[0], "seeded", params=params)
    alone, _ = await collect(engine, target)
    others = [request(p, f"o{i}", params=SamplingParams(temperature=1.0, seed=i) if i % 2 else
                      SamplingParams()) for i, p in enumerate(prompts(5, seed=4))]
    results = await asyncio.gather(collect(engine, target), *(collect(engine, r) for r in others))
    assert results[0][0] == alone
    other_seed = request(target.prompt_token_ids, "other", params=SamplingParams(temperature=0.9, seed=99))
    assert (await collect(engine, other_seed))[0] != alone


async def test_shared_prefix_is_reused_and_gives_the_same_tokens(engine: BatchEngine) -> None:
    system = prompts(4, seed=5)[3]  # 19 tokens: two full blocks of 8
    first, _ = await collect(engine, request(system + (11, 12), "a"))
    assert engine.stats().prefix_hits == 0
    second, _ = await collect(engine, request(system + (11, 12), "b"))
    stats = engine.stats()
    assert stats.prefix_hits == 1 and stats.prefix_hit_tokens == 16
    assert second == first


async def test_a_cancelled_request_leaves_the_batch_after_at_most_the_step_in_flight(
    engine: BatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted in steps, not time: of the steps that start after ``cancel()`` returns, only the
    first (scheduled before the cancel, in flight) may still compute the request; its KV slot
    is free after that step."""
    log = StepLog(engine, monkeypatch)
    a_prompt, b_prompt = prompts(1)[0], prompts(2)[1]
    a, b = Events(), Events()
    cancel_a = engine.submit(request(a_prompt, "a", max_new=60), a)
    engine.submit(request(b_prompt, "b", max_new=60), b)
    await a.until(1)
    await b.until(1)  # both are in the batch
    before = engine.stats()
    assert before.num_running == 2
    cancel_a()
    mark = log.count
    while log.count < mark + 3:  # b keeps decoding: wait for three more steps
        await b.until(len(b.items) + 1)
    with_a = [a_prompt in step for step in log.since(mark)]
    assert not any(with_a[1:]), with_a
    after = engine.stats()
    assert after.num_running == 1
    assert before.kv_used_bytes - after.kv_used_bytes == engine.cache.slot_bytes
    last = await a.last()  # the cancelled request is told, with no tokens after the step in flight
    assert isinstance(last, TokenEvent) and last.finish_reason == "cancelled"


async def test_an_exception_in_a_step_releases_kv(engine: BatchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> torch.Tensor:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner.model, "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        await collect(engine, request(prompts(1)[0]))
    stats = engine.stats()
    assert (stats.num_running, stats.kv_used_bytes) == (0, 0)
    monkeypatch.undo()
    ids, last = await collect(engine, request(prompts(1)[0]))  # the engine keeps serving
    assert len(ids) == MAX_NEW and last.finish_reason == "length"


async def test_a_cache_copy_failure_fails_every_running_sequence(
    engine: BatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(copies: object) -> None:
        if copies:
            raise RuntimeError("copy failed")

    monkeypatch.setattr(engine.cache, "save_prefix", broken)
    results = await asyncio.gather(*(collect(engine, request(p)) for p in prompts(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert engine.stats().kv_used_bytes == 0 and engine.stats().num_running == 0


async def test_preempted_request_resumes_with_the_same_tokens(model: LlamaModel) -> None:
    engine = make_engine(model, max_num_seqs=1)
    engine.start()
    try:
        low_req = request(prompts(2)[1], "low", max_new=8)
        alone, _ = await collect(engine, low_req)
        low = engine.generate(low_req)
        ids = list((await low.__anext__()).token_ids)
        high, _ = await collect(engine, request(prompts(1)[0], "high", max_new=3, priority=5))
        assert len(high) == 3 and engine.stats().num_preemptions == 1
        async for event in low:
            ids.extend(event.token_ids)
        assert ids == alone
    finally:
        await engine.stop()


async def test_deadline_passing_in_the_queue_raises_deadline_exceeded(model: LlamaModel) -> None:
    engine = make_engine(model)  # not started yet: the request waits in the queue
    try:
        deadline = time.monotonic() + 0.05
        late = Events()
        engine.submit(request(prompts(1)[0], "late", deadline=deadline), late)
        assert engine.stats().num_waiting == 1
        await clock_past(deadline)
        engine.start()  # its first schedule finds the deadline passed
        assert isinstance(await late.last(), DeadlineExceeded)
        assert len(late.items) == 1  # no token before the error: it never ran
        stats = engine.stats()
        assert (stats.num_waiting, stats.num_generated_tokens) == (0, 0)
    finally:
        await engine.stop()


async def test_full_queue_raises_and_stop_fails_the_queued(model: LlamaModel) -> None:
    engine = make_engine(model, max_queue=1)  # not started: requests stay queued
    first = Events()
    engine.submit(request(prompts(1)[0]), first)
    with pytest.raises(ResourceExhausted, match="max_queue"):
        engine.submit(request(prompts(1)[0]), Events())
    await engine.stop()
    assert isinstance(await first.last(), Unavailable)


async def test_a_stopped_engine_refuses_new_requests(engine: BatchEngine) -> None:
    await engine.stop()
    with pytest.raises(Unavailable):
        engine.submit(request(prompts(1)[0]), lambda event: None)


async def test_speculative_decoding_keeps_the_greedy_output(model: LlamaModel) -> None:
    """Drafts are verified in the step that computes them: greedy requests give the same tokens
    with speculative decoding as without, in fewer steps, while a sampled request beside them
    gets no drafts and keeps its seeded text."""
    phrase = prompts(3, seed=6)[2]  # 14 random ids, said three times: the model repeats them
    reqs = [request(phrase * 3 + tail, f"g{i}", max_new=30) for i, tail in enumerate(((5,), (6, 7), ()))]
    sampled = request(prompts(1, seed=7)[0], "s", max_new=10,  # shorter: the greedy ones set the steps
                      params=SamplingParams(temperature=0.8, seed=42))
    results: dict[int, list[list[int]]] = {}
    steps: dict[int, int] = {}
    for k in (0, 2):
        engine = make_engine(model, num_speculative_tokens=k)
        engine.start()
        try:
            results[k] = [ids for ids, _ in await asyncio.gather(*(collect(engine, r) for r in (*reqs, sampled)))]
            stats = engine.stats()
        finally:
            await engine.stop()
        steps[k] = stats.num_steps
        assert stats.num_generated_tokens == 3 * 30 + 10
        if k:
            assert stats.num_accepted_draft_tokens > 0
            assert stats.num_draft_tokens >= stats.num_accepted_draft_tokens
        else:
            assert stats.num_draft_tokens == 0
    assert results[2] == results[0]
    assert steps[2] < steps[0]
