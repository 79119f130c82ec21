"""The engine bench's mixed-workload baseline (bench/engine_bench.py, bench/hf_baseline.py): the
static batches replayed on one clock, and each batch timed once, spread over the rounds; and the
other benches' legs riding on (a)'s rounds (bench/shared_rounds.py); what speculative decoding did
in (c) alone."""

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from bench.engine_bench import run_a_b, run_c
from bench.hf_baseline import HF, static_groups, static_schedule
from bench.measure import Laps
from bench.served import Served, speculation_between
from bench.workload import Arrival

EOS = frozenset({0})


def arrival(at_s: float, max_new: int, first_id: int = 5) -> Arrival:
    return Arrival(at_s, f"request at {at_s}", [first_id, 6, 7], max_new)


def test_the_batches_are_replayed_on_one_clock() -> None:
    work = [arrival(0.0, 4), arrival(1.0, 2), arrival(5.0, 3)]
    groups = static_groups(work, 2)
    assert [len(g) for g in groups] == [2, 1]
    # batch 1 waits for its second request (t=1), runs 2 s of 4 steps; batch 2 waits for t=5 and runs 3 s
    timed = [(2.0, [[9, 9, 9, 9], [9, 0, 8, 8]]), (3.0, [[9, 9, 9]])]
    result = static_schedule(groups, timed, EOS)
    assert result["seconds"] == 8.0
    assert result["useful_tokens"] == 4 + 2 + 3  # the second request stops at its EOS
    assert result["tokens_per_s"] == 9 / 8.0
    # first tokens at the end of each batch's first step, from each request's arrival: 1.5, 0.5, 1.0 s
    assert (result["ttft"]["p50_ms"], result["ttft"]["p99_ms"], result["ttft"]["n"]) == (1000.0, 1500.0, 3)
    assert result["group_seconds"] == [2.0, 3.0]


class FakeHF:
    """Records which batch it ran and when; each row runs to its limit."""

    eos = EOS

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def generate(self, batch: Sequence[Sequence[int]], max_new: int) -> tuple[float, list[list[int]]]:
        self.events.append(f"hf {batch[0][0]}")
        return 1.0, [[9] * max_new for _ in batch]


class FakeServed:
    def __init__(self, events: list[str]) -> None:
        self.events, self.speeds = events, iter([30.0, 10.0, 20.0, 40.0])

    async def run(self, work: Sequence[Arrival], via: str, concurrency: int | None = None) -> dict[str, Any]:
        self.events.append(f"{via} x{len(work)} at {concurrency}")
        return {"tokens_per_s": next(self.speeds)}


@pytest.mark.parametrize("rounds", [1, 2, 3, 4])
def test_each_static_batch_is_timed_once_over_the_rounds(rounds: int) -> None:
    work = [arrival(float(i), 2, first_id=i) for i in range(6)]  # three batches of 2, told apart by their first id
    events: list[str] = []
    c = asyncio.run(run_c(cast(Served, FakeServed(events)), cast(HF, FakeHF(events)), work, 2, rounds))
    gateway = "gateway x6 at 2"
    expected: list[str] = []
    for turn in range(rounds):
        expected += [f"hf {2 * g}" for g in range(turn, 3, rounds)] + [gateway]
    assert events == expected
    assert c["hf_static"]["group_timed_in_round"] == [g % rounds + 1 for g in range(3)]
    assert c["hf_static"]["group_seconds"] == [1.0, 1.0, 1.0]
    assert c["hf_static"]["useful_tokens"] == 12
    assert len(c["gateway"]["runs_tokens_per_s"]) == rounds


def test_without_a_baseline_only_the_gateway_runs() -> None:
    events: list[str] = []
    c = asyncio.run(run_c(cast(Served, FakeServed(events)), None, [arrival(0.0, 2)], 1, 3))
    assert events == ["gateway x1 at 1"] * 3 and "hf_static" not in c
    assert c["gateway"]["tokens_per_s"] == 20.0  # the median of 30, 10 and 20


