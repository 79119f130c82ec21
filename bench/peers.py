"""Peer benchmark (`make bench-peers`): aiserve through its gateway against vLLM's CPU build on the
same machine, same model, same prompts, in the same run.

    .venv/bin/python -m bench.peers [--rounds 3] [--vllm float32:eager bfloat16:compile]

vLLM's CPU build is installed into ``var/peers/vllm`` on first use (bench/vllm_peer.py) and
served on the model store's folder with the settings its CPU docs give for a small machine, in
each configuration asked for (default: float32 eager, and bf16 with torch.compile where the CPU
has bf16 instructions: its fastest there), one after the other against the same aiserve suite.
Both answer "What is the capital of France?" first: a wrong answer from aiserve stops the bench,
one from a peer configuration is reported and that configuration is not measured. Then, each
side in turn so a slow minute of the VM hits both:

(a) 64 concurrent chat turns "Write a short story about a robot number N." x 64 new tokens;
(a16) the same 64 requests, 16 at a time;
(b) one request alone (``--alone`` of them, one after the other, as a rate);
(c) the mixed workload of the engine bench (48 arrivals over 6 s, max_new 16-256, 16 at a time).

Each side is timed with the other one stopped (SIGSTOP, then SIGCONT and SERVING again before the
next run): an idle server's wake-ups take cores from the one being measured (``paused``).
Greedy and streaming on both sides; aiserve's semantic cache is bypassed. Tokens are the
completion tokens each server reports. Writes bench/results/peers.json and peers.png, with the
CPU (model, flags, cores) and both sides' settings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpc import aio

from aiserve.common.cpu import BF16_KINDS, machine_kind, read_cpu_flags
from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from bench.measure import RESULTS, Timing, machine, median_run, run_and_write, run_schedule
from bench.openai_stream import chat_stream
from bench.served import Served, start_suite
from bench.vllm_peer import VllmServer, VllmSettings, install, isa_shim
from bench.workload import Arrival

PEERS = Path(__file__).resolve().parent.parent / "var" / "peers"
TIMEOUT_S = 900
CHECK = "What is the capital of France? Answer in one word."


def story_prompts(n: int) -> list[str]:
    return [f"Write a short story about a robot number {i}." for i in range(n)]


def mixed_workload(n: int, spread_s: float) -> list[Arrival]:
    """The engine bench's (c): ``n`` arrivals over ``spread_s`` seconds, max_new 16-256 (seed 7)."""
    rng, texts = random.Random(7), story_prompts(64)
    return sorted((Arrival(rng.uniform(0, spread_s), texts[i % 64], [], rng.randint(16, 256)) for i in range(n)),
                  key=lambda a: a.at_s)


async def run_vllm(server: VllmServer, work: Sequence[Arrival], concurrency: int) -> dict[str, Any]:
    """``work`` against the peer's OpenAI server, ``concurrency`` at a time: the same figures as
    ``Served.run``."""
    async def one(a: Arrival) -> Timing:
        timing, _ = await chat_stream("127.0.0.1", server.port, server.model_name, a.text, a.max_new, TIMEOUT_S)
        return timing

    return await run_schedule(work, concurrency, one)


async def aiserve_answer(served: Served) -> str:
    """aiserve's greedy answer to ``CHECK`` through its gateway."""
    request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=16, temperature=0.0),
                                          cache=gateway_pb2.CACHE_POLICY_BYPASS)
    request.chat.messages.add(role="user", content=CHECK)
    async with aio.insecure_channel(served.suite.config.address("gateway")) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, timeout=60, metadata=(("authorization", f"Bearer {served.key}"),))
        return "".join([m.text_delta async for m in call])


def is_right(answer: str) -> bool:
    return "paris" in answer.lower()


