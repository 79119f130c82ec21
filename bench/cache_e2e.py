"""The cache through the gateway, end to end, as ``bench/cache_bench.py`` runs it: the four real
services (default settings), one request at a time over one client channel, timed at the client
from sending to the first text and to the last message.

- misses (generated), then their paraphrases (hits by meaning), then the same questions again
  (exact hits);
- a miss's time to first token with the cache on against the same prompt with the cache
  bypassed (CACHE_POLICY_BYPASS), in pairs, each side first in every other pair (the engine's
  prefix store makes the second of a pair a little faster);
- the exact tier's round trip as the gateway pays it before a generation starts: a Lookup
  without a query, straight to the cache service.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpc import aio

from aiserve.common.paths import model_store_path
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc
from bench.measure import percentiles
from services.cache.calibrate import ScoredPair
from suite.runner import Suite, SuiteConfig

TARGETS_MS = {"exact_hit": 15.0, "semantic_hit": 40.0}
"""p50 end to end at the client."""
USE, BYPASS = gateway_pb2.CACHE_POLICY_USE, gateway_pb2.CACHE_POLICY_BYPASS
TIMEOUT_S = 300.0


async def _timed(stub: gateway_pb2_grpc.GatewayStub, key: str, question: str, max_new_tokens: int,
                 cache: int = USE) -> dict[str, Any]:
    request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
                                          cache=cache)  # type: ignore[arg-type]
    request.chat.messages.add(role="user", content=question)
    started, first, last = time.perf_counter(), 0.0, None
    async for message in stub.Generate(request, timeout=TIMEOUT_S, metadata=(("authorization", f"Bearer {key}"),)):
        if message.text_delta and not first:
            first = time.perf_counter()
        last = message
    assert last is not None
    return {"total_ms": (time.perf_counter() - started) * 1000, "ttft_ms": (first - started) * 1000,
            "cache_hit": last.usage.cache_hit, "similarity": last.usage.cache_similarity,
            "tokens": last.usage.completion_tokens}


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"total": percentiles([r["total_ms"] for r in rows]), "ttft": percentiles([r["ttft_ms"] for r in rows]),
            "hits": sum(r["cache_hit"] for r in rows), "requests": len(rows),
            "similarity": [round(r["similarity"], 3) for r in rows]}


async def _miss_pairs(stub: gateway_pb2_grpc.GatewayStub, key: str, prompts: Sequence[str],
                      max_new_tokens: int) -> dict[str, Any]:
    """Each prompt with the cache on (a miss: nothing like it is stored) and bypassed, in turn."""
    on: list[float] = []
    off: list[float] = []
    hits = 0
    for i, prompt in enumerate(prompts):
        sides = [USE, BYPASS] if i % 2 == 0 else [BYPASS, USE]
        rows = {side: await _timed(stub, key, prompt, max_new_tokens, side) for side in sides}
        if rows[USE]["cache_hit"]:  # something stored answered it: not a miss
            hits += 1
            continue
        on.append(rows[USE]["ttft_ms"])
        off.append(rows[BYPASS]["ttft_ms"])
    with_cache, bypassed = percentiles(on), percentiles(off)
    return {"with_cache": with_cache, "bypassed": bypassed, "pairs": len(on), "hits_left_out": hits,
            "max_new_tokens": max_new_tokens,
            "difference_p50_ms": round(with_cache["p50_ms"] - bypassed["p50_ms"], 2),
            "difference_mean_ms": round(with_cache["mean_ms"] - bypassed["mean_ms"], 2),
            "paired_difference_median_ms": round(statistics.median(a - b for a, b in zip(on, off, strict=True)), 2)}


async def _exact_round_trips(address: str, count: int) -> dict[str, float]:
    """Lookups without a query (the exact tier only, a miss), straight to the cache service."""
    scope = cache_pb2.CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="bench", params="greedy")
    times: list[float] = []
    async with aio.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        for i in range(count + 5):
            started = time.perf_counter()
            await stub.Lookup(cache_pb2.LookupRequest(scope=scope, prompt=f"<user>not stored {i}"), timeout=TIMEOUT_S)
            if i >= 5:  # the first few warm the channel
                times.append((time.perf_counter() - started) * 1000)
    return percentiles(times)


async def _run(suite: Suite, pairs: Sequence[ScoredPair], miss_prompts: Sequence[str], max_new_tokens: int,
               miss_tokens: int) -> dict[str, Any]:
    key = suite.dev_key_path.read_text().strip()
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        await channel.channel_ready()  # one channel for the run, as a client keeps its connection
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(2):  # a miss, then an exact hit: both paths warm
            await _timed(stub, key, "Warm-up: say hello.", max_new_tokens)
        misses = [await _timed(stub, key, p.a, max_new_tokens) for p in pairs]
        semantic = [await _timed(stub, key, p.b, max_new_tokens) for p in pairs]
        exact = [await _timed(stub, key, p.a, max_new_tokens) for p in pairs]
        miss_ttft = await _miss_pairs(stub, key, miss_prompts, miss_tokens)
    round_trips = await _exact_round_trips(suite.config.address("cache"), 50)
    async with aio.insecure_channel(suite.config.address("cache")) as channel:
        info = await cache_pb2_grpc.CacheStub(channel).Info(cache_pb2.CacheInfoRequest(), timeout=30)
    return {"cache_embedding_dtype": info.embedding_dtype, "cache_embedding_dtype_reason": info.embedding_dtype_reason,
            "miss": _summary(misses), "semantic_hit": _summary(semantic), "exact_hit": _summary(exact),
            "miss_ttft": miss_ttft, "exact_lookup_round_trip": round_trips}


def bench_end_to_end(scored: Sequence[ScoredPair], threshold: float, count: int, max_new_tokens: int,
                     miss_pairs: int, miss_tokens: int) -> dict[str, Any]:
    """Start a suite, run the phases above, stop it; the figures and whether the targets were met."""
    pairs = [p for p in scored
             if p.label == 1 and p.lang == "en" and p.guard is None and p.similarity >= threshold + 0.03][:count]
    asked = {p.a for p in pairs} | {p.b for p in pairs}
    miss_prompts = sorted({p.a for p in scored if p.lang == "en"} - asked)[:miss_pairs]
    home = Path(tempfile.mkdtemp(prefix="aiserve-cache-bench-"))
    config = SuiteConfig.for_tests(home)
    store = model_store_path()
    config.extra_env["AISERVE_MODEL_STORE"] = str(store if store.is_absolute() else Path.cwd() / store)
    suite = Suite(config)
    try:
        started = time.perf_counter()
        asyncio.run(suite.start(timeout_s=600))
        start_s = time.perf_counter() - started
        result = asyncio.run(_run(suite, pairs, miss_prompts, max_new_tokens, miss_tokens))
    except BaseException:
        print(f"the suite's home, its logs included, is kept at {home}", flush=True)
        raise
    finally:
        suite.stop()
    shutil.rmtree(home, ignore_errors=True)
    result = {"suite_start_s": round(start_s, 1), "max_new_tokens": max_new_tokens, **result}
    for name in ("semantic_hit", "exact_hit"):
        p50 = result[name]["total"]["p50_ms"]
        result[f"miss_over_{name}_p50"] = round(result["miss"]["total"]["p50_ms"] / max(p50, 1e-3), 1)
        result[f"{name}_target_p50_ms"] = TARGETS_MS[name]
        result[f"{name}_target_met"] = p50 <= TARGETS_MS[name]
    _print(result, len(pairs))
    return result


def _print(result: dict[str, Any], count: int) -> None:
    miss, ttft = result["miss"]["total"], result["miss_ttft"]
    exact, semantic = result["exact_hit"]["total"], result["semantic_hit"]["total"]
    print(f"end to end p50 / p99: miss {miss['p50_ms']:.0f} / {miss['p99_ms']:.0f} ms, semantic hit "
          f"{semantic['p50_ms']:.1f} / {semantic['p99_ms']:.1f} ms, exact hit {exact['p50_ms']:.1f} / "
          f"{exact['p99_ms']:.1f} ms (hits {result['semantic_hit']['hits']}/{count} and "
          f"{result['exact_hit']['hits']}/{count})", flush=True)
    print(f"miss time to first token p50 / p99: cache on {ttft['with_cache']['p50_ms']:.1f} / "
          f"{ttft['with_cache']['p99_ms']:.1f} ms, bypassed {ttft['bypassed']['p50_ms']:.1f} / "
          f"{ttft['bypassed']['p99_ms']:.1f} ms; difference p50 {ttft['difference_p50_ms']:+.1f} ms, mean "
          f"{ttft['difference_mean_ms']:+.1f} ms, paired median {ttft['paired_difference_median_ms']:+.1f} ms "
          f"({ttft['pairs']} pairs); exact lookup round trip p50 "
          f"{result['exact_lookup_round_trip']['p50_ms']:.2f} ms", flush=True)
