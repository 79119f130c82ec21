"""Continuous batching in the real suite: exactness under concurrency, a responsive event loop
with a full batch, and cancellation that frees KV within a step (checked through Stats)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.suite import Suite
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.integration.conftest import SUITE_MAX_NUM_SEQS, auth, dev_key
from tests.integration.test_e2e import TIMEOUT_S

NUM_CONCURRENT = 32
PROMPT = [1, 9690, 198, 19556, 30, 2, 198, 1, 520, 9531, 198]  # system 'Hello.', then the assistant's turn
RPC_S = 10.0  # deadline of each quick RPC (Stats, Health)


def greedy_request(i: int) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_new_tokens=12, temperature=0.0),
        cache=gateway_pb2.CACHE_POLICY_BYPASS,
    )
    request.chat.messages.add(role="user", content=f"Tell me fact number {i} about the moon.")
    return request


async def token_ids(channel: aio.Channel, key: str, request: gateway_pb2.GenerateRequest) -> list[int]:
    call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=auth(key), timeout=TIMEOUT_S)
    return [i async for message in call for i in message.token_ids]


async def test_concurrent_greedy_requests_match_each_alone(suite: Suite) -> None:
    key = dev_key(suite)
    requests = [greedy_request(i) for i in range(NUM_CONCURRENT)]
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        together = await asyncio.gather(*(token_ids(channel, key, r) for r in requests))
        for request, ids in zip(requests, together, strict=True):
            assert ids and ids == await token_ids(channel, key, request)
    assert len({tuple(ids) for ids in together}) > 1  # different prompts, different answers


def long_request(max_new_tokens: int = 1500) -> inference_pb2.InferenceRequest:
    decoding = inference_pb2.Decoding(max_new_tokens=max_new_tokens, ignore_eos=True)
    return inference_pb2.InferenceRequest(prompt_token_ids=PROMPT, decoding=decoding)


async def stats(stub: inference_pb2_grpc.InferenceStub) -> inference_pb2.InferenceStats:
    return await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=RPC_S)


async def test_health_and_admission_answer_fast_with_a_full_batch(suite: Suite) -> None:
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = [stub.Generate(long_request(), timeout=TIMEOUT_S) for _ in range(SUITE_MAX_NUM_SEQS)]
        extra = None
        try:
            await asyncio.gather(*(call.read() for call in calls))  # every slot holds a long generation
            assert (await stats(stub)).num_running == SUITE_MAX_NUM_SEQS
            started = time.monotonic()
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_S)
            health_ms = (time.monotonic() - started) * 1000
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert health_ms < 100, f"Health.Check took {health_ms:.0f} ms with a full batch"
            started = time.monotonic()
            extra = stub.Generate(long_request(4), timeout=TIMEOUT_S)
            while (await stats(stub)).num_waiting < 1:  # accepted and queued: no slot is free
                assert time.monotonic() - started < RPC_S, "the new request was never queued"
            admit_ms = (time.monotonic() - started) * 1000
            assert admit_ms < 100, f"admission took {admit_ms:.0f} ms with a full batch"
        finally:
            for call in [*calls, extra]:
                if call is not None:
                    call.cancel()


def slot_bytes(suite: Suite, info: inference_pb2.InferenceInfo) -> int:
    """Bytes of one KV slot: context_length (the slot) x K and V of every layer, float32."""
    config = json.loads((Path(suite.config.extra_env["AISERVE_MODEL_STORE"]).glob(
        "*/*/config.json").__next__()).read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return info.context_length * per_token


async def test_cancelling_a_stream_frees_its_kv_within_a_step(suite: Suite) -> None:
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = await stub.Info(inference_pb2.InferenceInfoRequest(), timeout=RPC_S)
        kept, dropped = (stub.Generate(long_request(), timeout=TIMEOUT_S) for _ in range(2))
        try:
            await asyncio.gather(kept.read(), dropped.read())
            before = await stats(stub)
            assert before.num_running == 2
            dropped.cancel()
            after = await stats(stub)
            while after.num_running != 1:  # the server sees the cancel, then the engine's next step drops it
                assert after.num_steps - before.num_steps <= 3, "the cancelled sequence stayed in the batch"
                after = await stats(stub)
            assert after.num_steps - before.num_steps <= 3  # one step in flight, the next one frees it
            assert before.kv_used_bytes - after.kv_used_bytes == slot_bytes(suite, info)
            assert (await kept.read()).token_ids  # the other sequence goes on
        finally:
            kept.cancel()
            dropped.cancel()
