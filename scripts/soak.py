"""Soak test of the inference service: 2,000 short requests, resident memory must stay flat.

    .venv/bin/python scripts/soak.py [--requests 2000] [--concurrency 16] [--out bench/results/soak.json]

Starts the inference service alone (a child process, default settings: bf16), sends short
generations (varied prompts, 4 new tokens, some cancelled midway) and reads the process's
resident memory from the Stats RPC after the first 100 and after all requests. Passes when the
last is within 5% of the first; writes the figures as JSON. Exit code 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from grpc import aio

from aiserve.common.paths import model_store_path
from aiserve.v1 import inference_pb2, inference_pb2_grpc
from suite.runner import Suite, SuiteConfig

WARM_UP = 100
TOLERANCE = 0.05


async def one(stub: inference_pb2_grpc.InferenceStub, rng: random.Random, i: int) -> None:
    prompt = [1, 9690, 198] + [rng.randrange(3, 49152) for _ in range(rng.randint(4, 32))]
    decoding = inference_pb2.Decoding(max_new_tokens=4, ignore_eos=True, temperature=0.7 if i % 3 else 0.0)
    call = stub.Generate(inference_pb2.InferenceRequest(request_id=f"soak-{i}", prompt_token_ids=prompt,
                                                        decoding=decoding), timeout=120)
    if i % 10 == 0:  # every tenth caller goes away after the first token
        await call.read()
        call.cancel()
        return
    async for _ in call:
        pass


async def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as home:
        config = SuiteConfig.for_tests(Path(home))
        config.extra_env["AISERVE_MODEL_STORE"] = str(model_store_path().resolve())
        suite = Suite(config)
        suite.start_service("inference")
        try:
            await suite.wait_serving(("inference",), timeout_s=300)
            async with aio.insecure_channel(config.address("inference")) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                rng, gate, rss = random.Random(1), asyncio.Semaphore(args.concurrency), {}
                started = time.perf_counter()

                async def limited(i: int) -> None:
                    async with gate:
                        await one(stub, rng, i)

                await asyncio.gather(*(limited(i) for i in range(WARM_UP)))
                first = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=30)
                rss["after_100"] = first.rss_bytes
                await asyncio.gather(*(limited(i) for i in range(WARM_UP, args.requests)))
                last = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=30)
                rss["after_all"] = last.rss_bytes
                seconds = time.perf_counter() - started
        finally:
            suite.stop()
    growth = rss["after_all"] / rss["after_100"] - 1
    return {"requests": args.requests, "concurrency": args.concurrency, "seconds": round(seconds, 1),
            "rss_after_100_bytes": rss["after_100"], "rss_after_all_bytes": rss["after_all"],
            "rss_growth": round(growth, 4), "tolerance": TOLERANCE, "passed": abs(growth) <= TOLERANCE,
            "kv_total_bytes": last.kv_total_bytes, "kv_used_bytes_at_end": last.kv_used_bytes,
            "num_running_at_end": last.num_running, "generated_tokens": last.num_generated_tokens,
            "prefix_hits": last.prefix_hits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
