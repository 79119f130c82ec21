"""``make bench``'s engine, fleet and HTTP benchmarks in one pass, sharing (a)'s rounds.

Each of the three measured the same 64 concurrent x 64 tokens through a one-replica suite's
gateway, three rounds each: the engine bench's (a) against Hugging Face, the fleet bench's
one-replica side against two replicas, and the HTTP bench's gRPC side against the HTTP door.
Here the engine bench runs as it does alone (bench/engine_bench.py) and the other two ride on
(a)'s rounds: each round is Hugging Face's static batch, the engine directly, the gateway, then
the HTTP door on the same suite and the gateway of a second suite with two inference replicas
(in turn, their order reversed every other round). (a)'s gateway runs are the one-replica and
the gRPC side of the others' ratios, so each ratio is still of runs in the same rounds; after
the last round the fleet bench's SIGKILL test (f) runs on the two-replica suite, which then
stops before (b). Writes what each bench writes alone: ``engine``, ``fleet`` and ``http`` .json
and .png under bench/results/.

    .venv/bin/python -m bench.shared_rounds [the engine bench's options]
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiserve.common.paths import model_store_path
from aiserve.store import ModelStore
from bench import engine_bench, fleet_bench, http_bench
from bench.engine_report import plot
from bench.measure import run_and_write
from bench.served import Served, start_suite
from suite.runner import Suite


class Riders:
    """The legs of (a) and the second suite they need (under a home of its own), stopped and
    removed however the bench ends."""

    def __init__(self) -> None:
        self.home = tempfile.TemporaryDirectory()
        self.two: Suite | None = None
        self.http: http_bench.HttpDoor | None = None
        self.fleet: fleet_bench.FleetLeg | None = None

    async def __call__(self, one: Suite, served: Served) -> Sequence[engine_bench.Leg]:
        self.two = await start_suite(Path(self.home.name), ModelStore(model_store_path().resolve()), replicas=2)
        self.http, self.fleet = http_bench.HttpDoor(one, served.key), fleet_bench.FleetLeg(one, self.two)
        return self.http, self.fleet

    def stop(self) -> None:
        try:
            if self.two is not None:
                self.two.stop()
        finally:
            self.home.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = engine_bench.parser("python -m bench.shared_rounds", __doc__.split("\n")[0]).parse_args(argv)
    riders = Riders()

    async def bench(args: Any) -> dict[str, Any]:
        try:
            return await engine_bench.bench(args, riders)
        finally:
            riders.stop()

    engine_bench.show(run_and_write("engine", bench, args, plot))
    assert riders.fleet is not None and riders.http is not None  # (a) ran them, or raised
    fleet_bench.show(riders.fleet.report)
    http_bench.show(riders.http.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
