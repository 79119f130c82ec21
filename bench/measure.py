"""What every benchmark measures with: the machine it ran on, latency percentiles, a stream's
timing (first token, gaps, time per output token), and the median of repeated runs."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiserve.common.cpu import isa_caps, read_cpu_flags
from aiserve.common.logging import configure_logging


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": round(pick(0.50), 3), "p99_ms": round(pick(0.99), 3),
            "mean_ms": round(statistics.fmean(ordered), 3), "n": len(ordered)}


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The CPU flags that decide which kernels run (bf16 is emulated without avx512_bf16/amx)."""


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on: CPU model and the flags that matter, cores, load; where
    the environment caps the instruction set (``aiserve.common.cpu.isa_caps``), the caps and the
    flags the kernels may use under them."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    described = {"platform": platform.platform(), "cpu": cpu, "cpu_flags": [f for f in _CPU_FLAGS if f in flags],
                 "cores": os.cpu_count(), "python": platform.python_version(), "load_average": os.getloadavg()}
    if caps := isa_caps():
        usable = read_cpu_flags()
        described |= {"isa_caps": list(caps), "usable_cpu_flags": [f for f in _CPU_FLAGS if f in usable]}
    return described


@dataclass
class Timing:
    tokens: int = 0
    ttft_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    """Between messages: with speculative decoding a message may carry several tokens."""
    total_ms: float = 0.0
    decode_ms: float = 0.0
    """From the first token to the last."""

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for one token."""
        return self.decode_ms / (self.tokens - 1) if self.tokens > 1 else None


def tpot(timings: Sequence[Timing]) -> dict[str, float]:
    """Percentiles over requests of their time per output token."""
    return percentiles([t.tpot_ms for t in timings if t.tpot_ms is not None] or [0.0])


async def consume(call: Any, started: float, count: Any) -> Timing:
    timing, last = Timing(), started
    async for message in call:
        n = count(message)
        if n:
            now = time.perf_counter()
            if not timing.tokens:
                timing.ttft_ms = (now - started) * 1000
            else:
                timing.gaps_ms.append((now - last) * 1000)
            last, timing.tokens = now, timing.tokens + n
    timing.total_ms = (time.perf_counter() - started) * 1000
    timing.decode_ms = (last - started) * 1000 - timing.ttft_ms if timing.tokens else 0.0
    return timing


async def run_schedule(work: Sequence[Any], concurrency: int, one: Callable[[Any], Awaitable[Timing]]
                       ) -> dict[str, Any]:
    """Each arrival of ``work`` (``at_s``: seconds from the start) through ``one``, at most
    ``concurrency`` at a time; throughput and latency. TTFT includes the wait at the gate."""
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def at(a: Any) -> Timing:
        await asyncio.sleep(max(0.0, a.at_s - (time.perf_counter() - t0)))  # the arrival schedule
        async with gate:
            timing = await one(a)
        timing.ttft_ms += (time.perf_counter() - t0 - a.at_s) * 1000 - timing.total_ms  # queue at the gate
        return timing

    timings = await asyncio.gather(*(at(a) for a in work))
    seconds = time.perf_counter() - t0
    tokens = sum(t.tokens for t in timings)
    return {"requests": len(work), "useful_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft": percentiles([t.ttft_ms for t in timings]),
            "inter_token": percentiles([g for t in timings for g in t.gaps_ms] or [0.0]),
            "time_per_token": tpot(timings)}


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput, plus every run's throughput (``runs_tokens_per_s``)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs]}


class Laps:
    """Where a benchmark's own time goes: the seconds of each stretch, named as it ends."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """The stretch since the previous lap (or since the start) ends here, named ``name``."""
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 1)
        self._last = now


RESULTS = Path(__file__).resolve().parent / "results"
"""Where every benchmark writes its JSON and PNG (git-ignored)."""


def run_and_write(name: str, bench: Callable[[Any], Coroutine[Any, Any, dict[str, Any]]], args: Any,
                  plot: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """Run ``bench(args)`` with quiet logs, add its wall time, and write ``RESULTS/<name>.json``
    and ``<name>.png``; the report."""
    configure_logging("bench", "warning")
    started = time.perf_counter()
    report = asyncio.run(bench(args))
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return write_report(name, report, plot)


def write_report(name: str, report: dict[str, Any], plot: Callable[[dict[str, Any], Path], None]
                 ) -> dict[str, Any]:
    """``report`` as ``RESULTS/<name>.json`` and its plot as ``<name>.png``; the report."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{name}.png")
    return report
