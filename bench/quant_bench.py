"""Weight quantization on this CPU: each scheme of ``aiserve models quantize`` against the base
version, for weight bytes, decode speed (batch 1, in turns) and quality (``aiserve eval``'s
perplexity, KL, agreement and gate). The versions are written to a scratch store beside the
real one (the base is linked, never written). Writes ``bench/results/quant.json`` and
``quant.png`` (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from bench.measure import machine, run_and_write

SCHEMES = ("int8", "int4")
QUALITY_KEYS = ("candidate_perplexity", "perplexity_change_pct", "kl_mean", "kl_max", "top1_agreement",
                "answer_agreement", "passed", "problems")


def _weight_bytes(store: ModelStore, ref: ModelRef) -> int:
    folder, manifest = store.path(ref), store.manifest(ref)
    return sum((folder / name).stat().st_size for name in manifest.files if name.endswith((".safetensors", ".pt")))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from bench.quality import evaluate_version  # noqa: PLC0415 - heavy imports, paid by this bench only
    from suite.quantize import decode_speeds, quantize_version  # noqa: PLC0415

    real = ModelStore(model_store_path().resolve())
    base = ModelRef.parse(DEFAULT_MODEL_REF)
    report: dict[str, Any] = {"machine": machine(), "base": str(base), "speed": "greedy decode, batch 1, 1 thread"}
    with tempfile.TemporaryDirectory() as scratch:
        store = ModelStore(Path(scratch))
        (store.root / base.name).mkdir(parents=True)
        (store.root / base.name / base.version).symlink_to(real.path(base))
        versions = {"base": base}
        for scheme in args.schemes:
            print(f"quantizing {scheme} ...", flush=True)
            versions[scheme] = quantize_version(store, base, scheme).ref
        speeds = decode_speeds([store.path(ref) for ref in versions.values()])
        for (name, ref), speed in zip(versions.items(), speeds, strict=True):
            entry: dict[str, Any] = {"version": str(ref), "weight_bytes": _weight_bytes(store, ref),
                                     "decode_tokens_per_s": speed.tokens_per_s}
            if name != "base":
                print(f"evaluating {name} ...", flush=True)
                quality = evaluate_version(store, ref)
                entry.update({key: quality[key] for key in QUALITY_KEYS})
                entry["speed_ratio"] = speed.tokens_per_s / speeds[0].tokens_per_s
            report[name] = entry
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["base", *[s for s in SCHEMES if s in report]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = ["#4477aa", "#ee7733", "#228833"][: len(names)]
    axes[0].bar(names, [report[n]["weight_bytes"] / 2**20 for n in names], color=colors)
    axes[0].set_ylabel("weights, MiB")
    axes[1].bar(names, [report[n]["decode_tokens_per_s"] for n in names], color=colors)
    axes[1].set_ylabel("decode tok/s (batch 1, 1 thread)")
    quantized = names[1:]
    axes[2].bar(quantized, [report[n]["perplexity_change_pct"] for n in quantized], color=colors[1:])
    axes[2].set_ylabel("perplexity change, % (gate: int8 +1, int4 +5)")
    fig.suptitle(f"aiserve weight quantization (torchao), {report['machine'].get('cpu', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    report = run_and_write("quant", bench, parser.parse_args(argv), plot)
    print(json.dumps({n: {k: report[n][k] for k in ("weight_bytes", "decode_tokens_per_s", "perplexity_change_pct",
                                                     "passed") if k in report[n]}
                      for n in ("base", *SCHEMES) if n in report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
