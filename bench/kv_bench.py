"""The int8 KV cache against the activations' dtype: the sequences a fixed byte budget holds, the
engine's throughput on the same batch (in turns: the free-text batch of
bench/constrained_bench.py, 32 requests of 96 tokens), and the quality change by ``aiserve
eval --kv-dtype int8`` (perplexity, KL, top-1 agreement against the same version). Writes
``bench/results/kv_cache.json`` and ``kv_cache.png`` (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from bench.constrained_bench import (
    default_model,
    options,
    prompts_of,
    run_rounds,
    started,
    warm,
    workload_engine,
)
from bench.measure import machine, median_run, run_and_write
from services.inference.batch_engine import BatchEngine
from services.inference.engine_config import KVCacheConfig
from services.inference.kv_cache import KVLayout, KVPlan

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


def report_of(engine: BatchEngine, runs: Mapping[str, Sequence[dict[str, Any]]], args: argparse.Namespace
              ) -> dict[str, Any]:
    """kv_cache.json: each KV dtype's capacity (of ``engine``'s model) and median run (``runs``
    by ``KV_DTYPES``), the two ratios, and the quality change of an int8 cache."""
    report: dict[str, Any] = {"machine": machine(), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                              "workload": "free text, bench/constrained_bench.py's prompts (ignore EOS)",
                              "budget_bytes": BUDGET_BYTES}
    for kv in KV_DTYPES:
        report[kv] = {**capacity(engine, kv), "throughput": median_run(runs[kv])}
    report["int8_capacity_ratio"] = report["int8"]["sequences_in_1GiB_at_2048"] / report["auto"][
        "sequences_in_1GiB_at_2048"]
    report["int8_speed_ratio"] = report["int8"]["throughput"]["tokens_per_s"] / report["auto"]["throughput"][
        "tokens_per_s"]
    report["quality"] = _quality(ModelStore(model_store_path().resolve()))
    return report


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Alone: the two engines' free-text batches in rounds (``make bench`` runs the int8 side
    in the structured-output bench's rounds instead, whose free-text runs are the other side:
    bench/constrained_kv.py)."""
    folder = default_model()
    engines = {kv: workload_engine(folder, args.concurrency, kv) for kv in KV_DTYPES}
    prompts = prompts_of(folder)
    sides = {kv: (engine, "free") for kv, engine in engines.items()}
    async with started(*engines.values()):
        await warm(list(sides.values()), prompts)
        runs = await run_rounds(sides, prompts, args)
    return report_of(engines["auto"], runs, args)


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
    args = options(argv, "python -m bench.kv_bench", __doc__.split("\n")[0])
    show(run_and_write("kv_cache", bench, args, plot))
    return 0


def show(report: dict[str, Any]) -> None:
    print(json.dumps({"capacity_ratio": round(report["int8_capacity_ratio"], 3),
                      "speed_ratio": round(report["int8_speed_ratio"], 3),
                      "tokens_per_s": {kv: round(report[kv]["throughput"]["tokens_per_s"], 1) for kv in KV_DTYPES},
                      "quality": report["quality"]}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
