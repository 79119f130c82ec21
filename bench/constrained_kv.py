"""``make bench``'s structured-output and KV cache benchmarks in one pass, sharing their rounds.

Both measured the same thing as their baseline: free-text batches on the in-process engine with
the service's settings (bench/constrained_bench.py's ``free``, and the KV cache bench's ``auto``
side, which ran a batch of its own every round). Here the int8-KV engine's free-text batch rides
in the structured-output bench's rounds (free, log-probabilities, JSON Schema, then free on an
int8 KV cache; the order reversed every other round), and the KV cache bench's ``auto`` side is
the ``free`` runs of those same rounds: each ratio is still of runs in turns, and one batch a
round fewer runs, and one engine fewer is built. Writes what each bench writes alone:
``constrained`` and ``kv_cache`` .json and .png under bench/results/.

    .venv/bin/python -m bench.constrained_kv [the structured-output bench's options]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from bench import constrained_bench, kv_bench
from bench.measure import run_and_write, write_report

INT8_SIDE = "free, int8 KV"


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """constrained.json's report; kv_cache.json is written here, from the same rounds."""
    began = time.perf_counter()
    folder = constrained_bench.default_model()
    int8 = constrained_bench.workload_engine(folder, args.concurrency, "int8")
    async with constrained_bench.started(int8):
        report, runs = await constrained_bench.run_with(args, folder, {INT8_SIDE: (int8, "free")})
    kv = kv_bench.report_of(int8, {"auto": runs["free"], "int8": runs[INT8_SIDE]}, args)
    kv.update(rounds_shared_with="constrained", wall_s=round(time.perf_counter() - began, 1))
    kv_bench.show(write_report("kv_cache", kv, kv_bench.plot))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = constrained_bench.options(argv, "python -m bench.constrained_kv", __doc__.split("\n")[0])
    constrained_bench.show(run_and_write("constrained", bench, args, constrained_bench.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
