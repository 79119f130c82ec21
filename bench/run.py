"""`make bench`: the engine benchmark (bench/engine_bench.py) with the fleet one
(bench/fleet_bench.py: one vs two inference replicas, SIGKILL of a replica under load) and the
HTTP door against gRPC (bench/http_bench.py) riding on its rounds (bench/shared_rounds.py), then
the cold start (bench/cold_start.py), then constrained decoding and log-probabilities against
free text (bench/constrained_bench.py) with the int8 KV cache (bench/kv_bench.py) riding on its
rounds (bench/constrained_kv.py), then weight quantization (bench/quant_bench.py) and the
semantic cache (bench/cache_bench.py). Ends with
bench/results/report.md (bench/report.py): whatever JSON the benchmarks left, the machine named.

The bench times itself: bench/results/bench_duration.json has each benchmark's seconds and the
total, against the 15 minutes a working session can give it (docs/decisions.md, 74)."""

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import (
    cache_bench,
    cold_start,
    constrained_kv,
    quant_bench,
    report,
    shared_rounds,
)
from bench.measure import Laps

BUDGET_S = 15 * 60
"""What ``make bench`` may take on either CPU kind."""

PARTS: Sequence[tuple[str, Callable[[], int | None]]] = (
    ("engine_fleet_http", lambda: shared_rounds.main([])),
    ("cold_start", lambda: cold_start.main([])),
    ("constrained_and_kv_cache", lambda: constrained_kv.main([])),
    ("quant", lambda: quant_bench.main([])),
    ("cache", lambda: cache_bench.main([])),
)


def plot(duration: dict[str, Any], path: Path) -> None:
    """Each benchmark's seconds, stacked into one bar against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    left = 0.0
    for name, seconds in duration["parts_s"].items():
        ax.barh(["make bench"], [seconds], left=left, label=f"{name} {seconds:.0f} s")
        left += seconds
    ax.axvline(duration["budget_s"], color="red", linestyle="--", label=f"budget {duration['budget_s']} s")
    ax.set(xlabel="seconds", title=f"make bench: {duration['total_s']:.0f} s on {duration['machine']['cpu']}")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    """Runs the benchmarks in turn, stopping at the first that fails; the report and the
    durations are written either way."""
    rc, laps = 0, Laps()
    for name, run in PARTS:
        rc = run() or 0
        laps.lap(name)
        if rc:
            break
    seconds = laps.seconds
    total = round(sum(seconds.values()), 1)
    duration = {"machine": report.machine(), "parts_s": seconds, "total_s": total, "budget_s": BUDGET_S,
                "within_budget": total <= BUDGET_S, "complete": rc == 0}
    report.RESULTS.mkdir(parents=True, exist_ok=True)
    (report.RESULTS / "bench_duration.json").write_text(json.dumps(duration, indent=2) + "\n")
    plot(duration, report.RESULTS / "bench_duration.png")
    print(f"make bench: {total:.0f} s ({'within' if duration['within_budget'] else 'OVER'} the {BUDGET_S} s budget)")
    report.main()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
