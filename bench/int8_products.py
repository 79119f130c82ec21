"""int8 activations in the decoder's products, measured before being built: the model's own
products as "auto" runs them on this CPU against two int8 x int8 ways torch 2.13 offers, at the
row counts a decode step has (1, 16, 64), and what int8 activations do to the model's logits.

- ``fbgemm``: ``quantized::linear_dynamic`` on per-channel int8 weights prepacked for fbgemm.
  It quantizes its input with one scale for the whole tensor, so a row's result depends on the
  rows beside it in the step; here every row is first divided by its own largest magnitude and
  one row holding +1 and -1 is appended, so the tensor's range is always [-1, 1] and each row is
  in effect quantized on its own scale (per token): the bits of a row do not depend on the batch
  (checked here, ``batch_invariant``).
- ``int_mm``: ``torch._int_mm`` (int8 x int8 -> int32, oneDNN) with per-row activation and
  per-channel weight scales applied around it.

Quality: the text of ``aiserve eval`` (its first 1,024 tokens) through the model with every
decoder product on the fbgemm way (the lm_head as it is), its activations to 7 bits and to 8,
against the model as "auto" runs it: perplexity change, mean and largest KL per token, top-1
agreement. Run it capped to AVX2 as
well, with fbgemm's own switch beside the three caps of the other benchmarks:

    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python -m bench.int8_products

Writes bench/results/int8_products.json and .png (docs/decisions.md, decision 88).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, ModelRef, ModelStore
from bench.measure import machine, run_and_write
from services.inference.evaluation import VersionRun, compare_text, load_version
from services.inference.llama import WIDE_MIN_LOGIT_ROWS, WIDE_MIN_ROWS
from services.inference.llama_weights import Layer, Linear
from services.inference.offline import OfflineModel

ROWS = (1, 16, 64)
PRODUCTS = ("qkv", "o", "gate_up", "down")


class FbgemmRows:
    """``x @ w.T`` on fbgemm's int8 kernels, each row of ``x`` quantized on its own scale; to 7
    bits (``reduce_range``, what fbgemm needs where the CPU has no VNNI: u8 x s8 pairs summed in
    16 bits would saturate) or to 8."""

    def __init__(self, w: torch.Tensor, reduce_range: bool = True) -> None:
        self.reduce_range = reduce_range
        w = w.float()
        scales = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
        qw = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.range_row = torch.zeros(1, w.shape[1])
        self.range_row[0, :2] = torch.tensor([1.0, -1.0])

    def __call__(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        rows = x.float()
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12)  # [M, 1]
        y = torch.ops.quantized.linear_dynamic(torch.cat([rows / scale, self.range_row]), self.packed,
                                               self.reduce_range)
        return (y[:-1] * scale).to(x.dtype)


class IntMmRows:
    """``x @ w.T`` on ``torch._int_mm``, per-row activation and per-channel weight scales."""

    def __init__(self, w: torch.Tensor) -> None:
        w = w.float()
        self.w_scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
        self.qw_t = (w / self.w_scale[:, None]).round().to(torch.int8).t().contiguous()  # [K, N]

    def __call__(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        rows = x.float()
        m = rows.shape[0]
        if m <= 16:  # _int_mm wants more than 16 rows on the CPU: pad with zeros
            rows = torch.cat([rows, rows.new_zeros(17 - m, rows.shape[1])])
        scale = (rows.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
        acc = torch._int_mm((rows / scale).round().to(torch.int8), self.qw_t)
        return (acc[:m].float() * scale[:m] * self.w_scale).to(x.dtype)


def _ms(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls after three untimed ones, in milliseconds."""
    for _ in range(3):
        fn()
    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def speeds(layer: Layer, head: Linear, num_layers: int, dtype: torch.dtype, repeat: int) -> dict[str, Any]:
    """Per step at each row count: the layers' four products (x ``num_layers``) and the lm_head,
    as the model runs them and on each int8 way."""
    ways: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
        "fbgemm": FbgemmRows, "int_mm": IntMmRows}
    products: dict[str, Linear] = {p: getattr(layer, p) for p in PRODUCTS} | {"lm_head": head}
    built = {name: {p: make(linear.w) for p, linear in products.items()} for name, make in ways.items()}
    out: dict[str, Any] = {}
    for m in ROWS:
        row: dict[str, Any] = {}
        for p, linear in products.items():
            x = torch.randn(m, linear.w.shape[1]).to(dtype)
            wide = m >= (WIDE_MIN_LOGIT_ROWS if p == "lm_head" else WIDE_MIN_ROWS)
            row[p] = {"model": _ms(partial(linear, x, wide), repeat),
                      **{name: _ms(partial(built[name][p], x), repeat) for name in ways}}
        row["layers_per_step_ms"] = {w: round(num_layers * sum(row[p][w] for p in PRODUCTS), 2)
                                     for w in ("model", *ways)}
        row["layers_speedup"] = {w: round(row["layers_per_step_ms"]["model"] / row["layers_per_step_ms"][w], 2)
                                 for w in ways}
        out[str(m)] = row
        print(f"{m:>3} rows: layers per step {row['layers_per_step_ms']} (x{row['layers_speedup']}); "
              f"lm_head {({w: round(v, 2) for w, v in row['lm_head'].items()})}", flush=True)
    return out


