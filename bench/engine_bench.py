"""Engine benchmark: continuous batching against Hugging Face `generate`,
measured in the same run on the same machine, bf16, greedy.

    .venv/bin/python -m bench.engine_bench [--sweep 1 4 8 16 32 64] [--mixed 48]

(a) 64 concurrent requests of 64 new tokens, through the gateway and directly against inference,
    vs one static HF batch of 64 (``--rounds`` runs of each, in turn; medians) and vs sequential
    HF (a few requests, expressed as a rate);
(b) one request alone vs HF on one request; (c) a mixed workload (arrivals spread over time,
    max_new_tokens 16-256) vs static HF batches at the same concurrency, with TTFT and
    inter-token latency (``--rounds`` runs of each, in turn; medians), and again on a second
    suite with speculative decoding off, to show what continuous batching alone gives;
    (d) the batch-size sweep (in-process engine, fixed-length outputs): throughput and latency
    against max_num_seqs, with the knee marked.
The gateway has no ignore_eos, so (a)-(c) count useful completion tokens (up to and including
each answer's EOS) on both sides, with prompts that ask for long answers.
Writes bench/results/engine.json and engine.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from grpc import aio
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from aiserve.common.config import config_with
from aiserve.common.logging import configure_logging
from aiserve.common.paths import model_store_path
from aiserve.model_facts import read_model_facts
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from bench.cache_bench import machine, percentiles
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine
from services.inference.request import GenerateRequest
from services.inference.torch_thread import run_in_fresh_thread
from suite.runner import Suite, SuiteConfig

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = ["rivers", "mountains", "the ocean", "volcanoes", "forests", "deserts", "the moon", "glaciers",
          "bridges", "castles", "trains", "gardens", "bees", "whales", "storms", "libraries"]
TIMEOUT_S = 900


def prompts(n: int) -> list[str]:
    return [f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]} (part {i // len(TOPICS) + 1})."
            for i in range(n)]


def chat_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return list(tok.encode(str(rendered), add_special_tokens=False))


def useful(row: Sequence[int], eos: frozenset[int], limit: int) -> int:
    """Tokens up to and including the first EOS (what a server streams), at most ``limit``."""
    for i, t in enumerate(row[:limit]):
        if t in eos:
            return i + 1
    return min(len(row), limit)


# --- Hugging Face baselines ------------------------------------------------------------------

class HF:
    """transformers' ``generate``, loaded and run on fresh threads like our engine's torch work
    (services/inference/torch_thread.py), so neither side pays for the other's thread pools."""

    def __init__(self, folder: Path, eos: frozenset[int]) -> None:
        self.model = run_in_fresh_thread(lambda: AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, local_files_only=True).eval())
        self.eos, self.pad = eos, min(eos)

    def generate(self, batch: Sequence[Sequence[int]], max_new: int) -> tuple[float, list[list[int]]]:
        """One static batch (left-padded); returns seconds and each row's new ids."""
        return run_in_fresh_thread(lambda: self._generate(batch, max_new))

    def _generate(self, batch: Sequence[Sequence[int]], max_new: int) -> tuple[float, list[list[int]]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                      pad_token_id=self.pad)
        return time.perf_counter() - started, out[:, width:].tolist()