async def aiserve_settings(served: Served) -> dict[str, Any]:
    """What the inference service says it runs with (its Info and Stats rpcs)."""
    async with aio.insecure_channel(served.suite.config.address("inference")) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = await stub.Info(inference_pb2.InferenceInfoRequest(), timeout=30)
        stats = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=30)
    p = info.precision
    return {"model": info.model, "device": info.device, "weights": p.weights_dtype, "matmul": p.matmul_dtype,
            "kv": p.kv_dtype, "cpu_kind": p.cpu_kind, "precision_reason": p.reason,
            "max_num_seqs": stats.max_num_seqs, "kv_total_bytes": stats.kv_total_bytes}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_configs(names: Sequence[str]) -> list[VllmSettings]:
    """``dtype:mode`` names (``bfloat16:compile``, ``float32:eager``) as the peer's settings."""
    configs = []
    for name in names:
        dtype, _, mode = name.partition(":")
        if mode not in ("eager", "compile"):
            raise SystemExit(f"--vllm {name!r}: want dtype:eager or dtype:compile")
        configs.append(VllmSettings(dtype=dtype, enforce_eager=mode == "eager"))
    return configs


def default_vllm_configs() -> list[str]:
    """float32 eager (what the peer's CPU build runs correctly everywhere) and, where the CPU has
    bf16 instructions, bf16 with torch.compile (its fastest there; on an AVX2-only CPU it answers
    wrongly, so it is not measured there; nor under an instruction-set cap that hides them)."""
    bf16 = machine_kind("cpu", read_cpu_flags()) in BF16_KINDS  # less what a cap hides
    return ["float32:eager", *(["bfloat16:compile"] if bf16 else [])]


@contextmanager
def paused(groups: Sequence[int]) -> Iterator[None]:
    """The process groups ``groups`` stopped (SIGSTOP) for the block, continued after it.

    Each side is measured with the other one stopped: an idle server is not free. Idle, vLLM's
    processes wake ~1,300 times a second (26,000 context switches in 20 s, 0.23 CPU-s; aiserve's
    suite 1,100 and 0.23), and every wake-up takes a core from a model thread of the side being
    measured: with vLLM idle beside it, aiserve at 64 streams made 552-565 tokens/s instead of
    606-651 (same machine, same hour; docs/decisions.md, decision 77)."""
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)


async def compare(served: Served, server: VllmServer, workloads: Mapping[str, tuple[Sequence[Arrival], int]],
                  rounds: int) -> dict[str, Any]:
    """Every workload against both sides in turn, ``rounds`` times, each side with the other
    stopped (``paused``); medians and the ratios."""
    suite_groups = [p.pid for p in served.suite.processes.values()]  # each service leads its own group

    async def alone(side: str, work: Sequence[Arrival], concurrency: int) -> dict[str, Any]:
        """One run of ``side`` with the other stopped; both SERVING again before it returns."""
        if side == "aiserve":
            with paused([server.process.pid]):
                result = await served.run(work, "gateway", concurrency)
        else:
            with paused(suite_groups):
                result = await run_vllm(server, work, concurrency)
        await served.suite.wait_serving(timeout_s=120)
        await asyncio.to_thread(server.wait_ready, 120)
        return result

    warm = next(iter(workloads.values()))[0][:4]
    for side in ("aiserve", "vllm"):  # warm-up, both sides
        await alone(side, warm, 4)
    report: dict[str, Any] = {}
    for name, (work, concurrency) in workloads.items():
        print(f"  {name} ...", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {"aiserve": [], "vllm": []}
        for _ in range(rounds):
            for side, samples in runs.items():
                samples.append(await alone(side, work, concurrency))
        result = {side: median_run(samples) for side, samples in runs.items()}
        result["ratio"] = round(result["aiserve"]["tokens_per_s"] / result["vllm"]["tokens_per_s"], 3)
        report[name] = result
    return report


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    store = ModelStore(model_store_path().resolve())
    folder, _ = store.load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    vllm = install(PEERS / "vllm")
    stories = [Arrival(0.0, text, [], 64) for text in story_prompts(64)]
    workloads = {"a_64_concurrent": (stories, 64), "a_16_concurrent": (stories, 16),
                 "b_alone": (stories[: args.alone], 1), "c_mixed": (mixed_workload(48, 6.0), 16)}
    report: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                              "peers": []}
    with tempfile.TemporaryDirectory() as home:
        shim = isa_shim(Path(home) / "peer-isa")
        started = time.perf_counter()
        suite = await start_suite(Path(home), store)
        try:
            served = Served(suite, suite.dev_key_path.read_text().strip())
            report["aiserve"] = {"ready_s": round(time.perf_counter() - started, 1), **await aiserve_settings(served),
                                 "answer": await aiserve_answer(served)}
            if not is_right(report["aiserve"]["answer"]):
                raise RuntimeError(f"aiserve answered wrongly: {report['aiserve']['answer']!r}")
            for settings in vllm_configs(args.vllm or default_vllm_configs()):
                print(f"vLLM {settings.dtype}, {'eager' if settings.enforce_eager else 'compile'} ...", flush=True)
                log = RESULTS / f"peers-vllm-{settings.dtype}-{'eager' if settings.enforce_eager else 'compile'}.log"
                with VllmServer(vllm, folder, free_port(), settings, log, shim) as server:
                    ready_s = round(server.wait_ready(900), 1)
                    peer: dict[str, Any] = {"settings": {**settings.describe(), "ready_s": ready_s,
                                                         "cpu_probes_capped": shim is not None}}
                    _, peer["answer"] = await chat_stream("127.0.0.1", server.port, server.model_name, CHECK, 16, 60)
                    if is_right(peer["answer"]):
                        peer.update(await compare(served, server, workloads, args.rounds))
                    report["peers"].append(peer)  # a wrong answer is reported, not measured
        finally:
            suite.stop()
    return report


