"""The pipeline against in-process fakes of its backend interfaces (no gRPC): cache hits,
generation, stop strings, truncation, admission, failures, and what reaches the cache."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace

import pytest

from aiserve.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from aiserve.common.finish import FinishReason
from services.gateway.domain import (
    CachedAnswer,
    Chunk,
    EngineLogprob,
    Final,
    GatewayRequest,
    GenerationEvent,
    TokenAlternative,
    TokenCountRequest,
    TokenLogprob,
)
from services.gateway.pipeline import Pipeline
from services.gateway.validation import LogprobsRequest, SamplingInput, resolve_sampling
from tests.unit.gateway.pipeline_fakes import CONFIG, MODEL, FakeRouter, Fakes

TIMEOUT_S = 30.0


def event(*ids: int, finish: FinishReason | None = None, **counters: int) -> GenerationEvent:
    return GenerationEvent(ids, finish, **counters)


def request(prompt: str = "say three words", *, stop: tuple[str, ...] = (), max_new_tokens: int = 8,
            **changes: object) -> GatewayRequest:
    sampling = resolve_sampling(SamplingInput(max_new_tokens=max_new_tokens, stop=stop), CONFIG)
    return replace(GatewayRequest("rid", prompt, None, sampling, tenant="acme", priority=10), **changes)  # type: ignore[arg-type]


async def run(pipeline: Pipeline, req: GatewayRequest, **kwargs: object) -> tuple[list[Chunk], Final]:
    chunks: list[Chunk] = []
    finals: list[Final] = []
    async with aclosing(pipeline.generate(req, TIMEOUT_S, **kwargs)) as items:  # type: ignore[arg-type]
        async for item in items:
            (chunks if isinstance(item, Chunk) else finals).append(item)  # type: ignore[arg-type]
    [final] = finals
    return chunks, final


THREE_TOKENS = [event(1), event(2), event(3, finish=FinishReason.LENGTH, queue_ms=5, compute_ms=40,
                                         kv_peak_bytes=4096)]


# --- tests ------------------------------------------------------------------------------------

async def test_a_cache_hit_is_sent_in_one_message_and_costs_nothing() -> None:
    fakes = Fakes()
    fakes.cache.answer = CachedAnswer((Chunk("Par", (7,)), Chunk("is", (8, 9))), 3, FinishReason.STOP, 0.93, "e-7")
    chunks, final = await run(fakes.pipeline(), request())
    assert chunks == [Chunk("Paris", (7, 8, 9))]  # the stored deltas joined: the text and every id, in order
    assert final.finish_reason == FinishReason.STOP
    usage = final.usage
    assert (usage.cache_hit, usage.completion_tokens, usage.prompt_tokens, usage.cost_micros) == (True, 3, 3, 0)
    assert (usage.cache_similarity, usage.cache_entry_id, usage.model) == (0.93, "e-7", MODEL)
    assert fakes.generations.opened == [] and fakes.cache.stores == []  # no model work, nothing stored


async def test_a_miss_is_generated_streamed_billed_and_stored_after_its_final() -> None:
    fakes = Fakes()
    fakes.generations.script = list(THREE_TOKENS)
    fakes.detokenizer.held = "!"
    pipeline = fakes.pipeline()
    items = []
    async with aclosing(pipeline.generate(request(), TIMEOUT_S)) as stream:
        async for item in stream:
            items.append(item)
            if isinstance(item, Final):  # the answer is kept only after the caller has the Final
                assert fakes.cache.stores[0].committed is None
    *chunks, final = items
    assert chunks == [Chunk("w1 ", (1,)), Chunk("w2 ", (2,)), Chunk("w3 ", (3,)), Chunk("!", ())]
    assert isinstance(final, Final) and final.finish_reason == FinishReason.LENGTH
    usage = final.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cache_hit) == (3, 3, False)
    assert (usage.queue_ms, usage.compute_ms, usage.kv_peak_bytes) == (5, 40, 4096)
    assert usage.cost_micros == 3 * 10 + 3 * 20 + 40  # tokens, plus 40 ms at 1000 micros/s
    [(sent, timeout_s, generation)] = fakes.generations.opened
    assert (sent.prompt_token_ids, sent.priority, sent.model, sent.request_id) == ((3, 5, 5), 10, MODEL, "rid")
    assert 0 < timeout_s <= TIMEOUT_S  # the client's deadline goes downstream
    assert generation.is_closed and not generation.is_cancelled and fakes.detokenizer.streams[0].is_closed
    [store] = fakes.cache.stores
    assert store.added == chunks and store.committed == FinishReason.LENGTH and not store.is_aborted
    assert store.key.scope.tenant == "acme" and store.key.prompt == "say three words"


async def test_a_stop_string_cuts_the_text_and_cancels_the_generation() -> None:
    fakes = Fakes()
    fakes.generations.script = [event(1), event(2), event(3), event(4, finish=FinishReason.LENGTH)]
    fakes.detokenizer.texts = {1: "Hello ", 2: "wor", 3: "ld. END more", 4: "never"}
    chunks, final = await run(fakes.pipeline(), request(stop=("END",)))
    assert "".join(c.text_delta for c in chunks) == "Hello world. "
    assert final.finish_reason == FinishReason.STOP and final.usage.completion_tokens == 3
    [(_, _, generation)] = fakes.generations.opened
    assert generation.is_cancelled  # closed before its last event: the engine drops the sequence
    assert fakes.detokenizer.streams[0].is_closed
    assert fakes.cache.stores[0].committed == FinishReason.STOP


async def test_a_long_prompt_is_refused_or_cut_from_the_left() -> None:
    fakes = Fakes(router=FakeRouter(context_length=12))  # 12 - 8 new tokens: room for 4
    long_prompt = "a bb ccc dddd eeeee ffffff"
    with pytest.raises(InvalidArgument, match="exceed the context length 12"):
        await run(fakes.pipeline(), request(long_prompt))
    assert fakes.generations.opened == [] and fakes.cache.lookups == []
    fakes.generations.script = list(THREE_TOKENS)
    _, final = await run(fakes.pipeline(), request(long_prompt, truncate_left=True))
    [(sent, _, _)] = fakes.generations.opened
    assert sent.prompt_token_ids == (3, 4, 5, 6) and final.usage.prompt_tokens == 4
    [(key, _)] = fakes.cache.lookups
    assert key.prompt.startswith("[truncated-left:4]") and key.query == ""  # its own key, never by meaning


async def test_an_answer_that_did_not_finish_normally_is_not_stored() -> None:
    fakes = Fakes()
    fakes.generations.script = [event(1), event(2, finish=FinishReason.CANCELLED)]  # e.g. the engine's deadline
    chunks, final = await run(fakes.pipeline(), request())
    assert final.finish_reason == FinishReason.CANCELLED and len(chunks) == 2
    [store] = fakes.cache.stores
    assert store.committed is None and store.is_aborted


async def test_admit_refuses_before_any_model_or_cache_work() -> None:
    fakes = Fakes()
    seen: list[tuple[int, str]] = []

    def admit(prompt_tokens: int, model: str) -> None:
        seen.append((prompt_tokens, model))
        raise ResourceExhausted("over the limit")

    with pytest.raises(ResourceExhausted):
        await run(fakes.pipeline(), request(), admit=admit)
    assert seen == [(3, MODEL)]
    assert fakes.cache.lookups == [] and fakes.generations.opened == [] and fakes.cache.stores == []


async def test_a_failed_generation_stores_nothing_and_rechecks_the_route() -> None:
    fakes = Fakes()
    fakes.generations.script = [event(1), Unavailable("inference unavailable: gone")]
    with pytest.raises(Unavailable):
        await run(fakes.pipeline(), request())
    [store] = fakes.cache.stores
    assert store.added == [Chunk("w1 ", (1,))] and store.committed is None and store.is_aborted
    assert fakes.router.forgotten == 1
    assert fakes.generations.opened[0][2].is_closed and fakes.detokenizer.streams[0].is_closed


async def test_a_caller_leaving_early_cancels_the_generation_and_stores_nothing() -> None:
    fakes = Fakes()
    fakes.generations.script = list(THREE_TOKENS)
    async with aclosing(fakes.pipeline().generate(request(), TIMEOUT_S)) as items:
        assert await anext(items) == Chunk("w1 ", (1,))
    [(_, _, generation)] = fakes.generations.opened
    assert generation.is_cancelled and fakes.detokenizer.streams[0].is_closed
    assert fakes.cache.stores[0].is_aborted and fakes.cache.stores[0].committed is None


@pytest.mark.parametrize(("changes", "looked_up", "stored"), [
    ({"cache_policy": "refresh"}, False, True),
    ({"cache_policy": "bypass"}, False, False),
    ({"personalized": True}, False, False),
], ids=["refresh", "bypass", "personalized"])
async def test_cache_policies(changes: dict[str, object], looked_up: bool, stored: bool) -> None:
    fakes = Fakes()
    fakes.cache.answer = CachedAnswer((Chunk("old", (9,)),), 1, FinishReason.STOP, 1.0, "e-1")
    fakes.generations.script = list(THREE_TOKENS)
    _, final = await run(fakes.pipeline(), request(**changes))  # type: ignore[arg-type]
    assert not final.usage.cache_hit
    assert (bool(fakes.cache.lookups), bool(fakes.cache.stores)) == (looked_up, stored)


async def test_a_sampled_request_above_the_cache_temperature_skips_the_cache() -> None:
    fakes = Fakes()
    fakes.generations.script = list(THREE_TOKENS)
    sampled = replace(request(), sampling=resolve_sampling(SamplingInput(temperature=0.7, max_new_tokens=8), CONFIG))
    await run(fakes.pipeline(), sampled)
    assert fakes.cache.lookups == [] and fakes.cache.stores == []


async def test_a_chats_last_user_message_is_its_semantic_query() -> None:
    fakes = Fakes()
    fakes.generations.script = list(THREE_TOKENS)
    chat = request(prompt=None, messages=(("system", "be brief"), ("user", "capital of France?")))  # type: ignore[arg-type]
    await run(fakes.pipeline(), chat)
    [(exact, _), (key, min_similarity)] = fakes.cache.lookups  # the exact tier (no query) first
    assert (exact.query, exact.prompt, exact.scope) == ("", key.prompt, key.scope)
    assert key.query == "capital of France?" and key.prompt == "system: be brief\nuser: capital of France?\n"
    assert len(key.scope.context) == 64 and min_similarity is None  # the earlier turns, as a sha256


async def test_count_tokens_and_cache_feedback_go_to_the_route_and_the_cache() -> None:
    fakes = Fakes()
    pipeline = fakes.pipeline()
    count = await pipeline.count_tokens(TokenCountRequest("two words", None))
    assert (count.token_count, count.context_length, count.model) == (1002, 64, MODEL)
    await pipeline.report_cache_feedback("e-1", True, 0.9)
    await pipeline.report_cache_feedback("", True, 0.0)  # not a cache hit's entry: nothing to report
    assert fakes.cache.feedback == [("e-1", True, 0.9)]


# --- model routes: the version that answered, held for the whole request ---------------------

async def test_a_request_runs_on_the_version_it_was_routed_to_and_names_it_everywhere() -> None:
    fakes = Fakes()
    fakes.router.version = "m@2"  # "m" routed by the weights to m@2
    fakes.generations.script = list(THREE_TOKENS)
    _, final = await run(fakes.pipeline(), request(model="m", session="conv-1"))
    assert fakes.router.routed == [("m", "acme", "conv-1")]  # tenant and session: the sticky keys
    assert fakes.tokenizer.models == ["m@2"] and fakes.detokenizer.models == ["m@2"]
    assert fakes.generations.opened[0][0].model == "m@2"
    assert fakes.cache.lookups[0][0].scope.model == "m@2" and fakes.cache.stores[0].key.scope.model == "m@2"
    assert final.usage.model == "m@2"
    assert fakes.router.released == ["m@2"]  # once, when it ended
    [outcome] = fakes.observer.outcomes
    assert (outcome.model, outcome.is_error, outcome.cache_hit, outcome.cost_micros) == (
        "m@2", False, False, final.usage.cost_micros)
    assert outcome.tpot_ms == (final.usage.total_ms - final.usage.ttft_ms) / 2
    assert fakes.observer.figures("m@2").requests == 1


async def test_a_failed_or_refused_request_releases_its_version_and_only_server_errors_count() -> None:
    fakes = Fakes()
    fakes.generations.script = [event(1), Unavailable("inference unavailable: gone")]
    with pytest.raises(Unavailable):
        await run(fakes.pipeline(), request())

    def refuse(prompt_tokens: int, model: str) -> None:
        raise ResourceExhausted("over the limit")

    with pytest.raises(ResourceExhausted):
        await run(fakes.pipeline(), request(), admit=refuse)
    fakes.router.version, fakes.router.refusal = "m@2", FailedPrecondition("tokenizer mismatch")
    with pytest.raises(FailedPrecondition):
        await run(fakes.pipeline(), request())  # its pairing check failed: the version's fault
    assert fakes.router.released == [MODEL, MODEL, "m@2"]
    assert [(o.model, o.is_error) for o in fakes.observer.outcomes] == [(MODEL, True), ("m@2", True)]
    # (the limit was the client's: not observed)


async def test_a_caller_leaving_early_releases_its_version_and_is_not_observed() -> None:
    fakes = Fakes()
    fakes.generations.script = list(THREE_TOKENS)
    async with aclosing(fakes.pipeline().generate(request(), TIMEOUT_S)) as items:
        await anext(items)
    assert fakes.router.released == [MODEL] and fakes.observer.outcomes == []
    await fakes.pipeline().count_tokens(TokenCountRequest("two words", None))
    assert fakes.router.released == [MODEL, MODEL]


async def test_logprobs_carry_each_tokens_bytes_and_skip_the_cache() -> None:
    fakes = Fakes()
    fakes.cache.answer = CachedAnswer((Chunk("cached", (7,)),), 1, FinishReason.STOP, 1.0, "e-1")  # never used
    fakes.generations.script = [
        GenerationEvent((5,), None, logprobs=(EngineLogprob(-0.5, ((5, -0.5), (6, -1.5))),)),
        GenerationEvent((6, 9), FinishReason.LENGTH, logprobs=(EngineLogprob(-0.25, ((6, -0.25),)),
                                                                EngineLogprob(-2.0, ()))),
    ]
    chunks, final = await run(fakes.pipeline(), request(logprobs=LogprobsRequest(top=2)))
    assert [lp for c in chunks for lp in c.logprobs] == [
        TokenLogprob(5, b"<5>", -0.5, (TokenAlternative(5, b"<5>", -0.5), TokenAlternative(6, b"<6>", -1.5))),
        TokenLogprob(6, b"<6>", -0.25, (TokenAlternative(6, b"<6>", -0.25),)),
        TokenLogprob(9, b"<9>", -2.0, ()),
    ]
    assert not final.usage.cache_hit
    assert fakes.cache.lookups == [] and fakes.cache.stores == []  # a cached answer has no logprobs to replay
    [(sent, _, _)] = fakes.generations.opened
    assert sent.logprobs == LogprobsRequest(top=2)
