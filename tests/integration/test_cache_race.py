"""A miss never waits for the cache: a suite whose cache answers every lookup only after
LOOKUP_DELAY_S (the cache's test setting ``lookup_delay_ms``), through the public gateway.
The generation starts while the lookup runs, so a miss's first token arrives before the lookup
could have answered; the answer is stored once the lookup says miss, and a hit that comes after
the first token (the same question again) is generated all the same and not stored twice."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from grpc import aio

from aiserve.store import ModelStore
from aiserve.v1 import cache_pb2, cache_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from suite.runner import Suite
from tests.integration.conftest import (
    auth,
    dev_key,
    eventually,
    ledger_rows,
    log_records,
    new_request_id,
    run_suite,
    suite_config,
)
from tests.integration.test_cache_e2e import logged, text_of
from tests.integration.test_e2e import TIMEOUT_S, chat_request

LOOKUP_DELAY_S = 3.0
"""Every lookup answers this late (the exact tier's too); under the gateway's 5 s lookup deadline."""


@pytest.fixture(scope="module")
def slow_cache_suite(tmp_path_factory: pytest.TempPathFactory, store: ModelStore) -> Iterator[Suite]:
    config = suite_config(tmp_path_factory.mktemp("aiserve-slow-cache"), store)
    config.extra_env["AISERVE_CACHE_LOOKUP_DELAY_MS"] = str(int(LOOKUP_DELAY_S * 1000))
    yield from run_suite(config)


async def timed_stream(suite: Suite, request: gateway_pb2.GenerateRequest,
                       request_id: str) -> tuple[list[gateway_pb2.GenerateResponse], float]:
    """The messages of a Generate call, and the seconds from sending it to its first text."""
    metadata = auth(dev_key(suite)) + (("x-request-id", request_id),)
    messages: list[gateway_pb2.GenerateResponse] = []
    first_text_s = 0.0
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        await channel.channel_ready()  # connecting is not the gateway's time
        sent = time.monotonic()
        async for message in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=TIMEOUT_S,
                                                                             metadata=metadata):
            if message.text_delta and not first_text_s:
                first_text_s = time.monotonic() - sent
            messages.append(message)
    return messages, first_text_s


async def cache_entries(suite: Suite) -> int:
    async with aio.insecure_channel(suite.config.address("cache")) as channel:
        info = await cache_pb2_grpc.CacheStub(channel).Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S)
    return int(info.entries)


def cache_calls(suite: Suite, request_id: str, method: str) -> list[str]:
    """The status codes of the cache's ``method`` calls for ``request_id``, from its log."""
    return [str(r.get("code")) for r in log_records(suite, "cache") if r.get("event") == "rpc"
            and r.get("request_id") == request_id and str(r.get("method", "")).endswith(f"/{method}")]


async def test_a_miss_streams_before_a_slow_lookup_answers_and_is_stored_once_it_does(
    slow_cache_suite: Suite,
) -> None:
    suite = slow_cache_suite
    question = chat_request("Why do cats purr?", 8)
    before = await cache_entries(suite)
    miss_id = new_request_id()
    miss, first_text_s = await timed_stream(suite, question, miss_id)
    usage = miss[-1].usage
    assert not usage.cache_hit and usage.cost_micros > 0 and text_of(miss)
    # The lookup could not have answered before LOOKUP_DELAY_S: the tokens did not wait for it.
    assert 0 < first_text_s < LOOKUP_DELAY_S and usage.ttft_ms < LOOKUP_DELAY_S * 1000
    # The stream ended once the lookup said miss and the answer was committed.
    assert await cache_entries(suite) == before + 1

    # The same question: the exact tier finds it, but only after the first token was sent.
    again_id = new_request_id()
    again, first_text_s = await timed_stream(suite, question, again_id)
    assert 0 < first_text_s < LOOKUP_DELAY_S
    assert not again[-1].usage.cache_hit and text_of(again) == text_of(miss)  # generated, and billed
    await eventually(lambda: logged(suite, "gateway", "cache_hit_after_first_token", again_id),
                     what="the gateway's line for the hit that came too late")
    assert await cache_entries(suite) == before + 1
    # The cache saw two lookups per request (the exact tier, then both), one Store kept, one dropped.
    assert [len(cache_calls(suite, rid, "Lookup")) for rid in (miss_id, again_id)] == [2, 1]
    assert cache_calls(suite, miss_id, "Store") == ["OK"]
    # (a cancelled Store ends as if half-closed before its finish: the cache keeps nothing)
    await eventually(lambda: len(cache_calls(suite, again_id, "Store")) == 1,
                     what="the cache's line for the store the late hit dropped")
    assert cache_calls(suite, again_id, "Store") != ["OK"]
    rows = {r.request_id: r for r in ledger_rows(suite.config.home)}
    assert not rows[miss_id].cache_hit and rows[miss_id].cost_micros == usage.cost_micros
    assert not rows[again_id].cache_hit and rows[again_id].cost_micros > 0
