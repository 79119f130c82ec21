"""``aiserve eval NAME@VERSION [--against NAME@VERSION]``: a candidate version against a reference,
in-process, on the data shipped in aiserve/eval_data/, with a quality gate.

Both versions are verified and run one after the other (services/inference/evaluation.py); the
report holds perplexity over the text, KL(reference || candidate) and top-1 agreement of the
next-token distributions, agreement of the greedy answers, and task accuracy per category. It
is written as JSON and as a PNG, and the command exits 1 when the candidate is outside the
bounds (``Bounds``): by default its perplexity may exceed the reference's by at most 1% for
int8 (and unquantized versions), 5% for int4. ``--against`` defaults to the version a
quantized candidate was made from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from aiserve.common.paths import aiserve_home, model_store_path
from aiserve.eval_tasks import TEXT_FILE, Task, load_tasks, load_text, score
from aiserve.store import Manifest, ModelRef, ModelStore, ModelStoreError

DEFAULT_PPL_BOUND_PCT = {"int8": 1.0, "int4": 5.0}
"""Allowed perplexity increase over the reference, percent, by the candidate's scheme."""
UNQUANTIZED_PPL_BOUND_PCT = 1.0
MAX_TEXT_TOKENS = 1024
MAX_NEW_TOKENS = 24

if TYPE_CHECKING:
    from services.inference.evaluation import VersionRun

ReferenceRuns = dict[tuple[str, int, int], "VersionRun"]
"""Reference runs kept between evaluations in one process, by (the version's folder resolved,
max_text_tokens, max_new_tokens): a run depends on nothing else, so a benchmark that evaluates
several candidates against one reference runs that reference once."""


@dataclass(frozen=True)
class Bounds:
    """Where a candidate must lie; None = not checked."""

    max_ppl_increase_pct: float
    max_kl_mean: float | None = None
    min_top1_agreement: float | None = None
    max_accuracy_drop: float | None = None  # fraction of tasks, 0..1


def default_bounds(scheme: str | None, ppl: float | None = None, kl: float | None = None,
                   top1: float | None = None, accuracy_drop: float | None = None) -> Bounds:
    """The bounds for a candidate of ``scheme`` (None: unquantized), with any given override."""
    default = DEFAULT_PPL_BOUND_PCT.get(scheme or "", UNQUANTIZED_PPL_BOUND_PCT)
    return Bounds(default if ppl is None else ppl, kl, top1, accuracy_drop)


def gate_problems(report: dict[str, Any], bounds: Bounds) -> list[str]:
    """One line per bound the candidate's report breaks ([] = it passes)."""
    problems = []
    if report["perplexity_change_pct"] > bounds.max_ppl_increase_pct:
        problems.append(f"perplexity {report['candidate_perplexity']:.4f} is {report['perplexity_change_pct']:+.2f}%"
                        f" from the reference's {report['reference_perplexity']:.4f} (bound "
                        f"{bounds.max_ppl_increase_pct:+.2f}%)")
    if bounds.max_kl_mean is not None and report["kl_mean"] > bounds.max_kl_mean:
        problems.append(f"mean KL {report['kl_mean']:.5f} nats exceeds {bounds.max_kl_mean}")
    if bounds.min_top1_agreement is not None and report["top1_agreement"] < bounds.min_top1_agreement:
        problems.append(f"top-1 agreement {report['top1_agreement']:.4f} is below {bounds.min_top1_agreement}")
    drop = report["accuracy"]["reference"]["all"] - report["accuracy"]["candidate"]["all"]
    if bounds.max_accuracy_drop is not None and drop > bounds.max_accuracy_drop:
        problems.append(f"task accuracy dropped by {drop:.3f} (bound {bounds.max_accuracy_drop})")
    return problems


def accuracy(tasks: list[Task], answers: list[str]) -> dict[str, float]:
    """Fraction of tasks answered correctly, overall ("all") and by category."""
    marks = [score(t, a) for t, a in zip(tasks, answers, strict=True)]
    result = {"all": sum(marks) / len(marks)}
    for category in dict.fromkeys(t.category for t in tasks):
        mine = [m for t, m in zip(tasks, marks, strict=True) if t.category == category]
        result[category] = sum(mine) / len(mine)
    return result


def reference_of(candidate: Manifest, against: str | None) -> ModelRef:
    """The reference: ``against``, else the base a quantized candidate was made from."""
    if against:
        return ModelRef.parse(against)
    if candidate.quantization and candidate.quantization.get("base"):
        return ModelRef.parse(candidate.quantization["base"])
    raise ModelStoreError(f"{candidate.ref} is not a quantized version: name the reference with --against")


