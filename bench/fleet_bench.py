"""Fleet benchmark: what a second inference replica costs, and how fast a killed one is noticed.

    .venv/bin/python -m bench.fleet_bench [--rounds 3]

(e) 64 concurrent requests of 64 new tokens through the gateway, against a suite with one
    inference replica (all cores) and one with two (the cores split between them), ``--rounds``
    runs of each, in turn; medians, and the resident memory of each suite. On one machine the two
    replicas share the same cores, so no gain is expected: the figure is what the second replica
    costs (the target: under 10% of throughput).
(f) 32 streams of up to 200 tokens through the gateway on the two-replica suite; once each has
    its first token, SIGKILL one replica: the time from the kill to the first and to the last
    affected client seeing its error (UNAVAILABLE naming its request id), how many streams failed
    and held, whether 16 requests sent right after the kill all succeed, and the time until the
    killed replica is restarted and SERVING again.
In ``make bench`` both ride on the engine bench's (a) rounds instead (``FleetLeg``,
bench/shared_rounds.py): (a)'s suite and its gateway runs are the one-replica side. Writes
bench/results/fleet.json and fleet.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from transformers import AutoTokenizer

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from bench.measure import machine, median_run, run_and_write, write_report
from bench.served import Served, start_suite
from bench.workload import Arrival, chat_ids, prompts
from suite.runner import Suite

TIMEOUT_S = 900


def suite_rss_bytes(suite: Suite) -> int:
    """Resident memory of every process of the suite (Linux /proc)."""
    total = 0
    for process in suite.processes.values():
        try:
            with open(f"/proc/{process.pid}/statm") as f:
                total += int(f.read().split()[1]) * 4096
        except (OSError, ValueError, IndexError):
            pass
    return total


async def run_e(one: Suite, two: Suite, full: Sequence[Arrival], rounds: int) -> dict[str, Any]:
    """(e) 1 vs 2 replicas, the same 64 x 64 workload through each gateway, in turn."""
    served = {"one_replica": Served(one, one.dev_key_path.read_text().strip()),
              "two_replicas": Served(two, two.dev_key_path.read_text().strip())}
    for s in served.values():
        await s.run(full[:2], "gateway")  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in served}
    for _ in range(rounds):
        for name, s in served.items():
            runs[name].append(await s.run(full, "gateway"))
    return e_report(one, two, runs["one_replica"], runs["two_replicas"])


def e_report(one: Suite, two: Suite, one_runs: Sequence[dict[str, Any]], two_runs: Sequence[dict[str, Any]]
             ) -> dict[str, Any]:
    """(e)'s figures from each suite's runs (medians), with each suite's resident memory now."""
    e: dict[str, Any] = {"one_replica": median_run(one_runs), "two_replicas": median_run(two_runs)}
    e["one_replica"]["rss_bytes"] = suite_rss_bytes(one)
    e["two_replicas"]["rss_bytes"] = suite_rss_bytes(two)
    one_tps, two_tps = e["one_replica"]["tokens_per_s"], e["two_replicas"]["tokens_per_s"]
    e["cost_of_second_replica"] = 1 - two_tps / one_tps
    return e


class FleetLeg:
    """(e) and (f) riding on the engine bench's (a) (bench/engine_bench.py, ``Leg``): (a)'s suite
    is the one-replica side and its gateway runs are (e)'s one-replica runs, so only the
    two-replica suite's runs are added to each round; (f) runs on that suite after the last
    round, and the report is written then."""

    name = "two_replicas"

    def __init__(self, one: Suite, two: Suite) -> None:
        self.one, self.two = one, two
        self.served = Served(two, two.dev_key_path.read_text().strip())
        self.report: dict[str, Any] = {}

    async def warm(self, work: Sequence[Arrival]) -> None:
        await self.served.run(work[:2], "gateway")

    async def run(self, work: Sequence[Arrival]) -> dict[str, Any]:
        return await self.served.run(work, "gateway")

    async def finish(self, runs: Sequence[dict[str, Any]], gateway: Sequence[dict[str, Any]]) -> None:
        e = e_report(self.one, self.two, gateway, runs)
        f = await run_f_supervised(self.two)
        self.two.stop()
        self.report = write_report("fleet", {"machine": machine(), "rides_on": "bench/engine_bench.py (a)",
                                             "e_replicas": e, "f_kill": f}, plot)


