"""Measure the semantic match rule on the labelled pairs: ``python -m services.cache.calibrate``.

Each pair (a, b) is labelled 1 when the answer cached for ``a`` is a correct answer to ``b``
(a paraphrase), 0 when it is not (a hard negative: another entity, number, negation, order,
language, or a related but different question). A pair is a hit when its similarity reaches the
threshold (and, with the guard, its key terms agree). For every threshold it prints

- precision: hits that are correct / hits;
- recall: positive pairs that hit / positive pairs;
- false-hit rate: negative pairs that hit / negative pairs;

with and without the key-term guard, and recommends the lowest threshold whose false-hit rate
and share of wrong hits (1 - precision) are both at most the target (2%). It writes the table
as JSON and the curves as a PNG.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from services.cache.component_config import DEFAULT_SIMILARITY_THRESHOLD
from services.cache.embedder import Embedder
from services.cache.guard import disagreement, key_terms

PAIRS_PATH = Path(__file__).resolve().parent / "data" / "cache_pairs.jsonl"
TARGET = 0.02
THRESHOLDS = tuple(round(0.50 + 0.01 * i, 2) for i in range(51))  # 0.50 .. 1.00


@dataclass(frozen=True, slots=True)
class ScoredPair:
    a: str
    b: str
    label: int
    kind: str
    lang: str
    split: str
    similarity: float
    guard: str | None
    """Why the guard refuses the pair, or None when the key terms agree."""


@dataclass(frozen=True, slots=True)
class Metrics:
    threshold: float
    use_guard: bool
    hits: int
    false_hits: int
    precision: float
    recall: float
    false_hit_rate: float


def load_pairs(path: Path = PAIRS_PATH) -> list[dict[str, str | int]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def score_pairs(pairs: Sequence[dict[str, str | int]], embedder: Embedder) -> list[ScoredPair]:
    """Embed every text once, then the similarity and guard verdict of every pair."""
    texts = sorted({str(p["a"]) for p in pairs} | {str(p["b"]) for p in pairs})
    vectors = dict(zip(texts, embedder.encode(texts), strict=True))
    scored = []
    for p in pairs:
        va, vb = vectors[str(p["a"])], vectors[str(p["b"])]
        assert va is not None and vb is not None, "labelled prompts fit the embedding model"
        scored.append(ScoredPair(
            str(p["a"]), str(p["b"]), int(p["label"]), str(p["kind"]), str(p["lang"]), str(p.get("split", "")),
            float(va @ vb), disagreement(key_terms(str(p["a"])), key_terms(str(p["b"])))))
    return scored


def is_hit(pair: ScoredPair, threshold: float, use_guard: bool) -> bool:
    return pair.similarity >= threshold and (not use_guard or pair.guard is None)


def evaluate(pairs: Sequence[ScoredPair], threshold: float, use_guard: bool) -> Metrics:
    positives = [p for p in pairs if p.label == 1]
    negatives = [p for p in pairs if p.label == 0]
    true_hits = sum(is_hit(p, threshold, use_guard) for p in positives)
    false_hits = sum(is_hit(p, threshold, use_guard) for p in negatives)
    hits = true_hits + false_hits
    return Metrics(threshold, use_guard, hits, false_hits,
                   precision=true_hits / hits if hits else 1.0,
                   recall=true_hits / len(positives) if positives else 0.0,
                   false_hit_rate=false_hits / len(negatives) if negatives else 0.0)


def recommend(pairs: Sequence[ScoredPair], use_guard: bool, target: float = TARGET) -> Metrics | None:
    """The lowest threshold (best recall) with false-hit rate and 1 - precision <= ``target``."""
    for threshold in THRESHOLDS:
        m = evaluate(pairs, threshold, use_guard)
        if m.hits and m.false_hit_rate <= target and 1 - m.precision <= target:
            return m
    return None


def by_kind(pairs: Sequence[ScoredPair], threshold: float, use_guard: bool) -> dict[str, str]:
    """"hits/pairs" per (kind, language, label) at ``threshold``."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for p in pairs:
        key = f"{p.kind}/{p.lang}/{'positive' if p.label else 'negative'}"
        counts[key][0] += is_hit(p, threshold, use_guard)
        counts[key][1] += 1
    return {key: f"{hit}/{total}" for key, (hit, total) in sorted(counts.items())}


