"""What the OpenAI-compatible HTTP door costs: 64 concurrent streaming chat requests through HTTP
and the same 64 through gRPC Generate, against one suite in the same run, in turns (docs/http.md).

Both doors ask for the same work: the same prompts and max tokens, greedy (so the same tokens;
``--temperature`` samples instead, with a seed per prompt, which measures the sampler too), and
neither touches the cache (gRPC ``CACHE_POLICY_BYPASS``, HTTP ``Cache-Control: no-store``). The
figure is the ratio of the doors' throughputs in tokens per second, medians over ``--rounds``
turns each; the target is that HTTP costs at most 10%. In ``make bench`` the HTTP runs ride on
the engine bench's (a) rounds (``HttpDoor`` as a leg, bench/shared_rounds.py), whose greedy
gateway runs past the cache are the gRPC side.
Writes ``bench/results/http.json`` and ``http.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelStore
from bench.measure import Timing, machine, median_run, run_and_write, run_schedule, write_report
from bench.openai_stream import chat_stream
from bench.served import Served, seed_of, start_suite
from bench.workload import Arrival, prompts
from suite.runner import Suite

TIMEOUT_S = 900
CONCURRENCY = 64
NO_CACHE = {"Cache-Control": "no-store"}
"""Neither looked up in nor stored to the cache, as gRPC's ``CACHE_POLICY_BYPASS``."""


class HttpDoor:
    """The workload through the HTTP door of ``suite``, past the cache, greedy unless
    ``temperature`` (then with a seed per prompt)."""

    name = "http"

    def __init__(self, suite: Suite, key: str, temperature: float = 0.0) -> None:
        self.suite, self.key, self.temperature = suite, key, temperature
        self.report: dict[str, Any] = {}

    async def one(self, a: Arrival) -> Timing:
        port = int(self.suite.config.http_address().rsplit(":", 1)[1])
        params = {"temperature": self.temperature, "seed": seed_of(a.text)} if self.temperature else None
        timing, _ = await chat_stream("127.0.0.1", port, DEFAULT_MODEL_REF, a.text, a.max_new, TIMEOUT_S, self.key,
                                      params, headers=NO_CACHE)
        return timing

    async def warm(self, work: Sequence[Arrival]) -> None:
        await self.run(work[:8])

    async def run(self, work: Sequence[Arrival]) -> dict[str, Any]:
        return await run_schedule(work, CONCURRENCY, self.one)

    async def finish(self, runs: Sequence[dict[str, Any]], gateway: Sequence[dict[str, Any]]) -> None:
        """As a leg of the engine bench's (a): ``gateway`` is the gRPC side, run in the same rounds."""
        self.report = write_report("http", doors_report(runs, gateway, {
            "rides_on": "bench/engine_bench.py (a)", "max_tokens": 64, "temperature": self.temperature}), plot)


def doors_report(http: Sequence[dict[str, Any]], grpc: Sequence[dict[str, Any]], extra: dict[str, Any]
                 ) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(), "concurrency": CONCURRENCY, **extra,
                              "http": median_run(http), "grpc": median_run(grpc)}
    report["http_over_grpc"] = report["http"]["tokens_per_s"] / report["grpc"]["tokens_per_s"]
    report["http_cost"] = 1 - report["http_over_grpc"]
    report["load_average_after"] = machine()["load_average"]
    return report


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    store = ModelStore(model_store_path().resolve())
    work = [Arrival(0.0, text, [], args.max_tokens) for text in prompts(CONCURRENCY)]
    with tempfile.TemporaryDirectory() as home:
        suite = await start_suite(Path(home), store)
        try:
            key = suite.dev_key_path.read_text().strip()
            http, grpc = HttpDoor(suite, key, args.temperature), Served(suite, key, args.temperature)
            await grpc.run(work[:8], "gateway")  # warm both paths (and the engine's shapes) first
            await http.run(work[:8])
            runs: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": []}
            for turn in range(args.rounds):
                for name in (("http", "grpc") if turn % 2 == 0 else ("grpc", "http")):  # alternate who goes first
                    print(f"round {turn + 1}: {name} ...", flush=True)
                    runs[name].append(await (http.run(work) if name == "http" else grpc.run(work, "gateway")))
        finally:
            suite.stop()
    return doors_report(runs["http"], runs["grpc"], {"max_tokens": args.max_tokens, "temperature": args.temperature})


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


def show(report: dict[str, Any]) -> None:
    print(json.dumps({"tokens_per_s": {d: round(report[d]["tokens_per_s"], 1) for d in ("http", "grpc")},
                      "http_over_grpc": round(report["http_over_grpc"], 4),
                      "load_average": [report["machine"]["load_average"], report["load_average_after"]]}, indent=1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="turns of each door; medians")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, as in make bench; above: sampled, a seed per prompt (the sampler's cost)")
    show(run_and_write("http", bench, parser.parse_args(argv), plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
