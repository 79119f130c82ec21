"""A request's life in the batching engine on the real model (float32), one sequence at a time:
exactness against Hugging Face, stop conditions, queueing, priority, cancellation, validation.
(Carried over from the interim one-at-a-time engine; batching itself: test_batch_engine.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from aiserve.common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from aiserve.model_facts import read_model_facts
from services.inference.batch_engine import BatchEngine
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.engine_stats import EngineStats
from services.inference.llama import LlamaModel
from services.inference.request import GenerateRequest, TokenEvent
from tests.unit.inference.engine_probes import Events, StepGate, clock_past

LONG = 400  # more tokens than any test waits for: such a request runs until cancelled
MAX_SEQ_LEN = 512
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def loaded(model_dir: Path, two_torch_threads: None) -> LlamaModel:
    return LlamaModel.load(model_dir, "cpu", torch.float32)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture
async def engine(loaded: LlamaModel, model_dir: Path) -> AsyncIterator[BatchEngine]:
    # one slot and no preemption: the one-at-a-time behaviour these tests pin down
    config = SchedulerConfig(max_num_seqs=1, max_queue=2, enable_preemption=False)
    kv = KVCacheConfig(kv_cache_bytes=32 << 20, max_seq_len=MAX_SEQ_LEN)
    engine = BatchEngine(loaded, read_model_facts(model_dir).eos_token_ids, EngineConfig(LONG, config, kv))
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def make_request(request_id: str, prompt: tuple[int, ...], max_new_tokens: int,
            **fields: Any) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                           max_new_tokens=max_new_tokens, **fields)


def chat(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(tokenizer.encode(rendered).ids)


async def collect(engine: BatchEngine, request: GenerateRequest) -> list[TokenEvent]:
    return [event async for event in engine.generate(request)]


def test_weights_live_in_ordinary_memory(loaded: LlamaModel, model_dir: Path) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    assert str((model_dir / "model.safetensors").resolve()) not in maps.read_text()
    assert read_model_facts(model_dir).eos_token_ids == frozenset({2})  # <|im_end|>, from config and tokenizer
    assert (loaded.config.max_position_embeddings, loaded.config.vocab_size) == (8192, 49152)


async def test_greedy_matches_transformers_generate(
    engine: BatchEngine, tokenizer: Tokenizer, model_dir: Path
) -> None:
    prompt = chat(tokenizer, "Write a long story about a dragon.")
    events = await collect(engine, make_request("g", prompt, max_new_tokens=24))
    ids = [i for e in events for i in e.token_ids]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    with torch.inference_mode():
        expected = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=24
        )[0, len(prompt):].tolist()
    assert ids == expected
    assert all(len(e.token_ids) == 1 for e in events)  # one event per token
    last = events[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
        "length", len(prompt), 24)
    assert last.compute_ms > 0 and last.queue_ms >= 0


async def test_max_new_tokens_finishes_with_length(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    events = await collect(engine, make_request("l", chat(tokenizer, "Hi"), max_new_tokens=3))
    assert [e.finish_reason for e in events] == [None, None, "length"]


async def test_eos_finishes_with_stop(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    prompt = chat(tokenizer, "What is 2+2? Answer with a number only.")
    events = await collect(engine, make_request("e", prompt, max_new_tokens=32))
    assert events[-1].finish_reason == "stop"
    assert events[-1].token_ids[0] in engine.eos_ids
    # ignore_eos generates past the EOS id to max_new_tokens.
    past_eos = make_request("i", prompt, max_new_tokens=len(events) + 2, ignore_eos=True)
    assert (await collect(engine, past_eos))[-1].finish_reason == "length"


async def test_stop_token_ids_finish_with_stop(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    prompt = chat(tokenizer, "Write a long story about a dragon.")
    first_two = [e.token_ids[0] for e in await collect(engine, make_request("a", prompt, 2))]
    stop_at = make_request("s", prompt, max_new_tokens=20, stop_token_ids=frozenset(first_two[1:]))
    events = await collect(engine, stop_at)
    assert [e.token_ids[0] for e in events] == first_two
    assert events[-1].finish_reason == "stop"


async def idle_before_long_ends(engine: BatchEngine, before: EngineStats) -> None:
    """The engine went idle having made fewer than LONG tokens since ``before``: the long
    request left early (cancelled), it did not simply run to its end."""
    assert await engine.wait_idle(timeout_s=TIMEOUT_S)
    assert engine.stats().num_generated_tokens - before.num_generated_tokens < LONG


async def test_closing_the_stream_frees_the_request(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    before = engine.stats()
    stream = engine.generate(make_request("c", chat(tokenizer, "Count to a million."), LONG))
    for _ in range(3):
        await anext(stream)
    assert engine.stats().num_running == 1
    await stream.aclose()
    await idle_before_long_ends(engine, before)
    assert engine.stats().num_running == 0


async def test_cancelling_the_consumer_task_frees_the_request(
    engine: BatchEngine, tokenizer: Tokenizer
) -> None:
    before = engine.stats()
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(make_request("t", chat(tokenizer, "Go on."), LONG)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=TIMEOUT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await idle_before_long_ends(engine, before)


async def start_long(engine: BatchEngine, tokenizer: Tokenizer) -> AsyncGenerator[TokenEvent, None]:
    """A request that occupies the model until its stream is closed."""
    stream = engine.generate(make_request("busy", chat(tokenizer, "Tell me everything."), LONG))
    await anext(stream)  # it is running now
    return stream


async def test_deadline_passing_in_the_queue_fails_and_never_runs(
    engine: BatchEngine, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = await start_long(engine, tokenizer)
    gate = StepGate(engine, monkeypatch)
    try:
        await gate.entered()  # the worker is inside a step of the busy request, which holds the only slot
        deadline = time.monotonic() + 0.05
        late = Events()
        engine.submit(make_request("late", (1, 2, 3), 4, deadline=deadline), late)
        await clock_past(deadline)  # passed while it waited
        gate.release()
        assert isinstance(await late.last(), DeadlineExceeded)
        assert len(late.items) == 1  # no token before the error: it never ran
        assert engine.stats().num_waiting == 0  # it left the queue
        with pytest.raises(DeadlineExceeded):  # already past when submitted
            await collect(engine, make_request("past", (1,), 1, deadline=time.monotonic()))
    finally:
        gate.release()
        await busy.aclose()


async def test_full_queue_is_resource_exhausted(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    busy = await start_long(engine, tokenizer)
    cancels = [engine.submit(make_request(f"q{i}", (1, 2), 1), Events()) for i in range(2)]
    try:
        assert engine.stats().num_waiting == 2  # max_queue
        with pytest.raises(ResourceExhausted, match="max_queue"):
            await collect(engine, make_request("over", (1, 2), 1))
    finally:
        for cancel in cancels:
            cancel()
        await busy.aclose()
    assert await engine.wait_idle(timeout_s=TIMEOUT_S)


async def test_higher_priority_runs_first(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    busy = await start_long(engine, tokenizer)
    order: list[str] = []

    def record_finish(name: str) -> Callable[[object], None]:
        return lambda _: order.append(name)

    done = {name: Events() for name in ("normal", "urgent")}
    for name, priority in (("normal", 0), ("urgent", 5)):
        engine.submit(make_request(name, (1, 2), 1, priority=priority), done[name])
        done[name].done.add_done_callback(record_finish(name))
    assert engine.stats().num_waiting == 2  # both are queued behind the busy request
    await busy.aclose()
    await done["normal"].last()
    await done["urgent"].last()
    assert order == ["urgent", "normal"]


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "field"),
    [
        ((), 4, "prompt_token_ids: must hold at least 1"),
        ((1, 49152), 4, "outside the vocabulary 0..49151"),
        ((1, -1), 4, "outside the vocabulary"),
        ((1,) * 510, 4, f"exceeds max_seq_len {MAX_SEQ_LEN}"),
        ((1,), 0, "max_new_tokens: must be 1.."),
    ],
)
async def test_invalid_requests_name_field_and_limit(
    engine: BatchEngine, prompt: tuple[int, ...], max_new_tokens: int, field: str
) -> None:
    with pytest.raises(InvalidArgument, match=field):
        await collect(engine, make_request("bad", prompt, max_new_tokens))

