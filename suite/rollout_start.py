"""``aiserve rollout start NAME@VERSION --weight W``: a new version beside the running one.

The order is the safety (docs/rollouts.md):

1. verify the version's files against its manifest (nothing starts from a tampered folder);
   with ``--eval``, also run the quality gate (``aiserve eval``, suite/evaluate.py) of the
   version against the route's stable version, in this process: a version outside its bounds
   is refused before anything starts;
2. start its own tokenizer and inference processes (``version_instances.py``) and wait for
   SERVING; nothing of the running version is touched;
3. add it to its route at weight 0 (the gateway's Admin ``AddVersion``): reachable only when
   named as ``name@version``;
4. answer a set of golden prompts through the gateway, pinned to the new version, greedy: every
   answer must be non-empty and error-free, and where its weight files are byte-identical to
   the stable version's, the text must be identical too;
5. only then set its weight (the stable version gets the rest of 100).

A failure at any step leaves the running version serving alone: the new version is removed
from the route, its processes are stopped, and the command says which step failed and why.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
from grpc import aio

from aiserve.common.paths import ADMIN_KEY_FILE, DEV_KEY_FILE, aiserve_home, model_store_path
from aiserve.store import Manifest, ModelRef, ModelStore, ModelStoreError
from aiserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.admin_key import read_admin_key
from suite.chat import read_key
from suite.evaluate import Bounds, default_bounds, evaluate, summary, write_report
from suite.version_instances import start_version, stop_version

GOLDEN_PROMPTS = (
    "What is the capital of France?",
    "What is 17 plus 25?",
    "Write one sentence about the sea.",
    "Name three colours.",
    "用一句话介绍长城。",
)
"""Short prompts of the kinds the suite serves (facts, arithmetic, writing, lists, Chinese)."""
GOLDEN_TOKENS = 24
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class RolloutError(RuntimeError):
    """A step of the rollout failed; the message says which and why."""


@dataclass(frozen=True)
class StartRequest:
    """What ``rollout start`` needs: the version, its weight, and where the suite is."""

    model: str
    weight: int
    gateway: str
    admin_key: str
    tenant_key: str
    home: Path
    store_root: Path
    timeout_s: float = 300.0
    torch_threads: int = 1
    settings: Mapping[str, str] = field(default_factory=dict)
    """The version's own settings (``AISERVE_TOKENIZER_*``, ``AISERVE_INFERENCE_*``)."""
    eval_gate: bool = False
    """Run ``aiserve eval`` against the stable version before starting anything."""
    eval_max_ppl_increase: float | None = None
    """The gate's perplexity bound, percent (None: the default of the version's scheme)."""


def weight_files(manifest: Manifest) -> dict[str, str]:
    """The model weight files of a manifest and their sha256 (tokenizer and configs left out)."""
    return {name: sha for name, sha in manifest.files.items() if name.endswith(WEIGHT_SUFFIXES)}


def same_weights(a: Manifest, b: Manifest) -> bool:
    """Whether two versions carry byte-identical weights (then greedy answers must agree)."""
    files = weight_files(a)
    return bool(files) and files == weight_files(b)


def find_stable(routes: admin_pb2.RouteList, name: str) -> str:
    """name@version of the route's stable version; RolloutError when the route is unknown."""
    for route in routes.routes:
        if route.name == name:
            for version in route.versions:
                if version.role == admin_pb2.VERSION_ROLE_STABLE:
                    return version.model
    known = ", ".join(route.name for route in routes.routes) or "none"
    raise RolloutError(f"the gateway has no route {name!r} with a stable version (routes: {known})")


def compare_answers(candidate: Sequence[str], stable: Sequence[str] | None) -> list[str]:
    """The verification's verdict on the golden answers: one line per problem ([] = passed).
    ``stable`` is given only when the weights are identical (the texts must then match)."""
    problems = [f"golden prompt {i + 1} ({GOLDEN_PROMPTS[i]!r}): empty answer"
                for i, text in enumerate(candidate) if not text.strip()]
    if stable is not None:
        problems += [f"golden prompt {i + 1} ({GOLDEN_PROMPTS[i]!r}): {a!r} differs from the stable version's {b!r}"
                     for i, (a, b) in enumerate(zip(candidate, stable, strict=True)) if a != b]
    return problems