def _plot(curves: dict[str, list[Metrics]], default: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (name, rows) in zip(axes, curves.items(), strict=True):
        xs = [m.threshold for m in rows]
        ax.plot(xs, [m.precision for m in rows], label="precision")
        ax.plot(xs, [m.recall for m in rows], label="recall")
        ax.plot(xs, [m.false_hit_rate for m in rows], label="false-hit rate")
        ax.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
        ax.axvline(default, color="black", linestyle="--", linewidth=1, label=f"default {default:.2f}")
        ax.set_title(name)
        ax.set_xlabel("similarity threshold")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share")
    axes[1].legend(loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _print_table(curves: dict[str, list[Metrics]]) -> None:
    """Precision, recall and false-hit rate from 0.70 up, without and with the guard, side by side."""
    print(f"{'threshold':>9}  {'precision':>9} {'recall':>6} {'false-hit':>9}   {'precision':>9} {'recall':>6} "
          f"{'false-hit':>9}\n{'':>9}  {'--- embedding only ---':^26}   {'--- with key-term guard ---':^26}")
    for plain, guarded in zip(*curves.values(), strict=True):
        if plain.threshold >= 0.70:
            print(f"{plain.threshold:9.2f}  {plain.precision:9.3f} {plain.recall:6.3f} {plain.false_hit_rate:9.3f}   "
                  f"{guarded.precision:9.3f} {guarded.recall:6.3f} {guarded.false_hit_rate:9.3f}")


def _recommendations(pairs: Sequence[ScoredPair], report: dict[str, object]) -> None:
    """What the rule picks on the tune split, with and without the guard (printed and reported)."""
    tune = [p for p in pairs if p.split != "holdout"]  # the holdout split only checks the choice
    for name, guard in (("without_guard", False), ("with_guard", True)):
        best = recommend(tune, guard)
        report[f"recommended_{name}"] = asdict(best) if best else None
        print(f"recommended {name.replace('_', ' ')} (tune split, {len(tune)} pairs): " + (
            f"{best.threshold:.2f} (precision {best.precision:.3f}, recall {best.recall:.3f}, "
            f"false-hit rate {best.false_hit_rate:.3f})" if best else f"none reaches {TARGET:.0%}"))


def _default_on_splits(pairs: Sequence[ScoredPair], report: dict[str, object]) -> None:
    """How the shipped default does on every split and by kind (printed and reported)."""
    for split in ("all", *sorted({p.split for p in pairs})):
        part = [p for p in pairs if split in ("all", p.split)]
        m = evaluate(part, DEFAULT_SIMILARITY_THRESHOLD, True)
        report[f"default_on_{split}"] = asdict(m)
        print(f"default {DEFAULT_SIMILARITY_THRESHOLD:.2f} + guard on the {split} split ({len(part)} pairs): "
              f"precision {m.precision:.3f}, recall {m.recall:.3f}, false-hit rate {m.false_hit_rate:.3f}")
    kinds = by_kind(pairs, DEFAULT_SIMILARITY_THRESHOLD, True)
    report["by_kind_at_default"] = kinds
    for key, value in kinds.items():
        print(f"  {key:34s} {value}")


def main(argv: Sequence[str] | None = None) -> int:
    """Score the labelled pairs, print the table and the recommendation, write the JSON and PNG."""
    parser = argparse.ArgumentParser(prog="python -m services.cache.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=Path, default=PAIRS_PATH, help="labelled pairs (JSON lines)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the JSON and PNG")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)

    pairs = score_pairs(load_pairs(args.pairs), Embedder(threads=args.threads))
    curves = {name: [evaluate(pairs, t, guard) for t in THRESHOLDS]
              for name, guard in (("embedding only", False), ("embedding + key-term guard", True))}
    num_pos = sum(p.label for p in pairs)
    print(f"{len(pairs)} labelled pairs ({num_pos} positive, {len(pairs) - num_pos} negative) from {args.pairs}")
    _print_table(curves)
    report: dict[str, object] = {"machine": platform.platform(), "pairs": len(pairs), "positives": num_pos,
                                 "target": TARGET, "default_threshold": DEFAULT_SIMILARITY_THRESHOLD}
    _recommendations(pairs, report)
    _default_on_splits(pairs, report)
    report["curves"] = {name: [asdict(m) for m in rows] for name, rows in curves.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_calibration.json").write_text(json.dumps(report, indent=2))
    _plot(curves, DEFAULT_SIMILARITY_THRESHOLD, args.out / "cache_calibration.png")
    print(f"wrote {args.out / 'cache_calibration.json'} and {args.out / 'cache_calibration.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
