"""Cache benchmark: lookup latency at 10,000 and 100,000 entries, and through the gateway end to
end in the same run (bench/cache_e2e.py): exact and semantic hits against misses, and what the
cache costs a miss's time to first token (the cache on against bypassed, same prompts).

    .venv/bin/python -m bench.cache_bench [--sizes 10000 100000] [--e2e-requests 8] [--miss-pairs 24]

Writes bench/results/cache.json and bench/results/cache.png. The stored entries are random
unit vectors (embedding 100,000 prompts with MiniLM takes too long on 2 cores), plus the real
embeddings of the labelled pairs' first prompts; every query is embedded for real, once, and
each lookup's timing is that embedding's plus its search's. All entries share one namespace:
the worst case for a search.
"""

from __future__ import annotations

import argparse
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
from bench.cache_e2e import bench_end_to_end
from bench.measure import machine, percentiles
from services.cache.calibrate import ScoredPair, load_pairs, score_pairs
from services.cache.component_config import IndexParams, MatchRule, RecordConfig
from services.cache.config import CacheConfig
from services.cache.embedder import Embedder, Vector
from services.cache.entry import CacheScope
from services.cache.semantic import SemanticCache

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


Embedded = tuple[str, Vector | None, float]
"""A query, its embedding (None: too long to embed) and the milliseconds that took."""


def embed_queries(embedder: Embedder, queries: Sequence[str]) -> list[Embedded]:
    """Each query embedded for real, once, as the service embeds it."""
    embedded: list[Embedded] = []
    for query in queries:
        started = time.perf_counter()
        vector = embedder.encode_one(query)
        embedded.append((query, vector, (time.perf_counter() - started) * 1000))
    return embedded


def time_lookups(cache: SemanticCache, embedded: Sequence[Embedded]) -> dict[str, Any]:
    """The search and fetch of each embedded query against ``cache``; a lookup is its embedding
    plus those (the service runs them one after the other). The embedding of a text is the same
    work whatever the index holds, so it is measured once per query for every size and index
    (each measured it again: 1,200 embeddings, ~10 s, instead of 300)."""
    search_ms, total_ms, hits = [], [], 0
    for query, vector, embed_ms in embedded:
        started = time.perf_counter()
        hit = cache.lookup(SCOPE, f"<user>{query} (not stored)", query, vector)
        search_ms.append((time.perf_counter() - started) * 1000)
        total_ms.append(embed_ms + search_ms[-1])
        hits += hit is not None
    return {"lookup": percentiles(total_ms), "embed": percentiles([e for _, _, e in embedded]),
            "search_and_fetch": percentiles(search_ms), "hits": hits, "queries": len(embedded)}


