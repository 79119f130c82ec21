"""``aiserve eval``: the measures computed right, the gate's verdict, the files it writes."""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from aiserve.eval_tasks import Task
from aiserve.store import ModelRef, ModelStore
from services.inference.evaluation import VersionRun, compare_text
from suite.cli import build_parser
from suite.evaluate import Bounds, accuracy, cmd_eval, default_bounds, evaluate, gate_problems
from suite.quantize import quantize_version
from tests.unit.suite.tiny_versions import tiny_version

TEXT_TOKENS, NEW_TOKENS = 96, 4  # enough to compute every measure, a few seconds per version


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> tuple[ModelStore, ModelRef]:
    work = tmp_path_factory.mktemp("eval")
    store = ModelStore(work / "store")
    return store, tiny_version(store, model_dir, work)


def run(log_probs: list[list[float]], targets: list[int]) -> VersionRun:
    return VersionRun(torch.tensor(log_probs).log_softmax(-1), torch.tensor(targets), [], "float32")


def test_text_measures_match_their_definitions() -> None:
    ref = run([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]], [2, 0])
    cand = run([[0.0, 2.0, 1.0], [2.0, 0.0, 0.0]], [2, 0])
    p, q = ref.log_probs.exp(), cand.log_probs.exp()
    kl0 = float((p[0] * (p[0].log() - q[0].log())).sum())
    compared = compare_text(ref, cand)
    assert compared.kl_per_token[0] == pytest.approx(kl0, abs=1e-6) and compared.kl_per_token[1] == pytest.approx(0)
    assert compared.kl_mean == pytest.approx(kl0 / 2, abs=1e-6) and compared.kl_max == pytest.approx(kl0, abs=1e-6)
    assert compared.top1_agreement == 0.5  # position 0: 2 against 1; position 1: 0 and 0
    nll = -(float(ref.log_probs[0, 2]) + float(ref.log_probs[1, 0])) / 2
    assert ref.perplexity == pytest.approx(math.exp(nll), rel=1e-6)
    with pytest.raises(ValueError, match="tokenized the text differently"):
        compare_text(ref, run([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]], [1, 0]))


def test_accuracy_by_category() -> None:
    tasks = [Task("a", "math", "1+1?", ("2",), "number"), Task("b", "math", "2+2?", ("4",), "number"),
             Task("c", "facts", "Capital?", ("Paris",), "contains")]
    assert accuracy(tasks, ["It is 2.", "5", "paris"]) == {"all": pytest.approx(2 / 3), "math": 0.5, "facts": 1.0}


def report_with(**fields: Any) -> dict[str, Any]:
    base = {"perplexity_change_pct": 0.5, "candidate_perplexity": 10.05, "reference_perplexity": 10.0,
            "kl_mean": 0.004, "top1_agreement": 0.97,
            "accuracy": {"reference": {"all": 0.5}, "candidate": {"all": 0.45}}}
    return {**base, **fields}


def test_the_gate_checks_each_bound_it_is_given() -> None:
    assert default_bounds("int8").max_ppl_increase_pct == 1.0 and default_bounds("int4").max_ppl_increase_pct == 5.0
    assert default_bounds(None).max_ppl_increase_pct == 1.0 and default_bounds("int8", 2.5).max_ppl_increase_pct == 2.5
    assert gate_problems(report_with(), default_bounds("int8")) == []
    worse = report_with(perplexity_change_pct=1.2, candidate_perplexity=10.12)
    [problem] = gate_problems(worse, default_bounds("int8"))
    assert "+1.20% from the reference's 10.0000 (bound +1.00%)" in problem
    assert gate_problems(report_with(perplexity_change_pct=4.0), default_bounds("int4")) == []
    strict = Bounds(1.0, max_kl_mean=0.001, min_top1_agreement=0.99, max_accuracy_drop=0.01)
    problems = gate_problems(report_with(), strict)
    assert len(problems) == 3 and "mean KL" in problems[0] and "top-1" in problems[1] and "accuracy" in problems[2]


def test_a_version_against_itself_agrees_exactly(tiny_store: tuple[ModelStore, ModelRef]) -> None:
    store, ref = tiny_store
    report = evaluate(store, ref, str(ref), None, TEXT_TOKENS, NEW_TOKENS)
    assert report["reference_perplexity"] == report["candidate_perplexity"] > 1.0
    assert report["perplexity_change_pct"] == 0.0
    assert report["kl_mean"] == pytest.approx(0.0, abs=1e-7) and report["kl_max"] == pytest.approx(0.0, abs=1e-7)
    assert report["top1_agreement"] == 1.0 and report["answer_agreement"] == 1.0
    assert report["accuracy"]["reference"] == report["accuracy"]["candidate"]
    assert report["text"]["tokens"] == TEXT_TOKENS and len(report["kl_per_token"]) == TEXT_TOKENS - 1
    assert len(report["tasks"]) == 40 and report["passed"] and report["problems"] == []


