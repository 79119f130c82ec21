"""Continuous batching in the real suite: exactness under concurrency, a server that answers and
admits while its batch is full, and cancellation that frees a sequence's KV while the batch runs
on (checked through Stats, counted in engine steps, never in wall-clock time). That the engine
drops a cancelled sequence within exactly one step is a unit test of the engine
(tests/unit/inference)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from suite.runner import Suite
from tests.integration.conftest import SUITE_MAX_NUM_SEQS, auth, dev_key
from tests.integration.test_e2e import TIMEOUT_S

NUM_CONCURRENT = 32
PROMPT = [1, 9690, 198, 19556, 30, 2, 198, 1, 520, 9531, 198]  # system 'Hello.', then the assistant's turn
RPC_S = 30.0  # deadline of each quick RPC (Stats, Health): generous, it is not what is measured
LONG_TOKENS = 1500
"""New tokens of each long generation: every sequence needs at least LONG_TOKENS / 3 steps (one
token and at most two confirmed drafts a step) to finish."""
STEP_BOUND = 100
"""Engine steps within which the server must answer, admit or drop a sequence while its batch
runs. Far above what a loaded 2-core machine needs (a step of the whole batch per round trip or
so), and far below the LONG_TOKENS / 3 = 500 steps after which the batch would have finished: a
server that waits for its batch fails."""


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


def long_request(max_new_tokens: int = LONG_TOKENS) -> inference_pb2.InferenceRequest:
    decoding = inference_pb2.Decoding(max_new_tokens=max_new_tokens, ignore_eos=True)
    return inference_pb2.InferenceRequest(prompt_token_ids=PROMPT, decoding=decoding)


async def stats(stub: inference_pb2_grpc.InferenceStub) -> inference_pb2.InferenceStats:
    return await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=RPC_S)


async def test_health_and_admission_answer_while_the_batch_is_full(suite: Suite) -> None:
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = [stub.Generate(long_request(), timeout=TIMEOUT_S) for _ in range(SUITE_MAX_NUM_SEQS)]
        extra = None
        try:
            await asyncio.gather(*(call.read() for call in calls))  # every slot holds a long generation
            full = await stats(stub)
            assert full.num_running == SUITE_MAX_NUM_SEQS
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            after = await stats(stub)
            assert after.num_running == SUITE_MAX_NUM_SEQS, "Health.Check waited for the batch to end"
            assert after.num_steps - full.num_steps < STEP_BOUND, "Health.Check waited for the batch"
            extra = stub.Generate(long_request(4), timeout=TIMEOUT_S)
            await extra.initial_metadata()  # the server has the call
            # Queued: no slot is free. Nothing tells a client that its call waits, so ask Stats
            # (each question is a round trip, no sleeps) and count the steps it took.
            while (after := await stats(stub)).num_waiting < 1:
                assert after.num_steps - full.num_steps < STEP_BOUND, "the new request was never queued"
            assert after.num_running == SUITE_MAX_NUM_SEQS
            assert after.num_steps - full.num_steps < STEP_BOUND, "admission waited for the batch"
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


async def test_cancelling_a_stream_frees_its_kv_while_the_batch_runs_on(suite: Suite) -> None:
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = await stub.Info(inference_pb2.InferenceInfoRequest(), timeout=RPC_S)
        kept, dropped = (stub.Generate(long_request(), timeout=TIMEOUT_S) for _ in range(2))
        try:
            await asyncio.gather(kept.read(), dropped.read())
            before = await stats(stub)
            assert before.num_running == 2
            dropped.cancel()
            # The server sees the cancel a round trip later, the engine drops the sequence at its
            # next step: ask Stats (a round trip each, no sleeps) and count the steps it took.
            while (after := await stats(stub)).num_running != 1:
                assert after.num_steps - before.num_steps < STEP_BOUND, "the cancelled sequence stayed in the batch"
            assert after.num_steps - before.num_steps < STEP_BOUND
            assert before.kv_used_bytes - after.kv_used_bytes == slot_bytes(suite, info)
            assert (await kept.read()).token_ids  # the other sequence goes on
        finally:
            kept.cancel()
            dropped.cancel()


async def test_the_kv_cache_is_sized_from_the_batch_in_the_chosen_precision(suite: Suite) -> None:
    """The suite sets dtype=float32 and max_num_seqs, not kv_cache_bytes: the cache holds every
    sequence in float32 (not half of them, as a byte budget chosen for bf16 would), plus the
    5% prefix store, and Info and Stats say which precision."""
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = await stub.Info(inference_pb2.InferenceInfoRequest(), timeout=RPC_S)
        s = await stats(stub)
    assert (info.dtype, info.precision.weights_dtype, info.precision.kv_dtype) == ("float32",) * 3
    assert s.precision == info.precision and info.precision.cpu_kind and info.precision.reason
    assert s.max_num_seqs == SUITE_MAX_NUM_SEQS
    slots = SUITE_MAX_NUM_SEQS * slot_bytes(suite, info)
    assert slots < s.kv_total_bytes <= slots / 0.95