def hf_static(hf: HF, batch: Sequence[Sequence[int]], max_new: int) -> dict[str, Any]:
    seconds, rows = hf.generate(batch, max_new)
    tokens = sum(useful(r, hf.eos, max_new) for r in rows)
    return {"requests": len(batch), "useful_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def hf_sequential(hf: HF, batch: Sequence[Sequence[int]], max_new: int) -> dict[str, Any]:
    seconds, tokens = 0.0, 0
    for p in batch:
        s, rows = hf.generate([p], max_new)
        seconds += s
        tokens += useful(rows[0], hf.eos, max_new)
    return {"requests": len(batch), "useful_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def hf_static_mixed(hf: HF, work: Sequence[Arrival], concurrency: int) -> dict[str, Any]:
    """Static batches of ``concurrency`` in arrival order: a batch starts once its last request
    has arrived and the previous batch is done, and runs until its longest request ends."""
    clock, tokens, ttft, itl, tpot = 0.0, 0, [], [], []
    for i in range(0, len(work), concurrency):
        group = work[i : i + concurrency]
        start = max(clock, max(a.at_s for a in group))
        seconds, rows = hf.generate([a.prompt_ids for a in group], max(a.max_new for a in group))
        clock = start + seconds
        steps = max(len(r) for r in rows)
        for a, row in zip(group, rows, strict=True):
            n = useful(row, hf.eos, a.max_new)
            tokens += n
            ttft.append((start - a.at_s + seconds / steps) * 1000)  # the batch's first step
            itl.extend([seconds / steps * 1000] * max(n - 1, 0))
            if n > 1:
                tpot.append(seconds / steps * 1000)
    return {"useful_tokens": tokens, "seconds": clock, "tokens_per_s": tokens / clock,
            "ttft": percentiles(ttft), "inter_token": percentiles(itl), "time_per_token": percentiles(tpot)}


# --- the served engine -------------------------------------------------------------------------

@dataclass
class Arrival:
    at_s: float
    text: str
    prompt_ids: list[int]
    max_new: int


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


async def _consume(call: Any, started: float, count: Any) -> Timing:
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


class Served:
    """Calls the running suite: through the gateway (text in) or straight to inference (ids in)."""

    def __init__(self, suite: Suite, key: str) -> None:
        self.suite, self.key = suite, key

    async def one(self, a: Arrival, via: str, channel: aio.Channel) -> Timing:
        started = time.perf_counter()
        if via == "gateway":
            request = gateway_pb2.GenerateRequest(
                sampling=common_pb2.SamplingParams(max_new_tokens=a.max_new, temperature=0.0),
                cache=gateway_pb2.CACHE_POLICY_BYPASS)
            request.chat.messages.add(role="user", content=a.text)
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, timeout=TIMEOUT_S, metadata=(("authorization", f"Bearer {self.key}"),))
            return await _consume(call, started, lambda m: len(m.token_ids))
        decoding = inference_pb2.Decoding(max_new_tokens=a.max_new)
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.InferenceRequest(prompt_token_ids=a.prompt_ids, decoding=decoding), timeout=TIMEOUT_S)
        return await _consume(call, started, lambda m: len(m.token_ids))

    async def run(self, work: Sequence[Arrival], via: str, concurrency: int | None = None) -> dict[str, Any]:
        gate = asyncio.Semaphore(concurrency or len(work))
        async with aio.insecure_channel(self.suite.config.address(via)) as channel:
            t0 = time.perf_counter()

            async def at(a: Arrival) -> Timing:
                await asyncio.sleep(max(0.0, a.at_s - (time.perf_counter() - t0)))  # the arrival schedule
                async with gate:
                    timing = await self.one(a, via, channel)
                timing.ttft_ms += (time.perf_counter() - t0 - a.at_s) * 1000 - timing.total_ms  # queue at the gate
                return timing

            timings = await asyncio.gather(*(at(a) for a in work))
            seconds = time.perf_counter() - t0
        tokens = sum(t.tokens for t in timings)
        return {"requests": len(work), "useful_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "ttft": percentiles([t.ttft_ms for t in timings]),
                "inter_token": percentiles([g for t in timings for g in t.gaps_ms] or [0.0]),
                "time_per_token": tpot(timings)}


# --- the batch-size sweep ----------------------------------------------------------------------

def sweep_settings(size: int) -> dict[str, Any]:
    """The inference settings of the sweep's engine at ``max_num_seqs = size``, by their flat
    names (``AISERVE_INFERENCE_<NAME>``): a KV budget of ``size`` slots of 256 tokens of the
    default model (23,040 bytes per bf16 token) plus 64 MiB, no prefix store, a queue that
    takes every request at once, and the service's defaults for everything else."""
    return {"dtype": "bfloat16", "max_num_seqs": size, "max_num_batched_tokens": max(512, size),
            "max_queue": 4096, "kv_cache_bytes": size * 256 * 23040 + (64 << 20), "max_seq_len": 256,
            "prefix_cache_fraction": 0.0}


