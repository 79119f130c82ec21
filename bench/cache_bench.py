"""Cache benchmark: lookup latency at 10,000 and 100,000 entries, and a cache hit against a miss
through the gateway end to end, in the same run.

    .venv/bin/python -m bench.cache_bench [--sizes 10000 100000] [--e2e-requests 8]

Writes bench/results/cache.json and bench/results/cache.png. The stored entries are random
unit vectors (embedding 100,000 prompts with MiniLM takes too long on 2 cores), plus the real
embeddings of the labelled pairs' first prompts; every query is embedded for real, and the
timings include that embedding. All entries share one namespace: the worst case for a search.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from aiserve.common.logging import configure_logging
from aiserve.common.paths import model_store_path
from bench.measure import machine, percentiles
from services.cache.calibrate import ScoredPair, load_pairs, score_pairs
from services.cache.component_config import IndexParams, MatchRule, RecordConfig
from services.cache.config import CacheConfig
from services.cache.embedder import Embedder
from services.cache.entry import CacheScope
from services.cache.semantic import SemanticCache
from suite.runner import Suite, SuiteConfig

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="bench", params="greedy")


def open_cache(folder: Path, kind: str, threshold: float) -> SemanticCache:
    return SemanticCache(folder / "cache.sqlite3", folder / f"{kind}.faiss", dim=384,
                         record=RecordConfig(max_entries=10_000_000), rule=MatchRule(similarity_threshold=threshold),
                         index=IndexParams(index_kind=kind), embedder_id="bench")


def fill(cache: SemanticCache, size: int, real: Sequence[tuple[str, np.ndarray]], rng: np.random.Generator) -> float:
    """Store the real entries, then random unit vectors up to ``size``; returns seconds taken."""
    started = time.perf_counter()
    for query, vector in real:
        cache.store(SCOPE, f"<user>{query}", "answer", (1, 2, 3), "stop", query=query, vector=vector)
    for i in range(size - len(real)):
        vector = rng.standard_normal(384).astype(np.float32)
        vector /= np.linalg.norm(vector)
        cache.store(SCOPE, f"<user>synthetic {i}", "answer", (1, 2, 3), "stop", query=f"synthetic question {i}",
                    vector=vector)
    return time.perf_counter() - started


def time_lookups(cache: SemanticCache, embedder: Embedder, queries: Sequence[str]) -> dict[str, Any]:
    embed_ms, search_ms, total_ms, hits = [], [], [], 0
    for query in queries:
        t0 = time.perf_counter()
        vector = embedder.encode_one(query)
        t1 = time.perf_counter()
        hit = cache.lookup(SCOPE, f"<user>{query} (not stored)", query, vector)
        t2 = time.perf_counter()
        embed_ms.append((t1 - t0) * 1000)
        search_ms.append((t2 - t1) * 1000)
        total_ms.append((t2 - t0) * 1000)
        hits += hit is not None
    return {"lookup": percentiles(total_ms), "embed": percentiles(embed_ms), "search_and_fetch": percentiles(search_ms),
            "hits": hits, "queries": len(queries)}


def bench_lookups(sizes: Sequence[int], embedder: Embedder, scored: Sequence[ScoredPair],
                  threshold: float) -> dict[str, Any]:
    scored = [p for p in scored if p.lang == "en"]
    stored = sorted({p.a for p in scored})
    real = [(q, v) for q, v in zip(stored, embedder.encode(stored), strict=True) if v is not None]
    queries = sorted({p.b for p in scored})[:300]
    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            cache = open_cache(Path(tmp), "flat", threshold)
            fill_s = fill(cache, size, real, rng)
            flat = time_lookups(cache, embedder, queries)
            cache.close()
            row: dict[str, Any] = {"entries": size, "fill_s": round(fill_s, 1), "flat": flat}
            started = time.perf_counter()
            hnsw_cache = open_cache(Path(tmp), "hnsw", threshold)  # built from SQLite, the record
            row["hnsw_build_s"] = round(time.perf_counter() - started, 1)
            row["hnsw"] = time_lookups(hnsw_cache, embedder, queries)
            hnsw_cache.close()
            started = time.perf_counter()
            reopened = open_cache(Path(tmp), "flat", threshold)
            row["flat_restart_s"] = round(time.perf_counter() - started, 2)
            row["flat_restart_index"] = reopened.index_source
            reopened.close()
        out[str(size)] = row
        print(f"{size:>7} entries: flat p50 {flat['lookup']['p50_ms']:.2f} ms p99 {flat['lookup']['p99_ms']:.2f} ms;"
              f" hnsw p50 {row['hnsw']['lookup']['p50_ms']:.2f} ms p99 {row['hnsw']['lookup']['p99_ms']:.2f} ms;"
              f" search+fetch p50 {flat['search_and_fetch']['p50_ms']:.2f} /"
              f" {row['hnsw']['search_and_fetch']['p50_ms']:.2f} ms; embedding p50 {flat['embed']['p50_ms']:.2f} ms;"
              f" hits {flat['hits']}/{flat['queries']}"
              f" / {row['hnsw']['hits']}; fill {fill_s:.0f} s, hnsw build {row['hnsw_build_s']} s", flush=True)
    return out


async def _timed_generate(suite: Suite, key: str, question: str, max_new_tokens: int) -> dict[str, Any]:
    from grpc import aio

    from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))
    request.chat.messages.add(role="user", content=question)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        started, first = time.perf_counter(), 0.0
        last = None
        async for message in gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, timeout=300, metadata=(("authorization", f"Bearer {key}"),)):
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


def bench_end_to_end(scored: Sequence[ScoredPair], threshold: float, count: int,
                     max_new_tokens: int) -> dict[str, Any]:
    """Misses, then paraphrases of them (semantic hits), then the same questions (exact hits)."""
    pairs = [p for p in scored
             if p.label == 1 and p.lang == "en" and p.guard is None and p.similarity >= threshold + 0.03]
    pairs = pairs[:count]
    home = Path(tempfile.mkdtemp(prefix="aiserve-cache-bench-"))
    config = SuiteConfig.for_tests(home)
    store = model_store_path()
    config.extra_env["AISERVE_MODEL_STORE"] = str(store if store.is_absolute() else Path.cwd() / store)
    suite = Suite(config)
    try:
        started = time.perf_counter()
        asyncio.run(suite.start(timeout_s=600))
        start_s = time.perf_counter() - started
        key = suite.dev_key_path.read_text().strip()

        async def run(questions: Sequence[str]) -> list[dict[str, Any]]:
            return [await _timed_generate(suite, key, q, max_new_tokens) for q in questions]

        asyncio.run(run(["Warm-up: say hello."]))
        misses = asyncio.run(run([p.a for p in pairs]))
        semantic = asyncio.run(run([p.b for p in pairs]))
        exact = asyncio.run(run([p.a for p in pairs]))
    finally:
        suite.stop()
    result: dict[str, Any] = {"suite_start_s": round(start_s, 1), "max_new_tokens": max_new_tokens,
              "miss": _summary(misses), "semantic_hit": _summary(semantic), "exact_hit": _summary(exact)}
    for name in ("semantic_hit", "exact_hit"):
        result[f"miss_over_{name}_p50"] = round(
            result["miss"]["total"]["p50_ms"] / max(result[name]["total"]["p50_ms"], 1e-3), 1)
    print(f"end to end p50: miss {result['miss']['total']['p50_ms']:.0f} ms, semantic hit "
          f"{result['semantic_hit']['total']['p50_ms']:.1f} ms, exact hit {result['exact_hit']['total']['p50_ms']:.1f}"
          f" ms (hits {result['semantic_hit']['hits']}/{len(pairs)} and {result['exact_hit']['hits']}/{len(pairs)})",
          flush=True)
    return result


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels: list[str] = []
    series: dict[str, list[float]] = {f"{part} {q}": [] for part in ("lookup", "search+fetch") for q in ("p50", "p99")}
    for size, row in report["lookups"].items():
        for kind in ("flat", "hnsw"):
            labels.append(f"{kind}\n{int(size):,}")
            for part in ("lookup", "search_and_fetch"):
                name = "lookup" if part == "lookup" else "search+fetch"
                series[f"{name} p50"].append(row[kind][part]["p50_ms"])
                series[f"{name} p99"].append(row[kind][part]["p99_ms"])
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        left.bar(x + (i - 1.5) * 0.2, values, 0.2, label=name)
    left.set_xticks(x, labels)
    left.set_ylabel("ms (lookup = embedding + search + fetch)")
    left.set_title("cache lookup latency by index and entries")
    left.legend()
    e2e = report.get("end_to_end")
    if e2e:
        names = ["miss", "semantic_hit", "exact_hit"]
        totals = [e2e[n]["total"]["p50_ms"] for n in names]
        right.bar(names, totals, color=["tab:red", "tab:green", "tab:blue"])
        right.set_yscale("log")
        right.set_ylabel("ms, p50, log scale")
        right.set_title(f"Generate through the gateway ({e2e['max_new_tokens']} new tokens max)")
        for i, value in enumerate(totals):
            right.text(i, value, f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms", ha="center", va="bottom")
    fig.suptitle(f"{report['machine']['cpu']}, {report['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--e2e-requests", type=int, default=8, help="questions per kind; 0 skips the suite")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configure_logging("bench", "warning")
    threshold = CacheConfig().match_rule.similarity_threshold
    faiss.omp_set_num_threads(CacheConfig().index_threads)  # as the service runs it
    embedder = Embedder(threads=1)  # as the service runs it
    scored = score_pairs(load_pairs(), embedder)
    report: dict[str, Any] = {"machine": machine(), "threshold": threshold, "embedding_model": embedder.model_id,
                              "lookups": bench_lookups(args.sizes, embedder, scored, threshold)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache.json").write_text(json.dumps(report, indent=2))  # kept if the suite fails to start
    if args.e2e_requests:
        report["end_to_end"] = bench_end_to_end(scored, threshold, args.e2e_requests, args.max_new_tokens)
        (args.out / "cache.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "cache.png")
    print(f"wrote {args.out / 'cache.json'} and {args.out / 'cache.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
