"""Our decode attention with the next (slot, head)'s keys fetched ahead against without, in the
same process, in turns: one step's calls, one per layer of the default model, each on its own
layer's cache, so every call reads its keys from memory as in the engine (every layer's cache
together is far larger than the CPU's). The slot lengths are bench/attention_split.py's cases.
The bits are the same either way (tests/unit/inference/test_native_ops.py); this measures the time.

    .venv/bin/python -m bench.attention_prefetch [--rounds 9] [--dtype bfloat16]

Writes bench/results/attention_prefetch.json and attention_prefetch.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.attention_split import DIM, GROUP, KV_HEADS, cases, plot_pair
from bench.measure import machine, run_and_write
from services.inference import native_ops
from services.inference.model import TORCH_DTYPES

LAYERS = 30
"""The default model's decoder layers: a step makes one attention call on each one's cache."""


def _step_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, prefetch: bool) -> float:
    """One step's calls, layer after layer: ms."""
    started = time.perf_counter()
    for layer in range(LAYERS):
        torch.ops.aiserve.decode_attention(q, k[layer], v[layer], lens, DIM**-0.5, None, None, True, prefetch)
    return (time.perf_counter() - started) * 1000


def measure(lengths: Sequence[int], dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    """Both ways in turns (each first in every other round): medians of ms per step."""
    g = torch.Generator().manual_seed(len(lengths))
    slots, longest = len(lengths), max(lengths)
    q = torch.randn(slots, KV_HEADS, GROUP, DIM, generator=g).to(dtype)
    k, v = (torch.empty(LAYERS, slots, KV_HEADS, longest, DIM, dtype=dtype).normal_(generator=g) for _ in range(2))
    lens = torch.tensor(lengths, dtype=torch.int32).view(slots, 1).repeat(1, GROUP).contiguous()
    for prefetch in (True, False):  # warm-up
        _step_ms(q, k, v, lens, prefetch)
    ms: dict[str, list[float]] = {"ahead": [], "hardware": []}
    for turn in range(rounds):
        for prefetch in ((True, False) if turn % 2 == 0 else (False, True)):
            ms["ahead" if prefetch else "hardware"].append(_step_ms(q, k, v, lens, prefetch))
    ahead, hardware = statistics.median(ms["ahead"]), statistics.median(ms["hardware"])
    read = 2 * LAYERS * KV_HEADS * DIM * sum(lengths) * k.element_size()
    return {"slots": slots, "keys": sum(lengths), "ahead_ms": round(ahead, 3), "hardware_ms": round(hardware, 3),
            "speedup": round(hardware / ahead, 3), "read_mb": round(read / 1e6, 1),
            "ahead_gb_per_s": round(read / ahead / 1e6, 1), "hardware_gb_per_s": round(read / hardware / 1e6, 1),
            "runs_ms": {name: [round(x, 3) for x in xs] for name, xs in ms.items()}}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    if not native_ops.load():
        raise SystemExit(f"our CPU ops are not built ({native_ops.library_path()}): run make")
    dtype = TORCH_DTYPES[args.dtype]
    return {"machine": {**machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
            "dtype": args.dtype, "rounds": args.rounds, "layers": LAYERS,
            "shape": {"kv_heads": KV_HEADS, "queries_per_kv_head": GROUP, "head_dim": DIM},
            "cases": {name: measure(lengths, dtype, args.rounds) for name, lengths in cases().items()}}


def plot(report: dict[str, Any], path: Path) -> None:
    plot_pair(report, path, ("hardware_ms", "left to the hardware"), ("ahead_ms", "next task fetched ahead"),
              f"ms per step ({report['layers']} layers' calls, cold caches)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_prefetch", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    report = run_and_write("attention_prefetch", bench, parser.parse_args(argv), plot)
    for name, row in report["cases"].items():
        print(f"{name:38s} hardware {row['hardware_ms']:.2f} ms ({row['hardware_gb_per_s']} GB/s), ahead "
              f"{row['ahead_ms']:.2f} ms ({row['ahead_gb_per_s']} GB/s): {row['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