def evaluate(store: ModelStore, candidate_ref: ModelRef, against: str | None, bounds: Bounds | None,
             max_text_tokens: int = MAX_TEXT_TOKENS, max_new_tokens: int = MAX_NEW_TOKENS,
             threads: int = 1, kv_dtype: str = "auto", references: ReferenceRuns | None = None) -> dict[str, Any]:
    """The report of ``candidate_ref`` against its reference (both verified first), verdict
    included; ``bounds`` None = the defaults of the candidate's scheme; torch on ``threads``.
    ``kv_dtype`` "int8": the candidate runs on an int8 KV cache (the reference on the model's
    own dtype), and without ``against`` the reference is the candidate's own version.
    ``references``: the reference's run is taken from there when it holds it, and kept there
    when it does not."""
    from services.inference.offline import torch_threads

    with torch_threads(threads):
        return _evaluate(store, candidate_ref, against, bounds, max_text_tokens, max_new_tokens, kv_dtype,
                         references)


def _evaluate(store: ModelStore, candidate_ref: ModelRef, against: str | None, bounds: Bounds | None,
              max_text_tokens: int, max_new_tokens: int, kv_dtype: str = "auto",
              references: ReferenceRuns | None = None) -> dict[str, Any]:
    from services.inference.evaluation import compare_text, run_version

    started = time.perf_counter()
    cand_folder, cand_manifest = store.load_path(candidate_ref)
    ref = candidate_ref if kv_dtype != "auto" and not against else reference_of(cand_manifest, against)
    ref_folder, ref_manifest = store.load_path(ref)
    text, tasks = load_text(), load_tasks()
    key = (str(ref_folder.resolve()), max_text_tokens, max_new_tokens)
    reference = references.get(key) if references is not None else None
    if reference is None:
        reference = run_version(ref_folder, ref_manifest, text, tasks, max_text_tokens, max_new_tokens)
        if references is not None:
            references[key] = reference
    candidate = run_version(cand_folder, cand_manifest, text, tasks, max_text_tokens, max_new_tokens, kv_dtype)
    compared = compare_text(reference, candidate)
    scheme = cand_manifest.quantization.get("scheme") if cand_manifest.quantization else None
    bounds = bounds or default_bounds(scheme)
    report: dict[str, Any] = {
        "candidate": str(candidate_ref), "reference": str(ref), "scheme": scheme, "candidate_kv_dtype": kv_dtype,
        "dtypes": {"candidate": candidate.dtype, "reference": reference.dtype},
        "text": {"file": f"aiserve/eval_data/{TEXT_FILE.name}", "tokens": int(reference.targets.shape[0]) + 1},
        "reference_perplexity": reference.perplexity, "candidate_perplexity": candidate.perplexity,
        "perplexity_change_pct": 100.0 * (candidate.perplexity / reference.perplexity - 1.0),
        "kl_mean": compared.kl_mean, "kl_max": compared.kl_max, "top1_agreement": compared.top1_agreement,
        "answer_agreement": sum(a == b for a, b in zip(reference.answers, candidate.answers, strict=True))
        / len(tasks),
        "accuracy": {"reference": accuracy(tasks, reference.answers), "candidate": accuracy(tasks, candidate.answers)},
        "tasks": [{"id": t.id, "category": t.category, "prompt": t.prompt, "expected": list(t.expected),
                   "reference_answer": a, "candidate_answer": b, "reference_correct": score(t, a),
                   "candidate_correct": score(t, b)}
                  for t, a, b in zip(tasks, reference.answers, candidate.answers, strict=True)],
        "kl_per_token": compared.kl_per_token,
        "bounds": asdict(bounds),
    }
    report["problems"] = gate_problems(report, bounds)
    report["passed"] = not report["problems"]
    report["seconds"] = time.perf_counter() - started
    return report