def eval_verdict(report: Mapping[str, Any]) -> None:
    """The rollout's decision on a gate report: RolloutError listing every bound the candidate
    broke, nothing when it passed."""
    if report["problems"]:
        raise RolloutError(f"{report['candidate']} failed the quality gate against {report['reference']}, "
                           f"nothing was started:\n  " + "\n  ".join(report["problems"]))


def run_eval_gate(request: StartRequest, store: ModelStore, stable: str, out: TextIO) -> dict[str, Any]:
    """Evaluate the candidate against ``stable`` in this process, write the report under
    ``home/eval``, and apply ``eval_verdict``. Returns the report."""
    ref = ModelRef.parse(request.model)
    scheme = (store.manifest(ref).quantization or {}).get("scheme")
    bounds: Bounds = default_bounds(scheme, request.eval_max_ppl_increase)
    report = evaluate(store, ref, stable, bounds, threads=request.torch_threads)
    json_path, _ = write_report(report, request.home / "eval")
    print(summary(report) + f"\n  report: {json_path}", file=out, flush=True)
    eval_verdict(report)
    return report


async def golden_answers(channel: aio.Channel, tenant_key: str, model: str, timeout_s: float) -> list[str]:
    """The greedy answers of ``model`` (pinned) to the golden prompts, not cached; an error is
    a RolloutError naming the prompt and the status."""
    stub = gateway_pb2_grpc.GatewayStub(channel)
    answers = []
    for i, prompt in enumerate(GOLDEN_PROMPTS):
        request = gateway_pb2.GenerateRequest(
            model=model, cache=gateway_pb2.CACHE_POLICY_BYPASS,
            sampling=common_pb2.SamplingParams(max_new_tokens=GOLDEN_TOKENS, temperature=0.0))
        request.chat.messages.add(role="user", content=prompt)
        try:
            reply = await stub.Complete(request, metadata=(("authorization", f"Bearer {tenant_key}"),),
                                        timeout=timeout_s)
        except grpc.RpcError as exc:
            raise RolloutError(f"golden prompt {i + 1} on {model} failed: {exc.code().name}: "  # type: ignore[attr-defined]
                               f"{exc.details()}") from exc  # type: ignore[attr-defined]
        answers.append(reply.text)
    return answers


async def rollout_start(request: StartRequest, out: TextIO) -> None:
    """Run the steps of the module's docstring; RolloutError (with the running version still
    serving alone) when one fails."""
    ref = ModelRef.parse(request.model)
    store = ModelStore(request.store_root)
    try:
        candidate = store.verify(ref)
    except ModelStoreError as exc:
        raise RolloutError(f"{request.model} failed verification, nothing was started: {exc}") from exc
    metadata = (("authorization", f"Bearer {request.admin_key}"),)
    async with aio.insecure_channel(request.gateway) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        routes = await admin.ListRoutes(admin_pb2.ListRoutesRequest(), metadata=metadata, timeout=30)
        stable = find_stable(routes, ref.name)
        if any(v.model == request.model for r in routes.routes for v in r.versions):
            raise RolloutError(f"{request.model} is already on route {ref.name}")
        if request.eval_gate:
            print(f"evaluating {request.model} against {stable} (quality gate) ...", file=out, flush=True)
            await asyncio.to_thread(run_eval_gate, request, store, stable, out)
        print(f"starting {request.model} beside {stable} ...", file=out, flush=True)
        try:
            addresses = await start_version(request.home, request.store_root, request.model,
                                            request.timeout_s, request.torch_threads, request.settings)
        except (RuntimeError, TimeoutError) as exc:
            raise RolloutError(f"{request.model} did not start: {exc}") from exc
        try:
            await admin.AddVersion(admin_pb2.AddVersionRequest(
                model=request.model, tokenizer_target=addresses["tokenizer"],
                inference_target=addresses["inference"], weight=0), metadata=metadata, timeout=30)
            print(f"verifying {request.model} on {len(GOLDEN_PROMPTS)} golden prompts ...", file=out, flush=True)
            answers = await golden_answers(channel, request.tenant_key, request.model, request.timeout_s)
            reference = None
            if same_weights(candidate, store.verify(ModelRef.parse(stable))):
                reference = await golden_answers(channel, request.tenant_key, stable, request.timeout_s)
            if problems := compare_answers(answers, reference):
                raise RolloutError(f"{request.model} failed verification:\n  " + "\n  ".join(problems))
            await admin.SetWeights(admin_pb2.SetWeightsRequest(
                name=ref.name, weights={request.model: request.weight, stable: 100 - request.weight}),
                metadata=metadata, timeout=30)
        except BaseException as exc:
            await _withdraw(admin, metadata, request)
            if isinstance(exc, grpc.RpcError):
                raise RolloutError(f"the gateway refused {request.model}: {exc.code().name}: "  # type: ignore[attr-defined]
                                   f"{exc.details()}") from exc  # type: ignore[attr-defined]
            raise
    print(f"{request.model} verified and serving at weight {request.weight} ({stable} at "
          f"{100 - request.weight})", file=out, flush=True)