def sweep_engine(folder: Path, size: int) -> BatchEngine:
    """The sweep's engine at ``size``, built from its settings by the function the service uses,
    on a thread that exits (the model is loaded and the cache zero-filled there, as in the service)."""
    config = config_with(InferenceConfig, **sweep_settings(size))
    return run_in_fresh_thread(lambda: build_engine(config, folder))


async def sweep_one(folder: Path, size: int, prompt_ids: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
    engine = sweep_engine(folder, size)
    engine.start()
    n = max(8, 2 * size) if size <= 64 else size
    try:
        async def one(i: int) -> Timing:
            req = GenerateRequest(request_id=f"s{i}", prompt_token_ids=tuple(prompt_ids[i % len(prompt_ids)]),
                                  max_new_tokens=new_tokens, ignore_eos=True)
            return await _consume(engine.generate(req), time.perf_counter(), lambda e: len(e.token_ids))

        t0 = time.perf_counter()
        timings = await asyncio.gather(*(one(i) for i in range(n)))
        seconds = time.perf_counter() - t0
    finally:
        await engine.stop()
    tokens = sum(t.tokens for t in timings)
    return {"max_num_seqs": size, "requests": n, "tokens_per_s": tokens / seconds,
            "latency": percentiles([t.total_ms for t in timings]),
            "inter_token": percentiles([g for t in timings for g in t.gaps_ms]), "time_per_token": tpot(timings)}


async def start_suite(home: Path, store: ModelStore, env: dict[str, str] | None = None) -> Suite:
    """The four services on free ports under ``home``, over ``store``, with settings ``env``."""
    config = SuiteConfig.for_tests(home)
    config.extra_env.update({"AISERVE_MODEL_STORE": str(store.root), **(env or {})})
    suite = Suite(config)
    try:
        await suite.start(timeout_s=300)
    except BaseException:
        suite.stop()
        raise
    return suite


async def speculation_stats(suite: Suite) -> dict[str, Any]:
    """Drafted and confirmed tokens since the inference service started (its Stats RPC)."""
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        s = await inference_pb2_grpc.InferenceStub(channel).Stats(inference_pb2.InferenceStatsRequest(), timeout=30)
    return {"draft_tokens": s.num_draft_tokens, "accepted_draft_tokens": s.num_accepted_draft_tokens,
            "generated_tokens": s.num_generated_tokens, "steps": s.num_steps,
            "acceptance": s.num_accepted_draft_tokens / max(s.num_draft_tokens, 1)}


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput, plus every run's throughput (``runs_tokens_per_s``)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs]}


def knee(points: Sequence[dict[str, Any]]) -> int:
    """The first size past which throughput grows < 10% while p50 time per output token grows
    > 50% (per token, not per message: with speculative decoding a message may carry several)."""
    for a, b in zip(points, points[1:], strict=False):
        gain = b["tokens_per_s"] / a["tokens_per_s"] - 1
        slower = b["time_per_token"]["p50_ms"] / max(a["time_per_token"]["p50_ms"], 1e-9) - 1
        if gain < 0.10 and slower > 0.50:
            return int(a["max_num_seqs"])
    return int(points[-1]["max_num_seqs"])


# --- report ----------------------------------------------------------------------------------

def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    a = report["a_64_concurrent"]
    names = ["HF sequential", "HF static 64", "engine direct", "engine via gateway"]
    values = [a["hf_sequential"]["tokens_per_s"], a["hf_static"]["tokens_per_s"], a["direct"]["tokens_per_s"],
              a["gateway"]["tokens_per_s"]]
    axes[0].bar(names, values, color=["grey", "grey", "tab:blue", "tab:orange"])
    axes[0].set(title="(a) 64 concurrent x 64 tokens, bf16", ylabel="useful tokens/s")
    axes[0].tick_params(axis="x", rotation=20)
    c = report["c_mixed"]
    off = c["no_speculation"]
    labels = ["HF static", "direct", "via gateway", "direct,\nno spec.", "via gateway,\nno spec."]
    axes[1].bar(labels, [c["hf_static"]["tokens_per_s"], c["direct"]["tokens_per_s"], c["gateway"]["tokens_per_s"],
                         off["direct"]["tokens_per_s"], off["gateway"]["tokens_per_s"]],
                color=["grey", "tab:blue", "tab:orange", "lightsteelblue", "navajowhite"])
    axes[1].set(title=f"(c) mixed, concurrency {c['concurrency']}", ylabel="useful tokens/s")
    pts = report["d_sweep"]["points"]
    sizes = [p["max_num_seqs"] for p in pts]
    axes[2].plot(sizes, [p["tokens_per_s"] for p in pts], "o-", label="tokens/s")
    axes[2].set(title="(d) batch-size sweep", xlabel="max_num_seqs", ylabel="tokens/s", xscale="log", xticks=sizes)
    axes[2].set_xticklabels([str(s) for s in sizes])
    twin = axes[2].twinx()
    twin.plot(sizes, [p["time_per_token"]["p50_ms"] for p in pts], "s--", color="tab:red", label="p50 ms per token")
    twin.plot(sizes, [p["time_per_token"]["p99_ms"] for p in pts], "^:", color="tab:red", label="p99 ms per token")
    twin.set_ylabel("ms")
    axes[2].axvline(report["d_sweep"]["knee"], color="k", linestyle=":", label="knee")
    axes[2].legend(loc="upper left")
    twin.legend(loc="lower right")
    fig.suptitle(f"{report['machine']['cpu']}, {report['machine']['cores']} cores, torch {report['machine']['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    store = ModelStore(model_store_path().resolve())
    folder, _ = store.load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    eos = read_model_facts(folder).eos_token_ids
    texts = prompts(64)
    ids = [chat_ids(tok, t) for t in texts]
    report: dict[str, Any] = {"machine": {**machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
                              "dtype": "bfloat16"}
    rng = random.Random(7)
    mixed = sorted((Arrival(rng.uniform(0, args.mixed_spread_s), texts[i % 64], ids[i % 64], rng.randint(16, 256))
                    for i in range(args.mixed)), key=lambda a: a.at_s)

    print("sweep ...", flush=True)
    points = [await sweep_one(folder, size, ids, args.sweep_tokens) for size in args.sweep]
    report["d_sweep"] = {"new_tokens": args.sweep_tokens, "ignore_eos": True, "points": points, "knee": knee(points)}

    print("served and HF ...", flush=True)
    with tempfile.TemporaryDirectory() as home:
        suite = await start_suite(Path(home), store)
        try:
            served = Served(suite, suite.dev_key_path.read_text().strip())
            hf = HF(folder, eos)  # loaded beside the idle suite: the two never run at once
            full = [Arrival(0.0, t, i, 64) for t, i in zip(texts, ids, strict=True)]
            hf.generate([ids[0]], 4)  # warm-up
            await served.run(full[:2], "inference")
            await served.run(full[:2], "gateway")
            # (a) in rounds, each side in turn, so a slow minute of the VM hits all of them
            runs: dict[str, list[dict[str, Any]]] = {"hf_static": [], "direct": [], "gateway": []}
            for _ in range(args.rounds):
                runs["hf_static"].append(hf_static(hf, ids, 64))
                runs["direct"].append(await served.run(full, "inference"))
                runs["gateway"].append(await served.run(full, "gateway"))
            a = {name: median_run(samples) for name, samples in runs.items()}
            a["hf_sequential"] = hf_sequential(hf, ids[: args.sequential], 64)
            alone = [Arrival(0.0, texts[0], ids[0], 64)]
            b = {"hf": a["hf_sequential"], "direct": await served.run(alone, "inference"),
                 "gateway": await served.run(alone, "gateway")}
            # (c) in rounds too: one run is ~20 s, and the VM's speed drifts by more than 5%
            mixed_runs: dict[str, list[dict[str, Any]]] = {"hf_static": [], "gateway": [], "direct": []}
            for _ in range(args.rounds):
                mixed_runs["hf_static"].append(hf_static_mixed(hf, mixed, args.concurrency))
                mixed_runs["gateway"].append(await served.run(mixed, "gateway", args.concurrency))
                mixed_runs["direct"].append(await served.run(mixed, "inference", args.concurrency))
            c = {"concurrency": args.concurrency, "requests": args.mixed, "spread_s": args.mixed_spread_s,
                 **{name: median_run(samples) for name, samples in mixed_runs.items()},
                 "speculation": await speculation_stats(suite)}
            del hf
        finally:
            suite.stop()
    print("(c) with speculative decoding off ...", flush=True)
    with tempfile.TemporaryDirectory() as home:
        suite = await start_suite(Path(home), store, {"AISERVE_INFERENCE_NUM_SPECULATIVE_TOKENS": "0"})
        try:
            served = Served(suite, suite.dev_key_path.read_text().strip())
            await served.run(full[:2], "gateway")
            off_runs: dict[str, list[dict[str, Any]]] = {"gateway": [], "direct": []}
            for _ in range(args.rounds):
                off_runs["gateway"].append(await served.run(mixed, "gateway", args.concurrency))
                off_runs["direct"].append(await served.run(mixed, "inference", args.concurrency))
            c["no_speculation"] = {name: median_run(samples) for name, samples in off_runs.items()}
        finally:
            suite.stop()
    a["ratio_gateway_vs_hf_static"] = a["gateway"]["tokens_per_s"] / a["hf_static"]["tokens_per_s"]
    a["ratio_gateway_vs_hf_sequential"] = a["gateway"]["tokens_per_s"] / a["hf_sequential"]["tokens_per_s"]
    a["ratio_direct_vs_hf_static"] = a["direct"]["tokens_per_s"] / a["hf_static"]["tokens_per_s"]
    a["ratio_direct_vs_hf_sequential"] = a["direct"]["tokens_per_s"] / a["hf_sequential"]["tokens_per_s"]
    a["gateway_cost"] = 1 - a["gateway"]["tokens_per_s"] / a["direct"]["tokens_per_s"]
    b["ratio_gateway_vs_hf"] = b["gateway"]["tokens_per_s"] / b["hf"]["tokens_per_s"]
    b["ratio_direct_vs_hf"] = b["direct"]["tokens_per_s"] / b["hf"]["tokens_per_s"]
    c["ratio_gateway_vs_hf_static"] = c["gateway"]["tokens_per_s"] / c["hf_static"]["tokens_per_s"]
    c["ratio_direct_vs_hf_static"] = c["direct"]["tokens_per_s"] / c["hf_static"]["tokens_per_s"]
    for name in ("gateway", "direct"):
        off = c["no_speculation"]
        off[f"ratio_{name}_vs_hf_static"] = off[name]["tokens_per_s"] / c["hf_static"]["tokens_per_s"]
    report.update(a_64_concurrent=a, b_alone=b, c_mixed=c)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--sweep-tokens", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=3, help="HF requests timed one at a time")
    parser.add_argument("--rounds", type=int, default=3,
                        help="(a) and (c): runs of each side, in turn; medians reported")
    parser.add_argument("--mixed", type=int, default=48)
    parser.add_argument("--mixed-spread-s", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    configure_logging("bench", "warning")
    started = time.perf_counter()
    report = asyncio.run(bench(args))
    report["wall_s"] = round(time.perf_counter() - started, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / "engine.png")
    print(json.dumps({k: v for k, v in report.items() if k != "d_sweep"}, indent=1)[:4000])
    print("sweep:", [(p["max_num_seqs"], round(p["tokens_per_s"]), p["time_per_token"]["p50_ms"]) for p in
                     report["d_sweep"]["points"]], "knee", report["d_sweep"]["knee"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
