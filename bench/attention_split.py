"""Our decode attention's split of work among the threads: by the keys each (slot, head) reads
against by count (at::parallel_for's own cut), in the same process, in turns, on slot lengths a
serving engine meets (equal, long contexts admitted first, random, one long conversation among
short ones). The bits are the same either way (tests/unit/inference/test_native_ops.py); this
measures the time. The default model's attention shape: 3 KV heads of 3 queries, 64 values.

    .venv/bin/python -m bench.attention_split [--rounds 7] [--calls 30] [--dtype bfloat16]

Writes bench/results/attention_split.json and attention_split.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.measure import machine, run_and_write
from services.inference import native_ops
from services.inference.model import TORCH_DTYPES

KV_HEADS, GROUP, DIM = 3, 3, 64


def cases() -> dict[str, list[int]]:
    """Keys per slot, by the case's name."""
    rng = random.Random(0)
    return {"64 equal (200)": [200] * 64,
            "32 long first (350), 32 short (50)": [350] * 32 + [50] * 32,
            "64 random (30-370)": [rng.randint(30, 370) for _ in range(64)],
            "1 long (2000), 63 short (100)": [2000] + [100] * 63,
            "16 random (30-1000)": [rng.randint(30, 1000) for _ in range(16)]}


def _time(args: tuple[Any, ...], balanced: bool, calls: int) -> float:
    """ms per call, over ``calls`` calls."""
    started = time.perf_counter()
    for _ in range(calls):
        torch.ops.aiserve.decode_attention(*args, None, None, balanced)
    return (time.perf_counter() - started) / calls * 1000


def measure(lengths: Sequence[int], dtype: torch.dtype, rounds: int, calls: int) -> dict[str, Any]:
    """Both splits in turns (each first in every other round): medians of ms per call."""
    g = torch.Generator().manual_seed(len(lengths))
    slots, longest = len(lengths), max(lengths)
    q = torch.randn(slots, KV_HEADS, GROUP, DIM, generator=g).to(dtype)
    k, v = (torch.randn(slots, KV_HEADS, longest, DIM, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor(lengths, dtype=torch.int32).view(slots, 1).repeat(1, GROUP).contiguous()
    args = (q, k, v, lens, DIM**-0.5)
    for balanced in (True, False):  # warm-up
        _time(args, balanced, calls)
    ms: dict[str, list[float]] = {"by_keys": [], "by_count": []}
    for turn in range(rounds):
        for balanced in ((True, False) if turn % 2 == 0 else (False, True)):
            ms["by_keys" if balanced else "by_count"].append(_time(args, balanced, calls))
    by_keys, by_count = statistics.median(ms["by_keys"]), statistics.median(ms["by_count"])
    return {"slots": slots, "keys": sum(lengths), "by_keys_ms": round(by_keys, 4), "by_count_ms": round(by_count, 4),
            "speedup": round(by_count / by_keys, 3),
            "runs_ms": {name: [round(x, 4) for x in xs] for name, xs in ms.items()}}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    if not native_ops.load():
        raise SystemExit(f"our CPU ops are not built ({native_ops.library_path()}): run make")
    dtype = TORCH_DTYPES[args.dtype]
    return {"machine": {**machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
            "dtype": args.dtype, "rounds": args.rounds, "calls_per_timing": args.calls,
            "shape": {"kv_heads": KV_HEADS, "queries_per_kv_head": GROUP, "head_dim": DIM},
            "cases": {name: measure(lengths, dtype, args.rounds, args.calls) for name, lengths in cases().items()}}


def plot_pair(report: dict[str, Any], path: Path, base: tuple[str, str], new: tuple[str, str], ylabel: str) -> None:
    """Each case's two timings side by side (``base`` and ``new``: the row's key and its label),
    the new one marked with the row's speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["cases"])
    rows = [report["cases"][n] for n in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar([i - 0.2 for i in x], [r[base[0]] for r in rows], 0.4, label=base[1], color="grey")
    ax.bar([i + 0.2 for i in x], [r[new[0]] for r in rows], 0.4, label=new[1], color="tab:blue")
    for i, r in zip(x, rows, strict=True):
        ax.text(i + 0.2, r[new[0]], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [n.replace(", ", ",\n") for n in names], fontsize=8)
    ax.set_ylabel(ylabel)
    m = report["machine"]
    ax.set_title(f"decode attention, {report['dtype']}, {m['threads']} threads, {m['cpu']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(report: dict[str, Any], path: Path) -> None:
    plot_pair(report, path, ("by_count_ms", "split by count"), ("by_keys_ms", "split by keys"),
              "ms per call (one layer's decode attention)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_split", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    report = run_and_write("attention_split", bench, parser.parse_args(argv), plot)
    for name, row in report["cases"].items():
        print(f"{name:38s} by count {row['by_count_ms']:.3f} ms, by keys {row['by_keys_ms']:.3f} ms: "
              f"{row['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