def bench_lookups(sizes: Sequence[int], embedder: Embedder, scored: Sequence[ScoredPair],
                  threshold: float) -> dict[str, Any]:
    scored = [p for p in scored if p.lang == "en"]
    stored = sorted({p.a for p in scored})
    real = [(q, v) for q, v in zip(stored, embedder.encode(stored), strict=True) if v is not None]
    embedded = embed_queries(embedder, sorted({p.b for p in scored})[:300])
    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            cache = open_cache(Path(tmp), "flat", threshold)
            fill_s = fill(cache, size, real, rng)
            flat = time_lookups(cache, embedded)
            cache.close()
            row: dict[str, Any] = {"entries": size, "fill_s": round(fill_s, 1), "flat": flat}
            started = time.perf_counter()
            hnsw_cache = open_cache(Path(tmp), "hnsw", threshold)  # built from SQLite, the record
            row["hnsw_build_s"] = round(time.perf_counter() - started, 1)
            row["hnsw"] = time_lookups(hnsw_cache, embedded)
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


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, hits, misses) = plt.subplots(1, 3, figsize=(18, 4.8))
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
        _plot_hits(hits, e2e)
        _plot_miss_ttft(misses, e2e["miss_ttft"])
    fig.suptitle(f"{report['machine']['cpu']}, {report['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_hits(ax: Any, e2e: dict[str, Any]) -> None:
    """Exact and semantic hits, p50 and p99 at the client, against their p50 targets."""
    names = ["exact_hit", "semantic_hit"]
    x = np.arange(len(names))
    for i, q in enumerate(("p50", "p99")):
        values = [e2e[n]["total"][f"{q}_ms"] for n in names]
        ax.bar(x + (i - 0.5) * 0.35, values, 0.35, label=f"{q} end to end")
        for xi, value in zip(x, values, strict=True):
            ax.text(xi + (i - 0.5) * 0.35, value, f"{value:.1f}", ha="center", va="bottom", fontsize=8)
    for xi, name in zip(x, names, strict=True):
        target = e2e[f"{name}_target_p50_ms"]
        ax.hlines(target, xi - 0.4, xi + 0.4, colors="black", linestyles="dashed")
        ax.text(xi + 0.42, target, f"target p50 {target:.0f}", va="center", fontsize=8)
    ax.set_xticks(x, ["exact hit", "semantic hit"])
    ax.set_ylabel("ms, client send -> last message")
    ax.set_title(f"cache hits through the gateway (miss p50 {e2e['miss']['total']['p50_ms']:.0f} ms)")
    ax.legend()


def _plot_miss_ttft(ax: Any, ttft: dict[str, Any]) -> None:
    """A miss's time to first token with the cache on and bypassed, same prompts, interleaved."""
    x = np.arange(2)
    for i, side in enumerate(("with_cache", "bypassed")):
        values = [ttft[side]["p50_ms"], ttft[side]["p99_ms"]]
        ax.bar(x + (i - 0.5) * 0.35, values, 0.35, label=side.replace("_", " "))
        for xi, value in zip(x, values, strict=True):
            ax.text(xi + (i - 0.5) * 0.35, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, ["p50", "p99"])
    ax.set_ylabel("ms to first text")
    ax.set_title(f"a miss's TTFT, {ttft['pairs']} prompt pairs: p50 {ttft['difference_p50_ms']:+.1f} ms, "
                 f"paired median {ttft['paired_difference_median_ms']:+.1f} ms", fontsize=10)
    ax.legend()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--e2e-requests", type=int, default=8, help="questions per kind; 0 skips the suite")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--miss-pairs", type=int, default=24, help="prompts asked with the cache on and bypassed")
    parser.add_argument("--miss-tokens", type=int, default=8, help="new tokens of those (only the first counts)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configure_logging("bench", "warning")
    threshold = CacheConfig().match_rule.similarity_threshold
    faiss.omp_set_num_threads(CacheConfig().index_threads)  # as the service runs it
    # As the service runs it: one thread, its dtype setting (AISERVE_CACHE_EMBEDDING_DTYPE, which
    # the suite's cache also reads, so one variable sets both sides of an A/B).
    embedder = Embedder(threads=1, dtype=os.environ.get("AISERVE_CACHE_EMBEDDING_DTYPE", "auto"))
    scored = score_pairs(load_pairs(), embedder)
    report: dict[str, Any] = {"machine": machine(), "threshold": threshold, "embedding_model": embedder.model_id,
                              "embedding_dtype": embedder.dtype, "embedding_dtype_reason": embedder.dtype_reason,
                              "lookups": bench_lookups(args.sizes, embedder, scored, threshold)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache.json").write_text(json.dumps(report, indent=2))  # kept if the suite fails to start
    if args.e2e_requests:
        report["end_to_end"] = bench_end_to_end(scored, threshold, args.e2e_requests, args.max_new_tokens,
                                                args.miss_pairs, args.miss_tokens)
        (args.out / "cache.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "cache.png")
    print(f"wrote {args.out / 'cache.json'} and {args.out / 'cache.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
