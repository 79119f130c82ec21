"""The engine as a client sees it: a suite of the four services, called through the gateway (text
in) or straight at the inference service (ids in), on an arrival schedule."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpc import aio

from aiserve.store import ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from bench.measure import Timing, consume, run_schedule
from bench.workload import Arrival
from suite.runner import Suite, SuiteConfig

TIMEOUT_S = 900


def seed_of(text: str) -> int:
    """The seed of a sampled request: the same for the same prompt on every door."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


class Served:
    """Calls the running suite: through the gateway (text in, past the cache; greedy unless
    ``temperature``, then seeded per prompt) or straight to inference (ids in, greedy)."""

    def __init__(self, suite: Suite, key: str, temperature: float = 0.0) -> None:
        self.suite, self.key, self.temperature = suite, key, temperature

    async def one(self, a: Arrival, via: str, channel: aio.Channel) -> Timing:
        started = time.perf_counter()
        if via == "gateway":
            sampling = common_pb2.SamplingParams(max_new_tokens=a.max_new, temperature=self.temperature)
            if self.temperature:
                sampling.seed = seed_of(a.text)
            request = gateway_pb2.GenerateRequest(sampling=sampling, cache=gateway_pb2.CACHE_POLICY_BYPASS)
            request.chat.messages.add(role="user", content=a.text)
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, timeout=TIMEOUT_S, metadata=(("authorization", f"Bearer {self.key}"),))
            return await consume(call, started, lambda m: len(m.token_ids))
        decoding = inference_pb2.Decoding(max_new_tokens=a.max_new)
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.InferenceRequest(prompt_token_ids=a.prompt_ids, decoding=decoding), timeout=TIMEOUT_S)
        return await consume(call, started, lambda m: len(m.token_ids))

    async def run(self, work: Sequence[Arrival], via: str, concurrency: int | None = None) -> dict[str, Any]:
        async with aio.insecure_channel(self.suite.config.address(via)) as channel:
            return await run_schedule(work, concurrency or len(work), lambda a: self.one(a, via, channel))


async def start_suite(home: Path, store: ModelStore, env: dict[str, str] | None = None,
                      replicas: int = 1) -> Suite:
    """The four services on free ports under ``home``, over ``store``, with settings ``env``
    and ``replicas`` inference instances (the cores split between them)."""
    config = SuiteConfig.for_tests(home, inference_replicas=replicas)
    config.extra_env.update({"AISERVE_MODEL_STORE": str(store.root), **(env or {})})
    suite = Suite(config)
    try:
        await suite.start(timeout_s=300)
    except BaseException:
        suite.stop()
        raise
    return suite


async def speculation_stats(suite: Suite) -> dict[str, Any]:
    """Drafted and confirmed tokens since the inference service started (its Stats RPC)."""
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        s = await inference_pb2_grpc.InferenceStub(channel).Stats(inference_pb2.InferenceStatsRequest(), timeout=30)
    return {"draft_tokens": s.num_draft_tokens, "accepted_draft_tokens": s.num_accepted_draft_tokens,
            "generated_tokens": s.num_generated_tokens, "steps": s.num_steps}


def speculation_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What speculative decoding did between two ``speculation_stats``: the counts, the share
    of drafts confirmed (``acceptance``) and the share of generated tokens that were confirmed
    drafts (``confirmed_share``: tokens that took no step of their own)."""
    delta = {name: after[name] - before[name] for name in after}
    return {**delta, "acceptance": delta["accepted_draft_tokens"] / max(delta["draft_tokens"], 1),
            "confirmed_share": delta["accepted_draft_tokens"] / max(delta["generated_tokens"], 1)}