class RecordingLeg:
    """A leg that records when it runs, and what it is finished with."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events
        self.speeds = iter([1.0, 2.0, 3.0, 4.0])
        self.finished: tuple[list[float], list[float]] | None = None

    async def warm(self, work: Sequence[Arrival]) -> None:
        raise AssertionError("run_a_b does not warm its legs (run_served does, with (a)'s own warm-up)")

    async def run(self, work: Sequence[Arrival]) -> dict[str, Any]:
        self.events.append(f"{self.name} x{len(work)}")
        return {"tokens_per_s": next(self.speeds)}

    async def finish(self, runs: Sequence[dict[str, Any]], gateway: Sequence[dict[str, Any]]) -> None:
        self.events.append(f"{self.name} finished")
        self.finished = ([r["tokens_per_s"] for r in runs], [r["tokens_per_s"] for r in gateway])


class CountingHF(FakeHF):
    def generate(self, batch: Sequence[Sequence[int]], max_new: int) -> tuple[float, list[list[int]]]:
        self.events.append(f"hf x{len(batch)}")
        return 2.0, [[9] * max_new for _ in batch]


class EveryRunServed(FakeServed):
    def __init__(self, events: list[str]) -> None:
        super().__init__(events)
        self.speeds = iter(float(10 * i) for i in range(1, 20))


def test_legs_ride_on_each_round_beside_the_gateway_and_are_finished_with_its_runs() -> None:
    events: list[str] = []
    full = [arrival(0.0, 64, first_id=i) for i in range(4)]
    http, fleet = RecordingLeg("http", events), RecordingLeg("two", events)
    args = argparse.Namespace(rounds=3, sequential=1)
    laps = Laps()
    a, b = asyncio.run(run_a_b(cast(Served, EveryRunServed(events)), cast(HF, CountingHF(events)), full, args,
                               (http, fleet), laps))
    head, gateway = ["hf x4", "inference x4 at None"], "gateway x4 at None"
    assert events[:15] == [*head, gateway, "http x4", "two x4", *head, "two x4", "http x4", gateway,
                           *head, gateway, "http x4", "two x4"]
    assert events[15:17] == ["http finished", "two finished"]  # before (b) runs
    assert events[17:] == ["hf x1", "inference x1 at None", "gateway x1 at None"]
    # the gateway ran at 20, 40 and 60 tokens/s: each leg gets those very runs as its other side
    assert http.finished == ([1.0, 2.0, 3.0], [20.0, 40.0, 60.0])
    assert fleet.finished == ([1.0, 2.0, 3.0], [20.0, 40.0, 60.0])
    assert a["gateway"]["runs_tokens_per_s"] == [20.0, 40.0, 60.0] and a["direct"]["tokens_per_s"] == 30.0
    assert b["gateway"]["tokens_per_s"] == 80.0
    # the bench's own time, split where make bench's duration is read (docs/bench-duration.md)
    assert list(laps.seconds) == ["a_rounds", "a_legs_finish", "a_hf_sequential_and_b"]


def test_without_legs_a_round_is_hf_direct_and_gateway() -> None:
    events: list[str] = []
    args = argparse.Namespace(rounds=2, sequential=1)
    asyncio.run(run_a_b(cast(Served, EveryRunServed(events)), cast(HF, CountingHF(events)),
                        [arrival(0.0, 64)], args))
    assert events == ["hf x1", "inference x1 at None", "gateway x1 at None"] * 2 + [
        "hf x1", "inference x1 at None", "gateway x1 at None"]


def test_speculation_of_c_counts_only_what_happened_between_its_two_readings() -> None:
    # The service's counters run from its start: (a) and (b) drafted before (c) began.
    before = {"draft_tokens": 40, "accepted_draft_tokens": 30, "generated_tokens": 9000, "steps": 400}
    after = {"draft_tokens": 140, "accepted_draft_tokens": 120, "generated_tokens": 15000, "steps": 900}
    c = speculation_between(before, after)
    assert {k: c[k] for k in before} == {"draft_tokens": 100, "accepted_draft_tokens": 90,
                                         "generated_tokens": 6000, "steps": 500}
    assert c["acceptance"] == pytest.approx(0.9)
    assert c["confirmed_share"] == pytest.approx(90 / 6000)


def test_speculation_that_drafted_nothing_reports_zero_shares() -> None:
    same = {"draft_tokens": 7, "accepted_draft_tokens": 5, "generated_tokens": 100, "steps": 50}
    c = speculation_between(same, same)
    assert (c["acceptance"], c["confirmed_share"]) == (0.0, 0.0)