def write_png(report: dict[str, Any], path: Path) -> None:
    """Four panels: perplexity, task accuracy by category, agreements, KL along the text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ppl, acc), (agree, kl)) = plt.subplots(2, 2, figsize=(11, 7))
    names = [f"reference\n{report['reference']}", f"candidate\n{report['candidate']}"]
    ppl.bar(names, [report["reference_perplexity"], report["candidate_perplexity"]], color=["#888", "#37c"])
    ppl.set_title(f"perplexity ({report['perplexity_change_pct']:+.2f}%)")
    cats = list(report["accuracy"]["reference"])
    xs = range(len(cats))
    acc.bar([x - 0.2 for x in xs], [report["accuracy"]["reference"][c] for c in cats], 0.4, label="reference",
            color="#888")
    acc.bar([x + 0.2 for x in xs], [report["accuracy"]["candidate"][c] for c in cats], 0.4, label="candidate",
            color="#37c")
    acc.set_xticks(list(xs), cats)
    acc.set_ylim(0, 1)
    acc.set_title("task accuracy")
    acc.legend()
    agree.bar(["top-1 tokens", "greedy answers"], [report["top1_agreement"], report["answer_agreement"]],
              color="#3a7")
    agree.set_ylim(0, 1)
    agree.set_title("agreement with the reference")
    kl.plot(report["kl_per_token"], linewidth=0.7, color="#c53")
    kl.set_title(f"KL(reference || candidate) per token, mean {report['kl_mean']:.5f} nats")
    kl.set_xlabel("position in the text")
    verdict = "PASSED" if report["passed"] else "FAILED"
    fig.suptitle(f"aiserve eval: {report['candidate']} against {report['reference']}: {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``<candidate>-vs-<reference>.json`` and ``.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kv = report.get("candidate_kv_dtype", "auto")
    stem = f"{report['candidate']}{'' if kv == 'auto' else f'-kv-{kv}'}-vs-{report['reference']}".replace("@", "_")
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    write_png(report, png_path)
    return json_path, png_path


def summary(report: dict[str, Any]) -> str:
    """The report's figures in a few lines."""
    acc = report["accuracy"]
    kv = report.get("candidate_kv_dtype", "auto")
    return (f"{report['candidate']}{'' if kv == 'auto' else f' (KV cache {kv})'} against {report['reference']} "
            f"({report['text']['tokens']} tokens of text, "
            f"{len(report['tasks'])} tasks, {report['seconds']:.0f}s)\n"
            f"  perplexity {report['candidate_perplexity']:.4f} vs {report['reference_perplexity']:.4f} "
            f"({report['perplexity_change_pct']:+.2f}%, bound {report['bounds']['max_ppl_increase_pct']:+.2f}%)\n"
            f"  KL mean {report['kl_mean']:.5f} nats (max {report['kl_max']:.4f}), top-1 agreement "
            f"{report['top1_agreement']:.4f}, greedy answers agreeing {report['answer_agreement']:.3f}\n"
            f"  task accuracy {acc['candidate']['all']:.3f} vs {acc['reference']['all']:.3f}")


def cmd_eval(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Exit 0 when the candidate is within its bounds, 1 when not, 2 on usage errors."""
    store = ModelStore(model_store_path(args.store or ""))
    candidate = ModelRef.parse(args.target)
    manifest = store.manifest(candidate)
    scheme = manifest.quantization.get("scheme") if manifest.quantization else None
    bounds = default_bounds(scheme, args.max_ppl_increase, args.max_kl, args.min_top1_agreement,
                            args.max_accuracy_drop)
    report = evaluate(store, candidate, args.against, bounds, args.max_text_tokens, args.max_new_tokens, args.threads,
                      args.kv_dtype)
    json_path, png_path = write_report(report, Path(args.out) if args.out else aiserve_home() / "eval")
    print(summary(report), file=out)
    print(f"  wrote {json_path} and {png_path}", file=out)
    if report["problems"]:
        print("FAILED the gate:\n  " + "\n  ".join(report["problems"]), file=out)
        return 1
    print("passed the gate", file=out)
    return 0


def add_eval_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``aiserve eval``."""
    ev = sub.add_parser("eval", help="quality of a version against another (perplexity, KL, tasks), with a gate")
    ev.add_argument("target", help="the candidate NAME@VERSION")
    ev.add_argument("--against", help="the reference NAME@VERSION (default: a quantized version's base)")
    ev.add_argument("--max-ppl-increase", type=float, default=None, metavar="PCT",
                    help="allowed perplexity increase over the reference, percent (default: int8 1, int4 5, else 1)")
    ev.add_argument("--max-kl", type=float, default=None, help="allowed mean KL(reference || candidate), nats")
    ev.add_argument("--min-top1-agreement", type=float, default=None, help="required top-1 agreement, 0..1")
    ev.add_argument("--max-accuracy-drop", type=float, default=None, help="allowed task accuracy drop, 0..1")
    ev.add_argument("--max-text-tokens", type=int, default=MAX_TEXT_TOKENS, help="tokens of the text read (1024)")
    ev.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="greedy tokens per task (24)")
    ev.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    ev.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto",
                    help="the candidate's KV cache storage (int8: against the same version on its own dtype)")
    ev.add_argument("--out", help="folder for the JSON and PNG (default $AISERVE_HOME/eval)")
    ev.add_argument("--store", help="store folder (default $AISERVE_MODEL_STORE or $AISERVE_HOME/models)")
    ev.set_defaults(func=cmd_eval)
