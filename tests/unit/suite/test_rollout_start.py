"""``aiserve rollout start``'s own logic: which versions must answer alike, the verdict on the
golden answers, the stable version of a route, a version's environment, and stopping the
processes a rollout recorded (real processes)."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import pytest

from aiserve.store import Manifest, ModelRef, ModelStore
from aiserve.v1 import admin_pb2
from suite.quantize import quantize_version
from suite.rollout_start import (
    GOLDEN_PROMPTS,
    RolloutError,
    StartRequest,
    compare_answers,
    eval_verdict,
    find_stable,
    run_eval_gate,
    same_weights,
)
from suite.version_instances import (
    VersionProcess,
    _write_versions,
    read_versions,
    stop_all_versions,
    stop_unrouted,
    version_env,
)
from tests.unit.suite.tiny_versions import tiny_version


def manifest(version: str, **files: str) -> Manifest:
    return Manifest(ModelRef("m", version), dict(files), "tok", {}, "2026-12-04")


def test_weights_are_the_same_only_when_every_weight_file_matches() -> None:
    a = manifest("1", **{"model.safetensors": "aa", "tokenizer.json": "t1", "config.json": "c"})
    assert same_weights(a, manifest("2", **{"model.safetensors": "aa", "tokenizer.json": "t2"}))
    assert not same_weights(a, manifest("2", **{"model.safetensors": "bb", "tokenizer.json": "t1"}))
    # No weight file at all proves nothing: never "the same".
    assert not same_weights(manifest("1", **{"config.json": "c"}), manifest("2", **{"config.json": "c"}))


def test_golden_answers_must_be_non_empty_and_match_identical_weights() -> None:
    good = [f"answer {i}" for i in range(len(GOLDEN_PROMPTS))]
    assert compare_answers(good, None) == []
    assert compare_answers(good, list(good)) == []
    empty = [*good[:-1], "  "]
    [problem] = compare_answers(empty, None)
    assert problem.startswith(f"golden prompt {len(GOLDEN_PROMPTS)}") and "empty answer" in problem
    other = ["something else", *good[1:]]
    [problem] = compare_answers(other, good)
    assert "golden prompt 1" in problem and "'something else' differs" in problem
    assert compare_answers(other, None) == []  # other weights may answer otherwise


def test_the_stable_version_of_a_route() -> None:
    routes = admin_pb2.RouteList(routes=[admin_pb2.Route(name="m", versions=[
        admin_pb2.RouteVersion(model="m@2", role=admin_pb2.VERSION_ROLE_CANARY),
        admin_pb2.RouteVersion(model="m@1", role=admin_pb2.VERSION_ROLE_STABLE)])])
    assert find_stable(routes, "m") == "m@1"
    with pytest.raises(RolloutError, match="no route 'x' with a stable version \\(routes: m\\)"):
        find_stable(routes, "x")


def test_a_versions_environment_names_its_model_and_binds_a_free_port(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "AISERVE_INFERENCE_MODEL": "m@1", "AISERVE_INFERENCE_PORT": "50053",
            "AISERVE_INFERENCE_MAX_NUM_SEQS": "8", "AISERVE_GATEWAY_PORT": "1"}
    env = version_env(base, tmp_path, tmp_path / "store", "inference", "m@2", torch_threads=1)
    assert env["AISERVE_INFERENCE_MODEL"] == "m@2"
    assert env["AISERVE_INFERENCE_PORT"] == "0" and env["AISERVE_INFERENCE_METRICS_PORT"] == "0"
    assert env["AISERVE_INFERENCE_TORCH_THREADS"] == "1"
    assert "AISERVE_INFERENCE_MAX_NUM_SEQS" not in env  # the running version's settings stay its own
    assert env["AISERVE_GATEWAY_PORT"] == "1" and env["AISERVE_MODEL_STORE"] == str(tmp_path / "store")
    tok = version_env(base, tmp_path, tmp_path, "tokenizer", "m@2", torch_threads=1)
    assert tok["AISERVE_TOKENIZER_MODEL"] == "m@2" and tok["OMP_NUM_THREADS"] == "1"


def test_stopping_the_recorded_versions_ends_their_processes(tmp_path: Path) -> None:
    # Stand-ins for a version's two processes: they exit on SIGTERM, as a draining service does.
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    try:
        _write_versions(tmp_path, {"m@2": [VersionProcess("tokenizer", children[0].pid, "a:1"),
                                           VersionProcess("inference", children[1].pid, "a:2")]})
        assert [p.service for p in read_versions(tmp_path)["m@2"]] == ["tokenizer", "inference"]
        assert stop_all_versions(tmp_path, timeout_s=30) == 2
        assert all(child.poll() is not None for child in children)
        assert read_versions(tmp_path) == {}
        assert stop_all_versions(tmp_path, timeout_s=30) == 0  # nothing left: a no-op
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_versions_own_settings_win(tmp_path: Path) -> None:
    base = {"AISERVE_INFERENCE_DTYPE": "float32"}
    env = version_env(base, tmp_path, tmp_path, "inference", "m@2", torch_threads=1,
                      settings={"AISERVE_INFERENCE_STEP_DELAY_MS": "50", "AISERVE_TOKENIZER_X": "1"})
    assert env["AISERVE_INFERENCE_STEP_DELAY_MS"] == "50"
    assert "AISERVE_INFERENCE_DTYPE" not in env and "AISERVE_TOKENIZER_X" not in env  # each its own service's


def test_versions_on_no_route_are_stopped(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _write_versions(tmp_path, {"m@1": [VersionProcess("inference", child.pid, "a:1")], "m@2": []})
        assert stop_unrouted(tmp_path, {"m@2", "m@3"}, timeout_s=30) == ["m@1"]
        assert child.poll() is not None and list(read_versions(tmp_path)) == ["m@2"]
    finally:
        child.kill()
        child.wait()


def test_the_eval_verdict_refuses_a_report_with_problems() -> None:
    eval_verdict({"candidate": "m@2", "reference": "m@1", "problems": []})  # passed: no error
    with pytest.raises(RolloutError, match="m@2 failed the quality gate against m@1, nothing was started:\n  ppl"):
        eval_verdict({"candidate": "m@2", "reference": "m@1", "problems": ["ppl +3%"]})


def test_the_eval_gate_runs_against_the_stable_version_with_the_rollouts_bound(tmp_path: Path,
                                                                                model_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    base = tiny_version(store, model_dir, tmp_path)
    candidate = quantize_version(store, base, "int8").ref
    request = StartRequest(str(candidate), 10, "127.0.0.1:1", "admin", "tenant", tmp_path / "home", store.root,
                           eval_gate=True)
    out = io.StringIO()
    report = run_eval_gate(request, store, str(base), out)
    assert report["passed"] and report["reference"] == str(base) and report["bounds"]["max_ppl_increase_pct"] == 1.0
    assert len(list((tmp_path / "home" / "eval").glob("*.json"))) == 1 and "perplexity" in out.getvalue()
    strict = dataclasses.replace(request, eval_max_ppl_increase=-1.0)  # must be 1% better: it is not
    with pytest.raises(RolloutError, match="failed the quality gate"):
        run_eval_gate(strict, store, str(base), out)
