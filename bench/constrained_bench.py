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
from collections.abc import Sequence
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


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    folder, _ = ModelStore(model_store_path().resolve()).load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    config = config_with(InferenceConfig, max_num_seqs=args.concurrency, max_seq_len=512, max_queue=4096)
    engine = run_in_fresh_thread(lambda: build_engine(config, folder))
    prompts = [_prompt(folder, t) for t in TOPICS]
    engine.start()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in WORKLOADS}
    try:
        for kind in WORKLOADS:  # warm up: kernels, and the grammar compiled once (then cached)
            await _batch(engine, kind, prompts, 4, 8)
        engine.runner.masks.per_row_s.clear()
        for turn in range(args.rounds):
            order = WORKLOADS if turn % 2 == 0 else tuple(reversed(WORKLOADS))
            for kind in order:
                print(f"round {turn + 1}: {kind} ...", flush=True)
                runs[kind].append(await _batch(engine, kind, prompts, args.concurrency, args.max_tokens))
        per_row_ms = [s * 1000 for s in engine.runner.masks.per_row_s]
    finally:
        await engine.stop()
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.constrained_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="turns of each workload; medians")
    parser.add_argument("--concurrency", type=int, default=32, help="requests per batch")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_new_tokens of each request")
    args = parser.parse_args(argv)
    report = run_and_write("constrained", bench, args, plot)
    print(json.dumps({k: round(report[k]["tokens_per_s"], 1) for k in WORKLOADS}
                     | {"json_schema_over_free": round(report["json_schema_over_free"], 3),
                        "logprobs_over_free": round(report["logprobs_over_free"], 3),
                        "mask_ms_per_row": {k: round(v, 4) for k, v in report["mask_ms_per_row"].items()}},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
