"""Engine benchmark: continuous batching against Hugging Face `generate`,
measured in the same run on the same machine, greedy; the engine in the precision "auto" picks
for this CPU, Hugging Face in the dtype it runs fastest in here (``--hf-dtype``).

    .venv/bin/python -m bench.engine_bench [--sweep 1 4 8 16 32 64] [--mixed 48]

(a) 64 concurrent requests of 64 new tokens, through the gateway and directly against inference,
    vs one static HF batch of 64 (``--rounds`` runs of each, in turn; medians) and vs sequential
    HF (a few requests, expressed as a rate);
(b) one request alone vs HF on one request; (c) a mixed workload (arrivals spread over time,
    max_new_tokens 16-256) through the gateway vs static HF batches at the same concurrency,
    with TTFT and inter-token latency (``--rounds`` runs through the gateway, medians; each HF
    batch timed once, the batches spread over the rounds), and again on a second suite with
    speculative decoding off, to show what continuous batching alone gives; (c)'s drafted and
    confirmed tokens are its own (the service's counters read before and after its rounds);
    (d) the batch-size sweep (in-process engine, fixed-length outputs): throughput and latency
    against max_num_seqs, with the knee marked.
Other benchmarks may ride on (a)'s rounds (``Leg``): ``make bench`` runs the fleet bench's second
suite and the HTTP door there (bench/shared_rounds.py), so that (a)'s gateway runs are also their
other side instead of being measured two more times.
The gateway has no ignore_eos, so (a)-(c) count useful completion tokens (up to and including
each answer's EOS) on both sides, with prompts that ask for long answers.
Writes bench/results/engine.json and engine.png.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoTokenizer

from aiserve.common.paths import model_store_path
from aiserve.model_facts import read_model_facts
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from bench.engine_report import add_ratios, plot
from bench.hf_baseline import HF, best_dtype, hf_sequential, hf_static, static_groups, static_schedule, time_group
from bench.measure import Laps, machine, median_run, run_and_write
from bench.served import Served, speculation_between, speculation_stats, start_suite
from bench.sweep import knee, sweep_one
from bench.workload import Arrival, chat_ids, prompts
from services.inference.model import TORCH_DTYPES
from suite.runner import Suite


class Leg(Protocol):
    """Another benchmark's run of (a)'s workload, in each of (a)'s rounds beside its gateway run."""

    name: str

    async def warm(self, work: Sequence[Arrival]) -> None:
        """Before the first round, with (a)'s workload (as (a)'s own warm-up)."""

    async def run(self, work: Sequence[Arrival]) -> dict[str, Any]:
        """One run of ``work``: run_schedule's figures."""

    async def finish(self, runs: Sequence[dict[str, Any]], gateway: Sequence[dict[str, Any]]) -> None:
        """After the last round: its own runs and (a)'s gateway runs of the same rounds."""


Legs = Callable[[Suite, Served], Awaitable[Sequence[Leg]]]
"""Builds the legs once (a)'s suite serves, given that suite and its ``Served``."""


