"""Writes the three arrival traces of the autoscaling simulator into deploy/autoscaling/traces/
(requests arriving per second, Poisson around a rate, seeded so that a rerun writes the same files):

- steady.csv: 20 req/s for 20 minutes, about two replicas' worth at the figures' throughput;
- burst.csv: 4 req/s for 5 minutes, 40 req/s (10x) for 5 minutes, 4 req/s for 10 minutes;
- daily.csv: a day compressed into 24 minutes (one second per minute of the day): 3 req/s at
  04:00 rising along a cosine to 30 req/s at 16:00 and back.

    .venv/bin/python scripts/autoscale_traces.py
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parent.parent / "deploy" / "autoscaling" / "traces"


def rates() -> dict[str, np.ndarray]:
    """The mean arrivals per second of each trace, second by second."""
    minute = np.arange(24 * 60)
    daily = 3 + 27 * (0.5 - 0.5 * np.cos(2 * math.pi * (minute / 60 - 4) / 24))
    return {"steady": np.full(1200, 20.0),
            "burst": np.concatenate([np.full(300, 4.0), np.full(300, 40.0), np.full(600, 4.0)]),
            "daily": daily}


def main() -> None:
    rng = np.random.default_rng(65)
    for name, rate in rates().items():
        counts = rng.poisson(rate)
        lines = [f"# {name}: requests arriving per second; written by scripts/autoscale_traces.py", "second,arrivals"]
        lines += [f"{s},{int(c)}" for s, c in enumerate(counts)]
        (TRACES / f"{name}.csv").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