WORKLOADS = (("a_64_concurrent", "64 concurrent"), ("a_16_concurrent", "16 concurrent"), ("b_alone", "alone"),
             ("c_mixed", "mixed"))


def label(peer: dict[str, Any]) -> str:
    st = peer["settings"]
    return f"vLLM {st['dtype']} {'eager' if st['enforce_eager'] else 'compile'}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    measured = [p for p in report["peers"] if "a_64_concurrent" in p]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    keys = [key for key, _ in WORKLOADS]
    width = 0.8 / (1 + len(measured))
    sides = [("aiserve (gateway)", measured[0] if measured else None, "aiserve")] + \
        [(label(p), p, "vllm") for p in measured]
    for i, (name, peer, side) in enumerate(sides):
        if peer is None:
            continue
        xs = [k + (i - len(measured) / 2) * width for k in range(len(keys))]
        left.bar(xs, [peer[k][side]["tokens_per_s"] for k in keys], width=width, label=name)
        right.bar(xs, [peer[k][side]["ttft"]["p50_ms"] / 1000 for k in keys], width=width, label=name)
    for axis, title in ((left, "tokens/s (median of rounds)"), (right, "TTFT p50 (s)")):
        axis.set_xticks(range(len(keys)), [name for _, name in WORKLOADS])
        axis.set_title(title)
        axis.legend(fontsize=8)
    m = report["machine"]
    caps = f", capped {' '.join(m['isa_caps'])}: {' '.join(m['usable_cpu_flags'])}" if m.get("isa_caps") else ""
    fig.suptitle(f"aiserve vs vLLM's CPU build, same run, {report['date']}: {m['cpu']}, {m['cores']} cores, "
                 f"{' '.join(m['cpu_flags'])}{caps}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per workload, in turn; medians")
    parser.add_argument("--alone", type=int, default=3, help="requests timed one at a time in (b)")
    parser.add_argument("--vllm", nargs="*", default=[],
                        help="peer settings, dtype:eager|compile each (default: float32:eager, plus "
                             "bfloat16:compile where the CPU has bf16 instructions)")
    args = parser.parse_args(argv)
    report = run_and_write("peers", bench, args, plot)
    for peer in report["peers"]:
        figures = {k: (round(peer[k]["aiserve"]["tokens_per_s"], 1), round(peer[k]["vllm"]["tokens_per_s"], 1),
                       peer[k]["ratio"]) for k, _ in WORKLOADS if k in peer}
        print(label(peer), figures or f"wrong answer {peer['answer']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
