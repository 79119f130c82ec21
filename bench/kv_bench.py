"""The int8 KV cache against the activations' dtype: the sequences a fixed byte budget holds, the
engine's throughput on the same batch (in turns), and the quality change by ``aiserve eval
--kv-dtype int8`` (perplexity, KL, top-1 agreement against the same version). Writes
``bench/results/kv_cache.json`` and ``kv_cache.png`` (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiserve.common.config import config_with
from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from bench.measure import machine, median_run, run_and_write
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine
from services.inference.engine_config import KVCacheConfig
from services.inference.kv_cache import KVLayout, KVPlan
from services.inference.request import GenerateRequest
from services.inference.torch_thread import run_in_fresh_thread

KV_DTYPES = ("auto", "int8")
BUDGET_BYTES = 1 << 30
"""The byte budget whose capacity is compared (at max_seq_len 2048, the service's default)."""


def capacity(engine: BatchEngine, kv_dtype: str) -> dict[str, Any]:
    """Slots of 2048 tokens that ``BUDGET_BYTES`` holds, and the bytes per token, in ``kv_dtype``."""
    c = engine.model.config
    dtype = torch.int8 if kv_dtype == "int8" else engine.model.dtype
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    plan = KVPlan.fit(KVCacheConfig(kv_cache_bytes=BUDGET_BYTES, max_seq_len=2048, prefix_cache_fraction=0.0),
                      layout, 1 << 20, c.max_position_embeddings)
    return {"dtype": str(dtype).removeprefix("torch."), "bytes_per_token": layout.bytes_per_token,
            "sequences_in_1GiB_at_2048": plan.num_slots}


async def _batch(engine: BatchEngine, n: int, max_tokens: int) -> dict[str, Any]:
    async def one(i: int) -> int:
        request = GenerateRequest(request_id=f"k{i}", prompt_token_ids=tuple(range(10 + i, 60 + i)),
                                  max_new_tokens=max_tokens, ignore_eos=True)
        return sum([len(e.token_ids) async for e in engine.generate(request)])

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    store = ModelStore(model_store_path().resolve())
    folder, _ = store.load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    engines = {kv: run_in_fresh_thread(lambda kv=kv: build_engine(config_with(  # type: ignore[misc]
        InferenceConfig, max_num_seqs=args.concurrency, max_seq_len=512, kv_dtype=kv), folder)) for kv in KV_DTYPES}
    report: dict[str, Any] = {"machine": machine(), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                              "budget_bytes": BUDGET_BYTES}
    runs: dict[str, list[dict[str, Any]]] = {kv: [] for kv in KV_DTYPES}
    for kv, engine in engines.items():
        report[kv] = capacity(engine, kv)
        engine.start()
    try:
        for engine in engines.values():
            await _batch(engine, 4, 8)  # warm-up
        for turn in range(args.rounds):
            for kv in (KV_DTYPES if turn % 2 == 0 else tuple(reversed(KV_DTYPES))):
                print(f"round {turn + 1}: kv {kv} ...", flush=True)
                runs[kv].append(await _batch(engines[kv], args.concurrency, args.max_tokens))
    finally:
        for engine in engines.values():
            await engine.stop()
    for kv in KV_DTYPES:
        report[kv]["throughput"] = median_run(runs[kv])
    report["int8_capacity_ratio"] = report["int8"]["sequences_in_1GiB_at_2048"] / report["auto"][
        "sequences_in_1GiB_at_2048"]
    report["int8_speed_ratio"] = report["int8"]["throughput"]["tokens_per_s"] / report["auto"]["throughput"][
        "tokens_per_s"]
    report["quality"] = _quality(store)
    return report


def _quality(store: ModelStore) -> dict[str, Any]:
    from bench.quality import evaluate_version  # noqa: PLC0415 - heavy, and only this figure needs it

    r = evaluate_version(store, ModelRef.parse(DEFAULT_MODEL_REF), kv_dtype="int8")
    return {key: r[key] for key in ("reference_perplexity", "candidate_perplexity", "perplexity_change_pct",
                                    "kl_mean", "kl_max", "top1_agreement", "answer_agreement", "passed")}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"{report[kv]['dtype']} KV" for kv in KV_DTYPES]
    left.bar(names, [report[kv]["sequences_in_1GiB_at_2048"] for kv in KV_DTYPES], color=["#4477aa", "#ee7733"])
    left.set_ylabel("sequences of 2048 tokens in 1 GiB")
    left.set_title(f"capacity x{report['int8_capacity_ratio']:.2f}")
    right.bar(names, [report[kv]["throughput"]["tokens_per_s"] for kv in KV_DTYPES], color=["#4477aa", "#ee7733"])
    right.set_ylabel(f"tokens/s ({report['concurrency']} x {report['max_tokens']} tokens)")
    q = report["quality"]
    right.set_title(f"speed x{report['int8_speed_ratio']:.2f}; perplexity {q['perplexity_change_pct']:+.2f}%, "
                    f"KL {q['kl_mean']:.4f}", fontsize=9)
    fig.suptitle(f"aiserve int8 KV cache, {report['machine'].get('cpu', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    report = run_and_write("kv_cache", bench, parser.parse_args(argv), plot)
    print(json.dumps({"capacity_ratio": round(report["int8_capacity_ratio"], 3),
                      "speed_ratio": round(report["int8_speed_ratio"], 3),
                      "tokens_per_s": {kv: round(report[kv]["throughput"]["tokens_per_s"], 1) for kv in KV_DTYPES},
                      "quality": report["quality"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