def test_the_command_writes_its_files_and_fails_a_candidate_outside_the_bounds(
        tiny_store: tuple[ModelStore, ModelRef], tmp_path: Path) -> None:
    store, ref = tiny_store
    quantized = quantize_version(store, ref, "int8", force=True)
    argv = ["eval", str(quantized.ref), "--store", str(store.root), "--out", str(tmp_path),
            "--max-text-tokens", str(TEXT_TOKENS), "--max-new-tokens", str(NEW_TOKENS)]
    args: argparse.Namespace = build_parser().parse_args(argv)
    out = io.StringIO()
    assert cmd_eval(args, out) == 0, out.getvalue()  # against its base by default, int8's +1%
    [json_path] = tmp_path.glob("*.json")
    report = json.loads(json_path.read_text())
    assert report["reference"] == str(ref) and report["scheme"] == "int8" and report["passed"]
    assert abs(report["perplexity_change_pct"]) < 1.0 and 0.0 < report["kl_mean"]
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A bound of -1%: the candidate must be 1% better than its reference, which it is not.
    args = build_parser().parse_args([*argv, "--max-ppl-increase", "-1"])
    out = io.StringIO()
    assert cmd_eval(args, out) == 1
    assert "FAILED the gate" in out.getvalue() and "bound -1.00%" in out.getvalue()
    assert not json.loads(json_path.read_text())["passed"]


def test_int8_of_the_default_model_passes_the_default_gate(tmp_path: Path, store: ModelStore,
                                                           model_ref: ModelRef) -> None:
    """The real SmolLM2-135M against its int8 version, on the whole shipped text (about 20 s on
    one thread, quantizing included). Measured: -0.24% perplexity, mean KL 0.004 nats."""
    work = ModelStore(tmp_path / "store")
    (work.root / model_ref.name).mkdir(parents=True)
    (work.root / model_ref.name / model_ref.version).symlink_to(store.path(model_ref))  # read, never written
    quantized = quantize_version(work, model_ref, "int8")
    report = evaluate(work, quantized.ref, None, None, max_new_tokens=NEW_TOKENS)
    assert report["reference"] == str(model_ref) and report["bounds"]["max_ppl_increase_pct"] == 1.0
    assert report["passed"], report["problems"]
    assert report["top1_agreement"] > 0.9 and 0.0 < report["kl_mean"] < 0.05
    assert store.verify(model_ref).files == store.manifest(model_ref).files  # the base still matches


def test_an_int8_kv_cache_is_judged_against_the_same_version(tiny_store: tuple[ModelStore, ModelRef],
                                                             tmp_path: Path) -> None:
    store, ref = tiny_store
    argv = ["eval", str(ref), "--kv-dtype", "int8", "--store", str(store.root), "--out", str(tmp_path),
            "--max-text-tokens", str(TEXT_TOKENS), "--max-new-tokens", str(NEW_TOKENS)]
    out = io.StringIO()
    assert cmd_eval(build_parser().parse_args(argv), out) == 0, out.getvalue()
    [json_path] = tmp_path.glob("*-kv-int8-vs-*.json")
    report = json.loads(json_path.read_text())
    assert report["reference"] == report["candidate"] == str(ref) and report["candidate_kv_dtype"] == "int8"
    # the same weights on another cache: close, but not the identical run of the version against itself
    assert 0.0 < report["kl_mean"] < 0.05 and report["perplexity_change_pct"] != 0.0
    assert "(KV cache int8)" in out.getvalue()


def test_a_reference_run_kept_between_evaluations_is_run_once(tiny_store: tuple[ModelStore, ModelRef],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two candidates against the same reference, sharing ``references``: the reference runs
    once, and each report is what it is without sharing."""
    from services.inference import evaluation

    store, ref = tiny_store
    quantized = quantize_version(store, ref, "int8", force=True).ref
    alone = [evaluate(store, quantized, None, None, TEXT_TOKENS, NEW_TOKENS),
             evaluate(store, ref, None, None, TEXT_TOKENS, NEW_TOKENS, kv_dtype="int8")]
    folders: list[Path] = []
    real_run = evaluation.run_version

    def counted(folder: Path, *args: Any, **kwargs: Any) -> VersionRun:
        folders.append(folder.resolve())
        return real_run(folder, *args, **kwargs)

    monkeypatch.setattr(evaluation, "run_version", counted)
    references: dict[Any, VersionRun] = {}
    shared = [evaluate(store, quantized, None, None, TEXT_TOKENS, NEW_TOKENS, references=references),
              evaluate(store, ref, None, None, TEXT_TOKENS, NEW_TOKENS, kv_dtype="int8", references=references)]
    base, candidate = store.path(ref).resolve(), store.path(quantized).resolve()
    assert folders == [base, candidate, base]  # reference, int8 weights, the int8 KV cache's run of the base
    assert list(references) == [(str(base), TEXT_TOKENS, NEW_TOKENS)]
    for one, other in zip(alone, shared, strict=True):
        for key in ("reference_perplexity", "candidate_perplexity", "kl_mean", "top1_agreement", "answer_agreement"):
            assert one[key] == other[key], key