async def _withdraw(admin: admin_pb2_grpc.AdminStub, metadata: tuple[tuple[str, str], ...],
                    request: StartRequest) -> None:
    """Take a failed version off its route (if it got there) and stop its processes."""
    try:
        await admin.RemoveVersion(admin_pb2.RemoveVersionRequest(model=request.model), metadata=metadata,
                                  timeout=30)
    except grpc.RpcError:
        pass  # it never got onto the route (or the gateway is gone): nothing routes to it
    await asyncio.to_thread(stop_version, request.home, request.model)


def add_start_command(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:  # type: ignore[type-arg]
    """Register ``start`` under ``aiserve rollout`` (``common``: --address, --admin-key, --home ...)."""
    start = actions.add_parser("start", parents=[common], help="start NAME@VERSION beside the running "
                               "version, verify it, then give it a weight")
    start.add_argument("model", help="name@version, already in the model store")
    start.add_argument("--weight", type=int, default=10, help="its share of the route's traffic, 0-100 (10)")
    start.add_argument("--key", help="a tenant's API key for the golden prompts (default: the dev key)")
    start.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                       help="a setting of the version's own processes, e.g. AISERVE_INFERENCE_DTYPE=float32")
    start.add_argument("--load-timeout", type=float, default=300.0,
                       help="seconds the version may take to load, and each golden prompt (300)")
    start.add_argument("--eval", action="store_true", dest="eval_gate",
                       help="first run the quality gate (aiserve eval) against the stable version")
    start.add_argument("--eval-max-ppl-increase", type=float, default=None, metavar="PCT",
                       help="the gate's perplexity bound, percent (default: int8 1, int4 5, else 1)")
    start.set_defaults(func=cmd_rollout_start)


def cmd_rollout_start(args: argparse.Namespace) -> int:
    """Exit 0 when the version serves at its weight; 1 when a step failed (said why, and the
    running version serves alone); 2 on usage errors."""
    if not 0 <= args.weight <= 100:
        print(f"aiserve: --weight must be 0..100, got {args.weight}", file=sys.stderr)
        return 2
    settings = dict(item.partition("=")[::2] for item in args.settings)
    if bad := [name for name in settings if not name.startswith(("AISERVE_TOKENIZER_", "AISERVE_INFERENCE_"))]:
        print(f"aiserve: --set takes AISERVE_TOKENIZER_* or AISERVE_INFERENCE_* settings, got {bad[0]!r}",
              file=sys.stderr)
        return 2
    home = (Path(args.home) if args.home else aiserve_home()).resolve()
    admin_key = args.admin_key or read_admin_key(home / ADMIN_KEY_FILE)
    tenant_key = args.key or read_key(home / DEV_KEY_FILE)
    if not admin_key or not tenant_key:
        print(f"aiserve: need the admin key and a tenant key: pass --admin-key and --key, or start the "
              f"suite (it writes {home / ADMIN_KEY_FILE} and {home / DEV_KEY_FILE})", file=sys.stderr)
        return 2
    request = StartRequest(args.model, args.weight, args.address, admin_key, tenant_key, home,
                           model_store_path().resolve(), args.load_timeout, settings=settings,
                           eval_gate=args.eval_gate, eval_max_ppl_increase=args.eval_max_ppl_increase)
    try:
        asyncio.run(rollout_start(request, sys.stdout))
    except (RolloutError, ModelStoreError) as exc:
        print(f"aiserve: {exc}\nThe running version keeps serving alone.", file=sys.stderr)
        return 1
    return 0