async def run_sweep(folder: Path, ids: Sequence[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """(d): the in-process engine at each size, one after the other."""
    points = [await sweep_one(folder, size, ids, args.sweep_tokens) for size in args.sweep]
    return {"new_tokens": args.sweep_tokens, "ignore_eos": True, "points": points, "knee": knee(points)}


async def run_a_b(served: Served, hf: HF, full: Sequence[Arrival], args: argparse.Namespace,
                  legs: Sequence[Leg] = (), laps: Laps | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a) 64 x 64 in rounds, each side in turn, so a slow minute of the VM hits all of them:
    HF, the engine directly, then the gateway and ``legs`` (that order, reversed every other
    round, so none always runs first), each leg finished after the last round; then (b) one
    request alone. ``laps``: the rounds', the legs' finish and the rest's seconds."""
    laps = laps or Laps()
    ids = [a.prompt_ids for a in full]
    sides: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "gateway": lambda: served.run(full, "gateway"), **{leg.name: partial(leg.run, full) for leg in legs}}
    runs: dict[str, list[dict[str, Any]]] = {"hf_static": [], "direct": [], **{name: [] for name in sides}}
    for turn in range(args.rounds):
        runs["hf_static"].append(hf_static(hf, ids, 64))
        runs["direct"].append(await served.run(full, "inference"))
        for name in sides if turn % 2 == 0 else reversed(sides):
            runs[name].append(await sides[name]())
    laps.lap("a_rounds")
    for leg in legs:
        await leg.finish(runs[leg.name], runs["gateway"])
    laps.lap("a_legs_finish")
    a = {name: median_run(runs[name]) for name in ("hf_static", "direct", "gateway")}
    a["hf_sequential"] = hf_sequential(hf, ids[: args.sequential], 64)
    alone = [Arrival(0.0, full[0].text, full[0].prompt_ids, 64)]
    b = {"hf": a["hf_sequential"], "direct": await served.run(alone, "inference"),
         "gateway": await served.run(alone, "gateway")}
    laps.lap("a_hf_sequential_and_b")
    return a, b


async def run_c(served: Served, hf: HF | None, mixed: Sequence[Arrival], concurrency: int, rounds: int
                ) -> dict[str, Any]:
    """(c) the mixed workload in rounds (one run is ~20 s, and the VM's speed drifts by more than
    5%): through the gateway every round, and static HF batches (unless ``hf`` is None) spread
    over the rounds: batch ``g`` is timed in round ``g % rounds``, before that round's gateway
    run, and the baseline is the batches replayed on one clock (static_schedule). HF's greedy
    batches give the same tokens every time, so timing each one every round measured nothing
    new and took three times as long (~100 s a round in float32). Not directly against
    inference: what the gateway costs is (a)'s ``gateway_cost``."""
    groups = static_groups(mixed, concurrency)
    timed: dict[int, tuple[float, list[list[int]]]] = {}
    gateway: list[dict[str, Any]] = []
    for turn in range(rounds):
        if hf is not None:
            for g in range(turn, len(groups), rounds):
                timed[g] = time_group(hf, groups[g])
        gateway.append(await served.run(mixed, "gateway", concurrency))
    c = {"gateway": median_run(gateway)}
    if hf is not None:
        c["hf_static"] = {**static_schedule(groups, [timed[g] for g in range(len(groups))], hf.eos),
                          "group_timed_in_round": [g % rounds + 1 for g in range(len(groups))]}
    return c


async def run_served(folder: Path, store: ModelStore, full: Sequence[Arrival], mixed: Sequence[Arrival],
                     args: argparse.Namespace, legs: Legs | None = None, laps: Laps | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(a), (b) and (c) against a suite with the default settings, HF loaded beside it (the two
    never run at once), and ``legs`` riding on (a); ``laps``: where that time went."""
    laps = laps or Laps()
    eos = read_model_facts(folder).eos_token_ids
    with tempfile.TemporaryDirectory() as home:
        suite = await start_suite(Path(home), store)
        try:
            served = Served(suite, suite.dev_key_path.read_text().strip())
            riders = await legs(suite, served) if legs else ()
            hf = HF(folder, eos, TORCH_DTYPES[args.hf_dtype])
            hf.generate([full[0].prompt_ids], 4)  # warm-up
            await served.run(full[:2], "inference")
            await served.run(full[:2], "gateway")
            for leg in riders:
                await leg.warm(full)
            laps.lap("suites_hf_and_warm_up")
            a, b = await run_a_b(served, hf, full, args, riders, laps)
            before = await speculation_stats(suite)
            c = {"concurrency": args.concurrency, "requests": args.mixed, "spread_s": args.mixed_spread_s,
                 **await run_c(served, hf, mixed, args.concurrency, args.rounds)}
            c["speculation"] = speculation_between(before, await speculation_stats(suite))
            laps.lap("c_rounds")
            del hf
        finally:
            suite.stop()
    return a, b, c


async def run_no_speculation(store: ModelStore, full: Sequence[Arrival], mixed: Sequence[Arrival],
                             args: argparse.Namespace) -> dict[str, Any]:
    """(c) again on a second suite with speculative decoding off: what continuous batching alone gives."""
    with tempfile.TemporaryDirectory() as home:
        suite = await start_suite(Path(home), store, {"AISERVE_INFERENCE_NUM_SPECULATIVE_TOKENS": "0"})
        try:
            served = Served(suite, suite.dev_key_path.read_text().strip())
            await served.run(full[:2], "gateway")
            return await run_c(served, None, mixed, args.concurrency, args.rounds_no_spec)
        finally:
            suite.stop()


async def bench(args: argparse.Namespace, legs: Legs | None = None) -> dict[str, Any]:
    """Every part, in the order (d), (a)-(c) (``legs`` riding on (a)), (c) without speculation;
    the report with its ratios."""
    store = ModelStore(model_store_path().resolve())
    folder, _ = store.load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    texts = prompts(64)
    ids = [chat_ids(tok, t) for t in texts]
    rng = random.Random(7)
    mixed = sorted((Arrival(rng.uniform(0, args.mixed_spread_s), texts[i % 64], ids[i % 64], rng.randint(16, 256))
                    for i in range(args.mixed)), key=lambda a: a.at_s)
    full = [Arrival(0.0, t, i, 64) for t, i in zip(texts, ids, strict=True)]
    report: dict[str, Any] = {"machine": {**machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
                              "engine_precision": "auto (services/inference/precision.py)", "hf_dtype": args.hf_dtype}
    laps = Laps()  # where the bench's own time goes
    print("sweep ...", flush=True)
    report["d_sweep"] = await run_sweep(folder, ids, args)
    laps.lap("d_sweep")
    print("served and HF ...", flush=True)
    served_laps = Laps()
    a, b, c = await run_served(folder, store, full, mixed, args, legs, served_laps)
    laps.lap("a_b_c_served_and_hf")
    print("(c) with speculative decoding off ...", flush=True)
    c["no_speculation"] = await run_no_speculation(store, full, mixed, args)
    laps.lap("c_no_speculation")
    part_s = {**laps.seconds, "a_b_c_split": served_laps.seconds}
    add_ratios(a, b, c)
    report.update(a_64_concurrent=a, b_alone=b, c_mixed=c, part_s=part_s)
    return report


def parser(prog: str = "python -m bench.engine_bench", description: str = __doc__.split("\n")[0]
           ) -> argparse.ArgumentParser:
    """The engine bench's settings (also those of bench/shared_rounds.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--sweep-tokens", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=3, help="HF requests timed one at a time")
    parser.add_argument("--rounds", type=int, default=3,
                        help="(a) and (c): runs of each side, in turn; medians reported")
    parser.add_argument("--rounds-no-spec", type=int, default=1,
                        help="(c) without speculative decoding: runs (it measures no ratio, so one)")
    parser.add_argument("--hf-dtype", default=best_dtype(), choices=sorted(TORCH_DTYPES),
                        help="the baselines' dtype; default: the fastest on this CPU")
    parser.add_argument("--mixed", type=int, default=48)
    parser.add_argument("--mixed-spread-s", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=16)
    return parser


def show(report: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in report.items() if k != "d_sweep"}, indent=1)[:4000])
    print("sweep:", [(p["max_num_seqs"], round(p["tokens_per_s"]), p["time_per_token"]["p50_ms"]) for p in
                     report["d_sweep"]["points"]], "knee", report["d_sweep"]["knee"])


def main(argv: Sequence[str] | None = None) -> int:
    show(run_and_write("engine", bench, parser().parse_args(argv), plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