def batch_invariant(layer: Layer, dtype: torch.dtype) -> dict[str, bool]:
    """Whether a row's result is the same bits alone and among 63 other rows, per way; plain
    ``linear_dynamic`` (one scale for the tensor) for comparison."""
    w = layer.gate_up.w
    torch.manual_seed(0)
    batch = torch.randn(64, w.shape[1]) * torch.linspace(0.1, 10, 64)[:, None]  # rows of unlike ranges
    batch = batch.to(dtype)
    fb = FbgemmRows(w)
    plain = lambda x: torch.ops.quantized.linear_dynamic(x.float(), fb.packed, True)  # noqa: E731
    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fbgemm": fb, "int_mm": IntMmRows(w),
                                                               "fbgemm_one_scale": plain}
    return {name: bool(torch.equal(f(batch[:1]), f(batch)[:1])) for name, f in ways.items()}


def text_run(model: OfflineModel, ids: Sequence[int]) -> VersionRun:
    """The model's log-probabilities over ``ids`` (no tasks), as ``aiserve eval`` reads a text."""
    log_probs = torch.log_softmax(model.text_logits(ids)[:-1], dim=-1)
    return VersionRun(log_probs, torch.tensor(ids[1:]), [], str(model.model.dtype).removeprefix("torch."))


def quality(model: OfflineModel, ids: Sequence[int], base: VersionRun, reduce_range: bool) -> dict[str, Any]:
    """The text with every decoder product on ``FbgemmRows`` against ``base``, the model's own run."""
    llama = model.model
    layers = llama.layers
    llama.layers = [dataclasses.replace(layer, **cast(dict[str, Any], {p: FbgemmRows(getattr(layer, p).w, reduce_range)
                                                                         for p in PRODUCTS}))
                    for layer in layers]
    try:
        int8 = text_run(model, ids)
    finally:
        llama.layers = layers
    text = compare_text(base, int8)
    return {"tokens": len(ids), "perplexity": base.perplexity, "int8_perplexity": int8.perplexity,
            "perplexity_change_pct": 100 * (int8.perplexity / base.perplexity - 1),
            "kl_mean": text.kl_mean, "kl_max": text.kl_max, "top1_agreement": text.top1_agreement}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from suite.evaluate import MAX_TEXT_TOKENS, load_text  # noqa: PLC0415 - the eval's text, nothing else

    folder, manifest = ModelStore(model_store_path().resolve()).load_path(ModelRef.parse(DEFAULT_MODEL_REF))
    llama = load_version(folder)
    model = OfflineModel(llama)
    from services.tokenizer.tokenizer import ModelTokenizer  # noqa: PLC0415

    ids = ModelTokenizer.from_folder(folder, manifest).encode(load_text())[:MAX_TEXT_TOKENS]
    report: dict[str, Any] = {
        "machine": machine(), "fbgemm_enable_instructions": os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", ""),
        "model_dtype": str(llama.dtype).removeprefix("torch."), "layers": len(llama.layers),
        "speed_ms": speeds(llama.layers[0], llama.lm_head, len(llama.layers), llama.dtype, args.repeat),
        "batch_invariant": batch_invariant(llama.layers[0], llama.dtype)}
    print("batch invariant:", report["batch_invariant"], flush=True)
    base = text_run(model, ids)
    for bits, reduce_range in ((7, True), (8, False)):
        report[f"quality_fbgemm_{bits}_bit"] = quality(model, ids, base, reduce_range)
        print(f"quality, {bits}-bit activations:", json.dumps(report[f"quality_fbgemm_{bits}_bit"]), flush=True)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = ("model", "fbgemm", "int_mm")
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, way in enumerate(ways):
        values = [report["speed_ms"][str(m)]["layers_per_step_ms"][way] for m in ROWS]
        bars = ax.bar([j + (i - 1) * 0.27 for j in range(len(ROWS))], values, 0.27, label=way)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(ROWS)), [f"{m} rows" for m in ROWS])
    ax.set_ylabel("decoder products per step, ms (lm_head apart)")
    q = report["quality_fbgemm_7_bit"]
    caps = " ".join(report["machine"].get("isa_caps", [])) or "not capped"
    ax.set_title(f"{report['machine']['cpu']} ({caps}); 7-bit fbgemm rows: perplexity "
                 f"{q['perplexity_change_pct']:+.2f}%, top-1 {q['top1_agreement']:.3f}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_products", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per product; the fastest counts")
    parser.add_argument("--name", default="int8_products", help="the results' file name (without .json)")
    args = parser.parse_args(argv)
    run_and_write(args.name, bench, args, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
