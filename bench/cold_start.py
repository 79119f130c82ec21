"""Cold start: from launch until every service reports SERVING, and where the time goes.

    .venv/bin/python -m bench.cold_start [--runs 3] [--store PATH]

Each run starts the suite as ``aiserve run`` does (``suite.runner.Suite.start``: the backends
and the gateway at once, on fixed ports) on free ports, under a fresh temporary AISERVE_HOME,
over a model store that already holds the model (``--store``, else ``AISERVE_MODEL_STORE``,
else ``var/models``). It records the wall time from launch until each service reports SERVING
(its ``health_changed`` log line) and until ``Suite.start`` returns (what ``aiserve run``
prints), and, per service, the phases its log marks with ``startup`` lines
(``aiserve.common.server.log_startup``): process started -> imported -> loaded -> warmed ->
SERVING, in seconds since launch. Then it times two requests through the gateway, each with a
different prompt of ~450 tokens (the first must not pay for kernels the start left unbuilt),
and stops the suite. Medians over the runs; writes bench/results/cold_start.json and
cold_start.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from grpc import aio

from aiserve.common.paths import MODEL_STORE_ENV
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from bench.measure import consume, machine, run_and_write
from suite.config import SERVICES
from suite.runner import Suite, SuiteConfig, free_ports

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def phases(log: Path, launched: float) -> dict[str, dict[str, float]]:
    """From the log's ``startup`` lines, in order: seconds from ``launched`` (epoch seconds) to
    each phase (``at_s``) and the CPU seconds the process had used by then (``cpu_s``)."""
    at: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            seconds = datetime.fromisoformat(record["timestamp"]).timestamp() - launched
        except (ValueError, KeyError, TypeError):
            continue
        phase = record.get("phase")
        if record.get("event") != "startup" or not isinstance(phase, str) or phase in at:
            continue
        if phase == "imported":
            at["process_start"], cpu["process_start"] = round(seconds - record.get("process_age_s", 0.0), 3), 0.0
        at[phase], cpu[phase] = round(seconds, 3), record.get("cpu_s", 0.0)
    return {"at_s": at, "cpu_s": cpu}


async def first_requests(suite: Suite) -> list[dict[str, float]]:
    """Two requests through the gateway, one after the other, each a different ~450-token prompt
    and 16 new tokens, greedy, cache bypassed: time to first token and total, in ms."""
    key = suite.dev_key_path.read_text().strip()
    timings = []
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        for topic in ("rivers", "mountains"):
            request = gateway_pb2.GenerateRequest(
                sampling=common_pb2.SamplingParams(max_new_tokens=16, temperature=0.0),
                cache=gateway_pb2.CACHE_POLICY_BYPASS)
            text = " ".join(f"Fact {i} about {topic}: they matter." for i in range(50))
            request.chat.messages.add(role="user", content=f"{text} Summarise these facts.")
            started = time.perf_counter()
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, timeout=TIMEOUT_S, metadata=(("authorization", f"Bearer {key}"),))
            timing = await consume(call, started, lambda m: len(m.token_ids))
            timings.append({"ttft_ms": round(timing.ttft_ms, 1), "total_ms": round(timing.total_ms, 1),
                            "tokens": timing.tokens})
    return timings


async def one_run(store: Path) -> dict[str, Any]:
    """Start the suite once in a fresh home; its timeline, then two requests; stop it."""
    with tempfile.TemporaryDirectory(prefix="aiserve-cold-") as home:
        ports = free_ports(2 * len(SERVICES))
        config = SuiteConfig(home=Path(home), ports=dict(zip(SERVICES, ports[:len(SERVICES)], strict=True)),
                             metrics_ports=dict(zip(SERVICES, ports[len(SERVICES):], strict=True)))
        config.extra_env[MODEL_STORE_ENV] = str(store)
        suite = Suite(config)
        launched, started = time.time(), time.perf_counter()
        try:
            await suite.start(timeout_s=TIMEOUT_S)
            all_serving_s = time.perf_counter() - started
            requests = await first_requests(suite)
        finally:
            codes = await suite.shutdown()
        services = {name: phases(suite.log_path(name), launched) for name in config.instance_names}
    return {"all_serving_s": round(all_serving_s, 3), "services": services, "first_requests": requests,
            "exit_codes": codes}


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 3)


def _phase_medians(runs: Sequence[dict[str, Any]], name: str, kind: str) -> dict[str, float]:
    """Each phase's median over the runs that marked it, in the order of the first run."""
    marks = [r["services"][name][kind] for r in runs]
    return {p: _median([m[p] for m in marks if p in m]) for p in marks[0]}


def medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over ``runs``."""
    names = runs[0]["services"]
    return {
        "all_serving_s": _median([r["all_serving_s"] for r in runs]),
        "services": {name: {kind: _phase_medians(runs, name, kind) for kind in ("at_s", "cpu_s")} for name in names},
        "first_requests": [{k: _median([r["first_requests"][i][k] for r in runs]) for k in ("ttft_ms", "total_ms")}
                           for i in range(len(runs[0]["first_requests"]))],
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for index in range(args.runs):
        runs.append(await one_run(args.store))
        print(f"run {index + 1}: all SERVING after {runs[-1]['all_serving_s']:.2f} s", flush=True)
    return {"machine": machine(), "store": str(args.store), "runs": runs, "median": medians(runs)}


def plot(report: dict[str, Any], path: Path) -> None:
    """The median timeline: one bar per service, one colour per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    services = report["median"]["services"]
    fig, ax = plt.subplots(figsize=(8, 3))
    colours = {"imported": "#c6dbef", "verified": "#9ecae1", "loaded": "#4292c6", "kernels": "#2171b5",
               "warmed": "#08519c", "serving": "#31a354"}
    labelled: set[str] = set()
    for row, marks in enumerate(s["at_s"] for s in services.values()):
        previous = marks.get("process_start", 0.0)
        for phase, at in marks.items():
            if phase in colours:
                ax.barh(row, at - previous, left=previous, color=colours[phase],
                        label=None if phase in labelled else f"-> {phase}")
                labelled.add(phase)
                previous = at
    ax.set_yticks(range(len(services)), list(services))
    ax.axvline(report["median"]["all_serving_s"], color="black", linestyle="--", label="all SERVING")
    ax.set_xlabel("seconds since launch (median)")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_report(report: dict[str, Any]) -> None:
    m = report["median"]
    print(f"cold start, median of {len(report['runs'])}: all SERVING after {m['all_serving_s']} s "
          f"(runs: {[r['all_serving_s'] for r in report['runs']]})")
    print("seconds since launch [CPU seconds the process had used by then]")
    for name, marks in m["services"].items():
        cells = [f"{p} {at:.2f} [{marks['cpu_s'][p]:.2f}]" for p, at in marks["at_s"].items()]
        print(f"{name:<10} " + ", ".join(cells))
    for i, r in enumerate(m["first_requests"]):
        print(f"request {i + 1}: TTFT {r['ttft_ms']} ms, total {r['total_ms']} ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--store", type=Path, default=Path(os.environ.get(MODEL_STORE_ENV) or ROOT / "var/models"))
    args = parser.parse_args(argv)
    print_report(run_and_write("cold_start", bench, args, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