class Stream:
    """One long generation, timed: when it ended and how."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, key: str, i: int) -> None:
        self.request_id = f"bench-kill-{i}-{time.monotonic_ns()}"
        request = gateway_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(max_new_tokens=200, temperature=0.0),
            cache=gateway_pb2.CACHE_POLICY_BYPASS)
        request.chat.messages.add(role="user", content=prompts(32)[i])
        self.call = stub.Generate(request, timeout=TIMEOUT_S, metadata=(
            ("authorization", f"Bearer {key}"), ("x-request-id", self.request_id)))
        self.first = asyncio.Event()
        self.code: grpc.StatusCode = grpc.StatusCode.OK
        self.details = ""
        self.ended_at = 0.0

    async def run(self) -> None:
        try:
            async for _ in self.call:
                self.first.set()
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        self.first.set()
        self.ended_at = time.monotonic()


async def run_f(two: Suite, victim: str) -> dict[str, Any]:
    """(f) SIGKILL of ``victim`` under 32 streams."""
    key = two.dev_key_path.read_text().strip()
    served = Served(two, key)
    restarts = two.restart_count(victim)
    async with aio.insecure_channel(two.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        streams = [Stream(stub, key, i) for i in range(32)]
        tasks = [asyncio.ensure_future(s.run()) for s in streams]
        await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), TIMEOUT_S)
        two.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        after = [Arrival(0.0, f"Count to {i}.", [], 16) for i in range(16)]
        after_run = await served_run_counting_failures(served, after)
        await asyncio.gather(*tasks)
    await two.wait_restarted(victim, restarts + 1, timeout_s=600)
    back_s = time.monotonic() - killed_at
    failed = [s for s in streams if s.code != grpc.StatusCode.OK]
    delays = sorted(s.ended_at - killed_at for s in failed)
    return {
        "streams": len(streams), "failed": len(failed), "held": len(streams) - len(failed),
        "failed_codes": sorted({s.code.name for s in failed}),
        "failed_name_their_request_id": all(s.request_id in s.details for s in failed),
        "kill_to_first_error_s": delays[0] if delays else None,
        "kill_to_last_error_s": delays[-1] if delays else None,
        "error_delays_s": [round(d, 4) for d in delays],
        "requests_after_kill": len(after), "failures_after_kill": after_run,
        "kill_to_back_serving_s": back_s,
    }


async def run_f_supervised(two: Suite) -> dict[str, Any]:
    """(f) on ``two``, supervised so that the killed replica is restarted."""
    print("(f) SIGKILL of a replica under load ...", flush=True)
    supervisor = asyncio.create_task(two.supervise())
    try:
        return await run_f(two, two.inference_names[-1])
    finally:
        supervisor.cancel()


async def served_run_counting_failures(served: Served, work: Sequence[Arrival]) -> int:
    """Send ``work`` through the gateway at once; how many failed."""
    async with aio.insecure_channel(served.suite.config.address("gateway")) as channel:
        results = await asyncio.gather(*(served.one(a, "gateway", channel) for a in work), return_exceptions=True)
    return sum(isinstance(r, BaseException) for r in results)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e, f = report["e_replicas"], report["f_kill"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["one_replica", "two_replicas"]
    left.bar(["1 replica", "2 replicas"], [e[n]["tokens_per_s"] for n in names], color=["#4477aa", "#66ccee"])
    for i, n in enumerate(names):
        left.scatter([i] * len(e[n]["runs_tokens_per_s"]), e[n]["runs_tokens_per_s"], color="black", s=12)
    left.set_ylabel("tokens/s (64 x 64 via the gateway)")
    left.set_title(f"second replica costs {e['cost_of_second_replica']:.1%}")
    right.hist(f["error_delays_s"], bins=20, color="#cc6677")
    right.set_xlabel("seconds from SIGKILL to the client's UNAVAILABLE")
    right.set_ylabel("streams")
    right.set_title(f"{f['failed']} of {f['streams']} streams on the killed replica; last after "
                    f"{f['kill_to_last_error_s'] or 0:.3f}s")
    fig.suptitle(f"aiserve fleet, {report['machine'].get('cpu', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    store = ModelStore(model_store_path().resolve())
    folder, _ = store.load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    full = [Arrival(0.0, t, chat_ids(tok, t), 64) for t in prompts(64)]
    report: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory() as home_one, tempfile.TemporaryDirectory() as home_two:
        one = await start_suite(Path(home_one), store)
        try:
            two = await start_suite(Path(home_two), store, replicas=2)
            try:
                print("(e) one vs two replicas ...", flush=True)
                report["e_replicas"] = await run_e(one, two, full, args.rounds)
                one.stop()
                report["f_kill"] = await run_f_supervised(two)
            finally:
                two.stop()
        finally:
            one.stop()
    return report


def show(report: dict[str, Any]) -> None:
    e, f = report["e_replicas"], report["f_kill"]
    print(json.dumps({"tokens_per_s": {n: round(e[n]["tokens_per_s"], 1) for n in ("one_replica", "two_replicas")},
                      "cost_of_second_replica": round(e["cost_of_second_replica"], 4),
                      "rss_gib": {n: round(e[n]["rss_bytes"] / 2**30, 2) for n in ("one_replica", "two_replicas")},
                      **{k: v for k, v in f.items() if k != "error_delays_s"}}, indent=1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="(e): runs of each suite, in turn; medians")
    show(run_and_write("fleet", bench, parser.parse_args(argv), plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
