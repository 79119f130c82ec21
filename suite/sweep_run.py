"""``aiserve sweep``: run a grid of sampling parameters over prompts through a running suite.

Every (prompt, grid point) pair is one ``Gateway.Complete`` call as a client makes it (the API
key in "authorization"), with the sweep's seed, the cache bypassed (so every output is
generated, not replayed), at most ``--concurrency`` calls in flight and a deadline on each. A
call that fails becomes a cell with its error; the command then exits 1 after writing the page
(the other outputs are still worth reading). Writes ``sweep.json`` (suite/sweep.py
``SweepResults``) and ``sweep.html`` (suite/sweep_page.py) into ``--out``.

Same seed, same grid, same prompts, same model -> the same outputs, as long as the engine's
arithmetic does not depend on which requests share a batch: float32 makes it so
(docs/engine.md); in bfloat16 pass ``--concurrency 1`` to get the same batches every time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import grpc
from grpc import aio

from aiserve.common.context import AUTHORIZATION_KEY, REQUEST_ID_KEY
from aiserve.common.paths import DEV_KEY_FILE, aiserve_home
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from suite.chat import read_key
from suite.sweep import (
    DEFAULT_GRID,
    DEFAULT_PROMPTS,
    Cell,
    GridError,
    GridPoint,
    Prompt,
    SweepResults,
    load_prompts,
    parse_grid,
)
from suite.sweep_page import render_page


def _request(prompt: Prompt, point: GridPoint, seed: int, max_new_tokens: int,
             model: str) -> gateway_pb2.GenerateRequest:
    """The Complete request of one pair: the prompt as a user turn, the point's parameters."""
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, seed=seed)
    for key, value in point.values:
        setattr(sampling, key, int(value) if key == "top_k" else value)
    request = gateway_pb2.GenerateRequest(sampling=sampling, model=model, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    request.chat.messages.add(role="user", content=prompt.text)
    return request


async def _one(stub: gateway_pb2_grpc.GatewayStub, key: str, request: gateway_pb2.GenerateRequest,
               prompt: Prompt, point: GridPoint, timeout_s: float) -> Cell:
    """One call; its failure becomes the cell's error."""
    metadata = ((REQUEST_ID_KEY, f"sweep-{uuid.uuid4().hex[:16]}"), (AUTHORIZATION_KEY, f"Bearer {key}"))
    try:
        reply = await stub.Complete(request, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        return Cell(prompt.id, point.label, "", 0, 0.0, 0.0, 0.0, "", error=error)
    reason = common_pb2.FinishReason.Name(reply.finish_reason).removeprefix("FINISH_REASON_").lower()
    return Cell.of(prompt.id, point, reply.text, list(reply.token_ids), reason)


async def run_sweep(address: str, key: str, prompts: Sequence[Prompt], points: Sequence[GridPoint], *,
                    seed: int, max_new_tokens: int, concurrency: int, timeout_s: float,
                    model: str = "") -> list[Cell]:
    """Every prompt at every point, at most ``concurrency`` calls at once; cells in prompt, then
    point order."""
    gate = asyncio.Semaphore(concurrency)
    async with aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def bounded(prompt: Prompt, point: GridPoint) -> Cell:
            async with gate:
                request = _request(prompt, point, seed, max_new_tokens, model)
                return await _one(stub, key, request, prompt, point, timeout_s)

        return list(await asyncio.gather(*(bounded(p, g) for p in prompts for g in points)))


def write_results(results: SweepResults, out: Path) -> tuple[Path, Path]:
    """``sweep.json`` and ``sweep.html`` in ``out`` (created); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    data, page = out / "sweep.json", out / "sweep.html"
    data.write_text(results.to_json(), encoding="utf-8")
    page.write_text(render_page(results), encoding="utf-8")
    return data, page


def cmd_sweep(args: argparse.Namespace) -> int:
    """``aiserve sweep``: 0 when every call answered, 1 when some failed, 2 for a usage error."""
    if args.render:
        results = SweepResults.from_json(Path(args.render).read_text(encoding="utf-8"))
        print(write_results(results, Path(args.out))[1])
        return 0
    if args.concurrency < 1 or args.max_new_tokens < 1 or args.timeout <= 0:
        print("aiserve: --concurrency, --max-new-tokens and --timeout must be positive", file=sys.stderr)
        return 2
    key = args.key or os.environ.get("AISERVE_API_KEY") or read_key(aiserve_home() / DEV_KEY_FILE)
    if not key:
        print("aiserve: no API key: pass --key, set AISERVE_API_KEY, or start the suite", file=sys.stderr)
        return 2
    try:
        points, prompts = parse_grid(args.grid), load_prompts(Path(args.prompts))
    except (GridError, ValueError, OSError) as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    print(f"sweeping {len(prompts)} prompts x {len(points)} grid points through {args.address} ...", file=sys.stderr)
    started = datetime.now(UTC)
    cells = asyncio.run(run_sweep(args.address, key, prompts, points, seed=args.seed, model=args.model,
                                  max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                  timeout_s=args.timeout))
    seconds = (datetime.now(UTC) - started).total_seconds()
    results = SweepResults(seed=args.seed, max_new_tokens=args.max_new_tokens, grid=args.grid, prompts=prompts,
                           points=[p.label for p in points], cells=cells, model=args.model,
                           meta={"started": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "seconds": f"{seconds:.0f}",
                                 "concurrency": str(args.concurrency)})
    data, page = write_results(results, Path(args.out))
    failed = [c for c in cells if c.error]
    for cell in failed[:5]:
        print(f"aiserve: {cell.prompt_id} at {cell.point}: {cell.error}", file=sys.stderr)
    print(f"wrote {page} and {data} ({len(cells) - len(failed)} outputs, {len(failed)} failed, {seconds:.0f}s)")
    return 1 if failed else 0


def add_sweep_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``sweep`` on the ``aiserve`` parser."""
    sweep = sub.add_parser("sweep", help="outputs over a grid of sampling parameters, as an HTML page to judge")
    sweep.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                       help="JSON list of {id, kind, text}, or a text file, one prompt a line")
    sweep.add_argument("--grid", default=DEFAULT_GRID, help=f'"key=v1,v2 ..." (default "{DEFAULT_GRID}")')
    sweep.add_argument("--seed", type=int, default=0, help="every call's seed (same seed, same outputs)")
    sweep.add_argument("--max-new-tokens", type=int, default=96)
    sweep.add_argument("--concurrency", type=int, default=4, help="calls in flight at once")
    sweep.add_argument("--timeout", type=float, default=120, help="seconds each call may take")
    sweep.add_argument("--model", default="", help="name@version (default: the default route)")
    sweep.add_argument("--out", default="sweep", help="folder for sweep.html and sweep.json")
    sweep.add_argument("--render", metavar="JSON", help="only render the page again from a sweep.json")
    sweep.add_argument("--address", default=f"127.0.0.1:{os.environ.get('AISERVE_GATEWAY_PORT', '50051')}",
                       help="the gateway (default 127.0.0.1:$AISERVE_GATEWAY_PORT, else :50051)")
    sweep.add_argument("--key", help="API key (default $AISERVE_API_KEY, else $AISERVE_HOME/dev.key)")
    sweep.set_defaults(func=cmd_sweep)
