"""What the OpenAI-compatible HTTP door costs: 64 concurrent streaming chat requests through HTTP
and the same 64 through gRPC Generate, against one suite in the same run, in turns (docs/http.md).

Both doors ask for the same work: the same prompts, max tokens, temperature and seed per prompt
(so the same tokens), sampled (above the cache's temperature limit, so neither door touches the
cache). The figure is the ratio of the doors' throughputs in tokens per second, medians over
``--rounds`` turns each; the target is that HTTP costs at most 10%. Writes
``bench/results/http.json`` and ``http.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpc import aio

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from bench.measure import Timing, consume, machine, median_run, run_and_write, run_schedule
from bench.openai_stream import chat_stream
from bench.served import start_suite
from bench.workload import Arrival, prompts
from suite.runner import Suite

TIMEOUT_S = 900
CONCURRENCY = 64
TEMPERATURE = 0.8
"""Sampled, so that neither door's requests are looked up in or stored to the cache."""


class Doors:
    """One request of the workload through either door (``index`` picks its seed)."""

    def __init__(self, suite: Suite, key: str, seeds: dict[str, int]) -> None:
        self.suite, self.key, self.seeds = suite, key, seeds

    async def http(self, a: Arrival) -> Timing:
        port = int(self.suite.config.http_address().rsplit(":", 1)[1])
        timing, _ = await chat_stream("127.0.0.1", port, DEFAULT_MODEL_REF, a.text, a.max_new, TIMEOUT_S, self.key,
                                      {"temperature": TEMPERATURE, "seed": self.seeds[a.text]})
        return timing

    async def grpc(self, a: Arrival, channel: aio.Channel) -> Timing:
        request = gateway_pb2.GenerateRequest(model=DEFAULT_MODEL_REF, sampling=common_pb2.SamplingParams(
            max_new_tokens=a.max_new, temperature=TEMPERATURE, seed=self.seeds[a.text]))
        request.chat.messages.add(role="user", content=a.text)
        started = time.perf_counter()
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, timeout=TIMEOUT_S, metadata=(("authorization", f"Bearer {self.key}"),))
        return await consume(call, started, lambda m: len(m.token_ids))

    async def run(self, door: str, work: Sequence[Arrival]) -> dict[str, Any]:
        if door == "http":
            return await run_schedule(work, CONCURRENCY, self.http)
        async with aio.insecure_channel(self.suite.config.address("gateway")) as channel:
            return await run_schedule(work, CONCURRENCY, lambda a: self.grpc(a, channel))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    store = ModelStore(model_store_path().resolve())
    work = [Arrival(0.0, text, [], args.max_tokens) for text in prompts(CONCURRENCY)]
    report: dict[str, Any] = {"machine": machine(), "concurrency": CONCURRENCY, "max_tokens": args.max_tokens,
                              "temperature": TEMPERATURE}
    with tempfile.TemporaryDirectory() as home:
        suite = await start_suite(Path(home), store)
        try:
            doors = Doors(suite, suite.dev_key_path.read_text().strip(), {a.text: i for i, a in enumerate(work)})
            await doors.run("grpc", work[:8])  # warm both paths (and the engine's shapes) first
            await doors.run("http", work[:8])
            runs: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": []}
            for turn in range(args.rounds):
                for door in (("http", "grpc") if turn % 2 == 0 else ("grpc", "http")):  # alternate who goes first
                    print(f"round {turn + 1}: {door} ...", flush=True)
                    runs[door].append(await doors.run(door, work))
        finally:
            suite.stop()
    report["http"], report["grpc"] = median_run(runs["http"]), median_run(runs["grpc"])
    report["http_over_grpc"] = report["http"]["tokens_per_s"] / report["grpc"]["tokens_per_s"]
    report["http_cost"] = 1 - report["http_over_grpc"]
    report["load_average_after"] = machine()["load_average"]
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    doors = ["grpc", "http"]
    left.bar(["gRPC Generate", "HTTP /v1/chat/completions"], [report[d]["tokens_per_s"] for d in doors],
             color=["#4477aa", "#ee7733"])
    for i, door in enumerate(doors):
        left.scatter([i] * len(report[door]["runs_tokens_per_s"]), report[door]["runs_tokens_per_s"], color="black",
                     s=12)
    left.set_ylabel(f"tokens/s ({report['concurrency']} streams x {report['max_tokens']} tokens)")
    left.set_title(f"HTTP / gRPC = {report['http_over_grpc']:.3f} (target >= 0.90)")
    right.bar(doors, [report[d]["ttft"]["p50_ms"] for d in doors], color=["#4477aa", "#ee7733"], label="p50")
    right.scatter(doors, [report[d]["ttft"]["p99_ms"] for d in doors], color="black", label="p99")
    right.set_ylabel("time to first token, ms")
    right.legend()
    fig.suptitle(f"aiserve HTTP door vs gRPC, {report['machine'].get('cpu', '')}, "
                 f"load {report['machine']['load_average'][0]:.1f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="turns of each door; medians")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    args = parser.parse_args(argv)
    report = run_and_write("http", bench, args, plot)
    print(json.dumps({"tokens_per_s": {d: round(report[d]["tokens_per_s"], 1) for d in ("http", "grpc")},
                      "http_over_grpc": round(report["http_over_grpc"], 4),
                      "load_average": [report["machine"]["load_average"], report["load_average_after"]]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
