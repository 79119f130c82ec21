"""Where an engine step's time goes, on this machine's CPU: the in-process engine built from the
service's settings, ``--concurrency`` chat requests decoding at once, a few steps under
torch.profiler, the operators' self time summed by kind (matmul, attention, norms and rotary,
cache writes, sampling, other ops) and set against the step's wall time; what the operators do
not cover is Python and dispatch (scheduling, building the batch, the loop over layers).

    .venv/bin/python -m bench.step_profile [--concurrency 64] [--steps 12] [--set dtype=float32 ...]

Writes bench/results/step_profile.json. Run it on each CPU kind before choosing speed work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoTokenizer

from aiserve.common.config import config_with
from aiserve.common.paths import model_store_path
from aiserve.store import ModelRef, ModelStore
from bench.measure import RESULTS, machine
from bench.workload import chat_ids
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine
from services.inference.request import GenerateRequest
from services.inference.torch_thread import run_in_fresh_thread

KINDS = (("matmul", ("linear", "mkldnn", "addmm", "mm", "matmul", "bmm")),
         ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax", "baddbmm",
                        "decode_attention")),
         ("cache write", ("index_put", "index_copy")),
         ("sampling", ("argmax", "topk", "sort", "multinomial", "max")),
         ("norm, rotary, activation", ("pow", "mean", "rsqrt", "mul", "add", "silu", "neg", "cat", "to", "copy_")))


def kind_of(name: str) -> str:
    for kind, words in KINDS:
        if any(word in name for word in words):
            return kind
    return "other ops"


def typed(value: str) -> Any:
    """A setting's value from the command line: an int, a float, or the string."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def build(overrides: dict[str, str], concurrency: int) -> Any:
    settings: dict[str, Any] = {"max_num_seqs": max(concurrency, 1), "max_queue": 4096,
                                **{k: typed(v) for k, v in overrides.items()}}
    config = config_with(InferenceConfig, **settings)
    store = ModelStore(model_store_path().resolve())
    folder, _ = store.load_path(ModelRef.parse(config.model))
    return run_in_fresh_thread(lambda: build_engine(config, folder)), folder


async def profile(args: argparse.Namespace) -> dict[str, Any]:
    overrides = dict(s.split("=", 1) for s in args.set)
    engine, folder = build(overrides, args.concurrency)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = [chat_ids(tok, f"Write a short story about a robot number {i}.") for i in range(args.concurrency)]
    runner = engine.runner
    original = runner.execute
    timings: list[float] = []
    plain: list[float] = []
    profiled: dict[str, float] = defaultdict(float)
    state = {"step": 0}

    def execute(output: Any, sampling: Any) -> Any:  # the engine's thread: time and profile decode steps
        state["step"] += 1
        is_decode = all(len(c.token_ids) == 1 for c in output.chunks) and len(output.chunks) == args.concurrency
        if not is_decode or state["step"] < 4 or len(timings) >= args.steps:
            return original(output, sampling)
        if state["step"] % 2:  # every other decode step unprofiled: the step's own time
            started = time.perf_counter()
            result = original(output, sampling)
            plain.append(time.perf_counter() - started)
            return result
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            result = original(output, sampling)
            timings.append(time.perf_counter() - started)
        for event in prof.key_averages():
            profiled[event.key] += event.self_cpu_time_total / 1e6
        return result

    runner.execute = execute
    engine.start()
    try:
        async def one(i: int) -> None:
            request = GenerateRequest(request_id=f"p{i}", prompt_token_ids=tuple(ids[i]), max_new_tokens=48,
                                      ignore_eos=True)
            async for _ in engine.generate(request):
                pass

        await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    finally:
        await engine.stop()
    return report(engine, timings, plain, profiled, overrides, args)


def report(engine: Any, timings: Sequence[float], plain: Sequence[float], profiled: dict[str, float],
           overrides: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    wall = sum(timings)
    kinds: dict[str, float] = defaultdict(float)
    for name, seconds in profiled.items():
        kinds[kind_of(name)] += seconds
    top = sorted(profiled.items(), key=lambda kv: -kv[1])[:15]
    ops = sum(kinds.values())
    return {"machine": {**machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
            "settings": overrides, "concurrency": args.concurrency, "steps": len(timings),
            "step_ms": round(1000 * sorted(plain)[len(plain) // 2], 2) if plain else None,
            "profiled_step_ms": round(1000 * wall / max(len(timings), 1), 2),
            "model": {"dtype": str(engine.model.dtype), "matmul_dtype": str(engine.model.matmul_dtype),
                      "packed": engine.model.packed_weights},
            "share_of_step": {k: round(v / wall, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
            | {"python and dispatch": round(max(0.0, wall - ops) / wall, 3)},
            "top_ops_ms_per_step": {k: round(1000 * v / len(timings), 2) for k, v in top}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="decode steps profiled (as many more run plain)")
    parser.add_argument("--set", nargs="*", default=[], help="inference settings by flat name, e.g. dtype=float32")
    parser.add_argument("--out", default="step_profile", help="file name under bench/results (no extension)")
    args = parser.parse_args(argv)
    result = asyncio.run(profile(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
