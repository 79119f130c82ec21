"""The autoscaling simulator's inputs: one replica's measured figures and an arrival trace.

Figures come from deploy/autoscaling/figures.yaml (throughput against concurrency, answer length,
cold start, the CPU they were measured on) or from a bench JSON holding a batch-size sweep
(bench/results/engine.json, ``d_sweep``), whose tokens/s at each ``max_num_seqs`` is the
throughput of a replica running that many requests at once. A trace is requests arriving per
second: a CSV ``second,arrivals`` or a JSON list of counts.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services.inference.engine_config import SchedulerConfig

FIGURES_PATH = Path(__file__).resolve().parent.parent / "deploy" / "autoscaling" / "figures.yaml"
TRACES_PATH = FIGURES_PATH.parent / "traces"


@dataclass(frozen=True)
class Figures:
    """One replica as measured: `throughput_tok_s` holds (concurrency, aggregate tokens/s) pairs,
    ascending, the last at `max_concurrency` (the engine's max_num_seqs)."""

    cpu: str
    answer_tokens: int
    throughput_tok_s: tuple[tuple[int, float], ...]
    cold_start_s: float
    max_concurrency: int
    max_queue: int
    """Requests a replica lets wait at once; one more is refused (RESOURCE_EXHAUSTED)."""

    def throughput(self, running: int) -> float:
        """Aggregate tokens/s of a replica running `running` requests (linear between points)."""
        xs = [0] + [c for c, _ in self.throughput_tok_s]
        ys = [0.0] + [t for _, t in self.throughput_tok_s]
        return float(np.interp(running, xs, ys))

    def latency_s(self, running: int) -> float:
        """Seconds one request takes while `running` requests share the replica."""
        return running * self.answer_tokens / self.throughput(running)


def _points(raw: dict[Any, Any], max_concurrency: int) -> tuple[tuple[int, float], ...]:
    points = sorted((int(c), float(t)) for c, t in raw.items())
    kept = tuple(p for p in points if p[0] <= max_concurrency)
    if not kept or kept[-1][0] != max_concurrency or any(t <= 0 for _, t in kept):
        raise ValueError(f"figures: throughput needs positive points up to max_num_seqs = {max_concurrency}, "
                         f"got {points}")
    return kept


def load_figures(path: Path = FIGURES_PATH) -> Figures:
    """Figures from a figures YAML, or from a bench JSON's batch-size sweep (cold start then taken
    from the shipped figures, which a sweep does not measure). Concurrency is capped at the
    engine's default max_num_seqs and the queue at its max_queue (SchedulerConfig)."""
    engine = SchedulerConfig()
    raw = yaml.safe_load(path.read_text())  # JSON is YAML
    if "d_sweep" in raw:
        shipped = load_figures(FIGURES_PATH) if path != FIGURES_PATH else None
        sweep = raw["d_sweep"]
        points = {p["max_num_seqs"]: p["tokens_per_s"] for p in sweep["points"]}
        cpu = raw.get("machine", {}).get("cpu", "unknown CPU")
        return Figures(cpu=f"{cpu} ({path.name}, batch-size sweep)", answer_tokens=int(sweep["new_tokens"]),
                       throughput_tok_s=_points(points, engine.max_num_seqs),
                       cold_start_s=shipped.cold_start_s if shipped else 7.0,
                       max_concurrency=engine.max_num_seqs, max_queue=engine.max_queue)
    return Figures(cpu=str(raw["cpu"]), answer_tokens=int(raw["answer_tokens"]),
                   throughput_tok_s=_points(raw["throughput_tok_s"], engine.max_num_seqs),
                   cold_start_s=float(raw["cold_start_s"]), max_concurrency=engine.max_num_seqs,
                   max_queue=engine.max_queue)


def load_trace(path: Path) -> np.ndarray:
    """Requests arriving in each second, from a CSV (header ``second,arrivals``, seconds 0, 1, ...
    in order) or a JSON list of counts."""
    if path.suffix == ".json":
        counts = json.loads(path.read_text())
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        if [int(r["second"]) for r in rows] != list(range(len(rows))):
            raise ValueError(f"{path}: seconds must run 0, 1, 2, ... without gaps")
        counts = [r["arrivals"] for r in rows]
    trace = np.asarray([int(c) for c in counts], dtype=np.int64)
    if trace.size == 0 or (trace < 0).any():
        raise ValueError(f"{path}: a trace needs at least one second and no negative count")
    return trace
