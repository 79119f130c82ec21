"""What structured output and log-probabilities cost the engine: a batch of JSON-Schema
constrained requests, and one asking for log-probabilities (top 5), against the same batch of
free-text requests, in turns, on the in-process engine the service runs (docs/engine.md).

Every workload is ``--concurrency`` requests of up to ``--max-tokens`` tokens, greedy, on the
same prompts (asking for long lists, so most answers run to the limit). The free and logprobs
batches ignore EOS; a constrained answer ends where its grammar lets the model end it, so the
figure is tokens per second, not requests. Also the grammar mask time per row per step (p50,
p99: the fill of the bitmask plus its application to the logits). Writes
``bench/results/constrained.json`` and ``constrained.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiserve.common.config import config_with
from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from bench.measure import Timing, consume, machine, median_run, percentiles, run_and_write
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine
from services.inference.grammar import JsonConstraint
from services.inference.request import GenerateRequest
from services.inference.torch_thread import run_in_fresh_thread

LIST_SCHEMA = json.dumps({"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 60}}}, "required": ["topic", "items"]})
TOPICS = ("animals", "cities in Europe", "fruits", "programming languages", "rivers", "colors", "sports",
          "musical instruments")
WORKLOADS = ("free", "logprobs", "json_schema")


def _prompt(folder: Path, topic: str) -> tuple[int, ...]:
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = f"<|im_start|>user\nList as many {topic} as you can, as JSON.<|im_end|>\n<|im_start|>assistant\n"
    return tuple(tok.encode(text).ids)


def _request(kind: str, i: int, prompt: tuple[int, ...], max_tokens: int) -> GenerateRequest:
    if kind == "json_schema":
        return GenerateRequest(request_id=f"c{i}", prompt_token_ids=prompt, max_new_tokens=max_tokens,
                               constraint=JsonConstraint(LIST_SCHEMA))
    return GenerateRequest(request_id=f"{kind[0]}{i}", prompt_token_ids=prompt, max_new_tokens=max_tokens,
                           ignore_eos=True, top_logprobs=5 if kind == "logprobs" else None)


async def _batch(engine: BatchEngine, kind: str, prompts: Sequence[tuple[int, ...]], n: int,
                 max_tokens: int) -> dict[str, Any]:
    async def one(i: int) -> Timing:
        request = _request(kind, i, prompts[i % len(prompts)], max_tokens)
        return await consume(engine.generate(request), time.perf_counter(), lambda e: len(e.token_ids))

    steps_before = engine.stats().num_steps
    started = time.perf_counter()
    timings = await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - started
    tokens = sum(t.tokens for t in timings)
    steps = engine.stats().num_steps - steps_before
    return {"requests": n, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mean_tokens": tokens / n, "steps": steps, "ms_per_step": seconds * 1000 / max(steps, 1)}


Side = tuple[BatchEngine, str]
"""One side of the rounds: an engine and the workload it runs (one of ``WORKLOADS``)."""


def workload_engine(folder: Path, concurrency: int, kv_dtype: str = "auto") -> BatchEngine:
    """The in-process engine every workload here runs on: the service's settings but
    ``concurrency`` slots of 512 tokens, a queue that takes every request at once, and the KV
    cache stored as ``kv_dtype`` (bench/kv_bench.py's other side)."""
    config = config_with(InferenceConfig, max_num_seqs=concurrency, max_seq_len=512, max_queue=4096,
                         kv_dtype=kv_dtype)
    return run_in_fresh_thread(lambda: build_engine(config, folder))


def prompts_of(folder: Path) -> list[tuple[int, ...]]:
    return [_prompt(folder, t) for t in TOPICS]


async def warm(sides: Sequence[Side], prompts: Sequence[tuple[int, ...]]) -> None:
    """Each side's workload once, small: its kernels built, its grammar compiled (then cached)."""
    for engine, kind in sides:
        await _batch(engine, kind, prompts, 4, 8)


async def run_rounds(sides: Mapping[str, Side], prompts: Sequence[tuple[int, ...]], args: argparse.Namespace
                     ) -> dict[str, list[dict[str, Any]]]:
    """``args.rounds`` turns of every side, their order reversed every other turn (so a slow
    minute of the VM hits all of them, and none always runs first): the runs of each side."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for turn in range(args.rounds):
        for name in sides if turn % 2 == 0 else reversed(list(sides)):
            engine, kind = sides[name]
            print(f"round {turn + 1}: {name} ...", flush=True)
            runs[name].append(await _batch(engine, kind, prompts, args.concurrency, args.max_tokens))
    return runs


def report_of(engine: BatchEngine, runs: Mapping[str, Sequence[dict[str, Any]]], per_row_ms: Sequence[float],
              args: argparse.Namespace) -> dict[str, Any]:
    """constrained.json: each workload's median run, the two ratios to free text, the mask's time."""
    report: dict[str, Any] = {"machine": machine(), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                              "dtype": engine.model.dtype.__repr__().removeprefix("torch."), "schema": LIST_SCHEMA}
    for kind in WORKLOADS:
        report[kind] = median_run(runs[kind])
    free = report["free"]["tokens_per_s"]
    report["json_schema_over_free"] = report["json_schema"]["tokens_per_s"] / free
    report["logprobs_over_free"] = report["logprobs"]["tokens_per_s"] / free
    report["mask_ms_per_row"] = {**percentiles(per_row_ms), "mean_ms": statistics.fmean(per_row_ms or [0.0]),
                                 "samples": len(per_row_ms)}
    return report


@asynccontextmanager
async def started(*engines: BatchEngine) -> AsyncIterator[None]:
    """``engines`` running inside, stopped however the block ends."""
    for engine in engines:
        engine.start()
    try:
        yield
    finally:
        for engine in engines:
            await engine.stop()


async def run_with(args: argparse.Namespace, folder: Path, riders: Mapping[str, Side] | None = None
                   ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The three workloads on one engine over the model in ``folder``, in rounds, with ``riders``
    (other engines' sides, which their owner starts and stops) in the same rounds:
    constrained.json's report, and every side's runs by name (the workloads' and the riders')."""
    engine = workload_engine(folder, args.concurrency)
    prompts = prompts_of(folder)
    sides: dict[str, Side] = {kind: (engine, kind) for kind in WORKLOADS} | dict(riders or {})
    async with started(engine):
        await warm(list(sides.values()), prompts)
        engine.runner.masks.per_row_s.clear()
        runs = await run_rounds(sides, prompts, args)
    per_row_ms = [s * 1000 for s in engine.runner.masks.per_row_s]
    return report_of(engine, runs, per_row_ms, args), runs


def default_model() -> Path:
    """The default model's folder in the store, verified."""
    return ModelStore(model_store_path().resolve()).load_path(ModelRef.parse(DEFAULT_MODEL_REF))[0]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    return (await run_with(args, default_model()))[0]


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["#4477aa", "#228833", "#ee7733"]
    left.bar(list(WORKLOADS), [report[k]["tokens_per_s"] for k in WORKLOADS], color=colors)
    for i, kind in enumerate(WORKLOADS):
        left.scatter([i] * len(report[kind]["runs_tokens_per_s"]), report[kind]["runs_tokens_per_s"],
                     color="black", s=12)
    left.set_ylabel(f"tokens/s ({report['concurrency']} requests x <= {report['max_tokens']} tokens)")
    left.set_title(f"json_schema / free = {report['json_schema_over_free']:.3f}, "
                   f"logprobs / free = {report['logprobs_over_free']:.3f}", fontsize=9)
    mask = report["mask_ms_per_row"]
    right.bar(["p50", "p99", "mean"], [mask["p50_ms"], mask["p99_ms"], mask["mean_ms"]], color="#ee7733")
    right.set_ylabel("grammar mask, ms per row per step")
    right.set_title(f"{mask['samples']} steps")
    fig.suptitle(f"aiserve constrained decoding, {report['machine'].get('cpu', '')}, {report['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def options(argv: Sequence[str] | None, prog: str = "python -m bench.constrained_bench",
           description: str = __doc__.split("\n")[0]) -> argparse.Namespace:
    """The options of this bench (and of bench/constrained_kv.py, which shares its rounds)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each workload; medians")
    parser.add_argument("--concurrency", type=int, default=32, help="requests per batch")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_new_tokens of each request")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    show(run_and_write("constrained", bench, options(argv), plot))
    return 0


def show(report: dict[str, Any]) -> None:
    print(json.dumps({k: round(report[k]["tokens_per_s"], 1) for k in WORKLOADS}
                     | {"json_schema_over_free": round(report["json_schema_over_free"], 3),
                        "logprobs_over_free": round(report["logprobs_over_free"], 3),
                        "mask_ms_per_row": {k: round(v, 4) for k, v in report["mask_ms_per_row"].items()}},
                     indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
