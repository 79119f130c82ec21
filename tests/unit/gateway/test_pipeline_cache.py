"""The cache lookup races the generation (services/gateway/cache_lookup.py, docs/decisions.md
decision 52), against in-process fakes: the exact tier before any model work, a miss's tokens
never held for the lookup, a hit before the first token cancelling the generation, a late hit,
a failed lookup, and what is kept in the cache."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace

import pytest

from aiserve.common.errors import Unavailable
from aiserve.common.finish import FinishReason
from services.gateway.domain import CachedAnswer, Chunk, Final, GatewayRequest
from tests.unit.gateway.pipeline_fakes import CONFIG, Fakes
from tests.unit.gateway.test_pipeline import THREE_TOKENS, TIMEOUT_S, request, run

CACHED = CachedAnswer((Chunk("Par", (7,)), Chunk("is", (8, 9))), 3, FinishReason.STOP, 0.93, "e-7")
GENERATED = [Chunk("w1 ", (1,)), Chunk("w2 ", (2,)), Chunk("w3 ", (3,))]


def chat(question: str = "capital of France?") -> GatewayRequest:
    """A chat: its last user message is looked up by meaning too."""
    return request(prompt=None, messages=(("user", question),))  # type: ignore[arg-type]


def assert_hit(chunks: list[Chunk], final: Final) -> None:
    """The cached answer, in one message, billed nothing."""
    assert chunks == [Chunk("Paris", (7, 8, 9))]
    assert (final.usage.cache_hit, final.usage.cost_micros, final.usage.completion_tokens) == (True, 0, 3)


async def test_an_exact_hit_answers_before_any_generation_starts() -> None:
    fakes = Fakes()
    fakes.cache.answer = CACHED
    chunks, final = await run(fakes.pipeline(), chat())
    assert_hit(chunks, final)
    [(key, _)] = fakes.cache.lookups  # the exact tier only: no embedding was asked for
    assert key.query == ""
    assert fakes.generations.opened == [] and fakes.cache.stores == []
    assert fakes.lookup_outcomes == ["hit"]


async def test_a_hit_by_meaning_found_while_waiting_for_the_exact_tier_starts_no_generation() -> None:
    fakes = Fakes()
    fakes.cache.by_meaning = CACHED  # answers at once (the query's vector was remembered)
    chunks, final = await run(fakes.pipeline(), chat())
    assert_hit(chunks, final)
    assert len(fakes.cache.lookups) == 2 and fakes.generations.opened == []
    assert fakes.lookup_outcomes == ["hit"]


async def test_a_miss_streams_every_token_and_its_final_while_the_lookup_still_runs() -> None:
    fakes = Fakes()
    fakes.cache.held = asyncio.Event()  # the lookup by meaning answers only when the test says
    fakes.generations.script = list(THREE_TOKENS)
    items: list[Chunk | Final] = []
    async with asyncio.timeout(TIMEOUT_S), aclosing(fakes.pipeline().generate(chat(), TIMEOUT_S)) as stream:
        async for item in stream:
            items.append(item)
            if isinstance(item, Final):
                break
        # The whole answer reached the caller, and the lookup by meaning has not answered yet.
        assert items[:-1] == GENERATED and not items[-1].usage.cache_hit  # type: ignore[union-attr]
        [_, (asked, _)] = fakes.cache.lookups
        assert asked.query == "capital of France?" and not fakes.cache.held.is_set()
        [store] = fakes.cache.stores
        assert store.added == GENERATED and store.committed is None  # kept only once the lookup says miss
        fakes.cache.held.set()
        assert [item async for item in stream] == []
    assert store.committed == FinishReason.LENGTH and not store.is_aborted
    assert fakes.lookup_outcomes == ["miss"]


async def test_a_hit_by_meaning_before_the_first_token_cancels_the_generation() -> None:
    fakes = Fakes()
    fakes.cache.by_meaning = CACHED
    fakes.cache.held = fakes.generations.reading  # the lookup answers once the generation has started
    fakes.generations.held = asyncio.Event()  # and its prefill never ends: the lookup answers first
    fakes.generations.script = list(THREE_TOKENS)
    chunks, final = await asyncio.wait_for(run(fakes.pipeline(), chat()), TIMEOUT_S)
    assert_hit(chunks, final)
    assert final.usage.compute_ms == 0 and final.usage.cache_similarity == 0.93
    [(sent, _, generation)] = fakes.generations.opened  # started while the lookup ran ...
    assert sent.request_id == "rid"
    assert generation.reading.is_set() and generation.is_cancelled  # ... and cancelled, nothing read
    assert fakes.detokenizer.streams[0].is_closed
    assert fakes.cache.stores == []  # nothing generated, nothing stored
    assert fakes.lookup_outcomes == ["hit_cancelled"]
    assert fakes.router.released == ["m@1"] and fakes.router.forgotten == 0


async def test_a_hit_after_the_first_token_comes_too_late_and_keeps_the_answer_out_of_the_cache() -> None:
    fakes = Fakes()
    fakes.cache.by_meaning, fakes.cache.held = CACHED, asyncio.Event()
    fakes.generations.script = list(THREE_TOKENS)
    async with asyncio.timeout(TIMEOUT_S), aclosing(fakes.pipeline().generate(chat(), TIMEOUT_S)) as stream:
        first = await anext(stream)
        assert first == GENERATED[0]
        fakes.cache.held.set()  # the hit arrives now: the answer is already streaming
        rest = [item async for item in stream]
    assert rest[:-1] == GENERATED[1:]
    final = rest[-1]
    assert isinstance(final, Final) and not final.usage.cache_hit and final.usage.cost_micros > 0
    assert not fakes.generations.opened[0][2].is_cancelled
    [store] = fakes.cache.stores
    assert store.is_aborted and store.committed is None  # the cache answers this question already
    assert fakes.lookup_outcomes == ["late_hit"]


@pytest.mark.parametrize("error", [Unavailable("cache unavailable"), RuntimeError("a bug in the adapter")])
async def test_a_failed_lookup_is_a_miss(error: Exception) -> None:
    fakes = Fakes()
    fakes.cache.error = error
    fakes.generations.script = list(THREE_TOKENS)
    chunks, final = await run(fakes.pipeline(), chat())
    assert chunks == GENERATED and not final.usage.cache_hit
    assert fakes.cache.stores[0].committed == FinishReason.LENGTH
    assert fakes.lookup_outcomes == ["miss"]


async def test_a_slow_exact_tier_does_not_hold_the_generation_and_still_wins_before_the_first_token() -> None:
    fakes = Fakes()
    fakes.cache.answer, fakes.cache.exact_held = CACHED, asyncio.Event()
    fakes.generations.held = asyncio.Event()
    fakes.generations.script = list(THREE_TOKENS)
    pipeline = fakes.pipeline(replace(CONFIG, cache_exact_wait_ms=1.0))
    answer = asyncio.create_task(run(pipeline, chat()))
    await asyncio.wait_for(fakes.generations.reading.wait(), TIMEOUT_S)  # the wait for the exact tier ran out
    [(key, _)] = fakes.cache.lookups
    assert key.query == ""
    fakes.cache.exact_held.set()
    chunks, final = await asyncio.wait_for(answer, TIMEOUT_S)
    assert_hit(chunks, final)
    assert fakes.generations.opened[0][2].is_cancelled
    assert fakes.lookup_outcomes == ["hit_cancelled"]


@pytest.mark.parametrize("cached", [CACHED, None], ids=["hit", "miss"])
async def test_a_generation_that_fails_before_its_first_token_waits_for_the_lookup(
    cached: CachedAnswer | None,
) -> None:
    fakes = Fakes()
    fakes.generations.failed = asyncio.Event()
    fakes.cache.by_meaning, fakes.cache.held = cached, fakes.generations.failed  # answers after the failure
    fakes.generations.script = [Unavailable("inference unavailable: gone")]
    if cached is None:
        with pytest.raises(Unavailable):
            await asyncio.wait_for(run(fakes.pipeline(), chat()), TIMEOUT_S)
        assert fakes.router.forgotten == 1 and fakes.lookup_outcomes == ["miss"]
        return
    chunks, final = await asyncio.wait_for(run(fakes.pipeline(), chat()), TIMEOUT_S)
    assert_hit(chunks, final)  # the cache still answers
    assert fakes.lookup_outcomes == ["hit_cancelled"]


async def test_a_caller_leaving_stops_the_lookup_and_keeps_nothing() -> None:
    fakes = Fakes()
    fakes.cache.held = asyncio.Event()
    fakes.generations.script = list(THREE_TOKENS)
    async with asyncio.timeout(TIMEOUT_S), aclosing(fakes.pipeline().generate(chat(), TIMEOUT_S)) as stream:
        assert await anext(stream) == GENERATED[0]
    await asyncio.wait_for(fakes.cache.cancelled.wait(), TIMEOUT_S)  # the lookup by meaning is stopped
    assert fakes.cache.stores[0].is_aborted and fakes.generations.opened[0][2].is_cancelled
    assert fakes.lookup_outcomes == []  # it never ended: no outcome


async def test_a_caller_leaving_after_the_final_does_not_lose_the_answer() -> None:
    fakes = Fakes()
    fakes.cache.held = asyncio.Event()
    fakes.generations.script = list(THREE_TOKENS)
    got_final = asyncio.Event()

    async def servicer() -> None:  # as the gateway's servicer: asks for more right after the Final
        async with aclosing(fakes.pipeline().generate(chat(), TIMEOUT_S)) as stream:
            async for item in stream:
                if isinstance(item, Final):
                    got_final.set()

    serving = asyncio.create_task(servicer())
    await asyncio.wait_for(got_final.wait(), TIMEOUT_S)  # the servicer is in the commit, waiting for the lookup
    serving.cancel()  # the client hangs up
    await asyncio.wait((serving,))
    [store] = fakes.cache.stores
    assert store.committed is None and not store.is_aborted
    fakes.cache.held.set()  # the lookup answers a miss: the answer is kept all the same
    await asyncio.wait_for(store.ended.wait(), TIMEOUT_S)
    assert store.committed == FinishReason.LENGTH and fakes.lookup_outcomes == ["miss"]


async def test_a_raw_prompt_asks_the_exact_tier_only_and_refresh_asks_nothing() -> None:
    fakes = Fakes()
    fakes.generations.script = list(THREE_TOKENS)
    await run(fakes.pipeline(), request())
    [(key, _)] = fakes.cache.lookups
    assert key.query == "" and fakes.lookup_outcomes == ["miss"]
    fakes.generations.script = list(THREE_TOKENS)
    await run(fakes.pipeline(), replace(chat(), cache_policy="refresh"))
    assert len(fakes.cache.lookups) == 1 and fakes.cache.stores[-1].committed == FinishReason.LENGTH


def test_the_response_format_scopes_the_cache_key() -> None:
    from services.gateway.pipeline import _params_key  # noqa: PLC0415
    from services.gateway.validation import ResponseFormat  # noqa: PLC0415

    free = request()
    as_json = replace(free, response_format=ResponseFormat())
    with_schema = replace(free, response_format=ResponseFormat(schema='{"type":"object"}'))
    keys = {_params_key(free), _params_key(as_json), _params_key(with_schema)}
    assert len(keys) == 3 and _params_key(free) == free.sampling.cache_key()
