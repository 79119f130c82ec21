"""The autoscaling simulator: the HPA's arithmetic against hand-worked cases, the fleet model
against the figures it is built from, the manifests against the policy it reads, and the shipped
policy against the shipped traces."""
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from services.gateway.config import GatewayConfig
from services.inference.engine_config import SchedulerConfig
from suite.autoscale_cli import direction_changes, flaps, violations
from suite.autoscale_inputs import TRACES_PATH, load_figures, load_trace
from suite.autoscale_policy import (
    Policy,
    average_value_desired,
    load_policy,
    prometheus_query,
    rate_limited,
    rate_query,
    raw_desired,
    stabilised,
)
from suite.autoscale_sim import Result, simulate
from suite.cli import main

ROOT = Path(__file__).resolve().parents[3]
POLICY = Policy(metric_name="m", target_per_replica=8, min_replicas=1, max_replicas=8,
                tolerance=0.1, up_window_s=0, down_window_s=300)
BURST_ONSET_S = 300  # deploy/autoscaling/traces/burst.csv: 4 req/s, then 40 req/s from second 300


def test_the_formula_by_hand() -> None:
    assert raw_desired(3, 12, 5, 0.1) == 8  # ceil(3 * 12 / 5) = ceil(7.2)
    assert raw_desired(3, 5.4, 5, 0.1) == 3  # ratio 1.08: within the tolerance
    assert raw_desired(3, 5.6, 5, 0.1) == 4  # ratio 1.12: ceil(3.36)
    assert raw_desired(4, 16, 8, 0.1, ready=2) == 4  # two of four Ready: ceil(2 * 2), not 8
    assert raw_desired(4, 0, 8, 0.1) == 0  # an idle queue asks for nothing; the bounds add the floor
    # A fleet total as an AverageValue: 2000 tok/s over 3 replicas at 550 each is 1.21x: ceil(2000 / 550)
    assert average_value_desired(3, 2000, 550, 0.1) == 4
    assert average_value_desired(3, 1750, 550, 0.1) == 3  # 1.06x: within the tolerance


def test_stabilisation_takes_the_window_maximum_down_and_the_latest_up() -> None:
    history = [(0.0, 6), (100.0, 2), (200.0, 3)]
    assert stabilised(200.0, 5, history, POLICY) == 5  # the 6 is in the window: stay
    assert stabilised(300.0, 5, history + [(300.0, 2)], POLICY) == 3  # 300 s old: out, as HPA's After(cutoff)
    assert stabilised(310.0, 2, history + [(310.0, 7)], POLICY) == 7  # up at once (no up window)
    slow_up = replace(POLICY, up_window_s=60)
    assert stabilised(310.0, 2, [(260.0, 4), (310.0, 7)], slow_up) == 4  # the lowest of the up window


def test_the_rate_limits_count_from_the_period_start() -> None:
    # Up: double or +4, whichever is more: from 2, max(4, 6) = 6
    assert rate_limited(0.0, 2, 20, [], POLICY) == 6
    # 10 s later the period still starts at 2 (the +4 is inside it): no more
    assert rate_limited(10.0, 6, 20, [(0.0, 4)], POLICY) == 6
    # 15 s later it starts at 6: max(12, 10), then the bounds cap at 8 elsewhere
    assert rate_limited(15.0, 6, 20, [(0.0, 4)], POLICY) == 12
    # Down: one pod a minute
    assert rate_limited(0.0, 8, 2, [], POLICY) == 7
    assert rate_limited(30.0, 7, 2, [(0.0, -1)], POLICY) == 7
    assert rate_limited(60.0, 7, 2, [(0.0, -1)], POLICY) == 6


def _fixed_fleet(replicas: int) -> Policy:
    return replace(load_policy(), min_replicas=replicas, max_replicas=replicas)


def test_a_request_alone_takes_the_measured_latency() -> None:
    figures = load_figures()
    result = simulate(_fixed_fleet(1), figures, np.array([1, 0, 0] * 40))
    assert result.completed == 40 and result.rejected == 0
    assert abs(np.nanmax(result.p99_s) - figures.latency_s(1)) < 0.1


def test_a_saturated_replica_serves_its_measured_throughput_and_refuses_past_its_queue() -> None:
    figures = load_figures()
    result = simulate(_fixed_fleet(1), figures, np.full(300, 20))
    served_per_s = int((result.finished_s >= 60).sum()) / 240
    assert served_per_s == pytest.approx(figures.throughput(figures.max_concurrency) / figures.answer_tokens,
                                         rel=0.03)
    assert result.rejected > 0 and result.metric.max() == figures.max_queue


def test_a_new_replica_takes_traffic_after_cold_start_probe_and_lookup() -> None:
    policy, figures = load_policy(), load_figures()
    result = simulate(policy, figures, load_trace(TRACES_PATH / "burst.csv"))
    t, before, after = result.scale_events[0]
    assert after > before and t > BURST_ONSET_S
    ready = t + math.ceil(figures.cold_start_s / policy.startup_probe_period_s) * policy.startup_probe_period_s
    listed = math.ceil(ready / policy.gateway_resolve_interval_s) * policy.gateway_resolve_interval_s
    assert result.serving[math.ceil(listed) - 1] == before and result.serving[math.ceil(listed)] > before


def _allowed_reaction_s(policy: Policy, window_s: float) -> float:
    """From a burst's onset to the P99 back under target: one scrape and one HPA sync to see it,
    the new pods' warm-up (cold start, the next startup probe, the gateway's next lookup), and the
    P99 window, which remembers what was refused or late before the new pods took traffic."""
    figures = load_figures()
    warm_up = math.ceil(figures.cold_start_s / policy.startup_probe_period_s) * policy.startup_probe_period_s
    return policy.scrape_interval_s + policy.sync_period_s + warm_up + policy.gateway_resolve_interval_s + window_s


def _run(trace: str) -> tuple[Result, Policy]:
    policy = load_policy()
    return simulate(policy, load_figures(), load_trace(TRACES_PATH / trace)), policy


def test_the_shipped_policy_holds_the_p99_through_a_10x_burst_without_flapping() -> None:
    result, policy = _run("burst.csv")
    late = violations(result, GatewayConfig().slo_e2e_s)
    assert all(BURST_ONSET_S <= s <= BURST_ONSET_S + _allowed_reaction_s(policy, 60.0) for s in late), late
    assert result.rejected < 0.01 * result.arrivals.sum()  # refusals: under 1%, which a P99 may hide
    assert flaps(result, policy) == 0
    assert direction_changes(result) <= 1  # up for the burst, down after it
    assert result.replicas.max() > policy.min_replicas


@pytest.mark.parametrize("trace", ["steady.csv", "daily.csv"])
def test_the_shipped_policy_holds_steady_and_daily_load_without_flapping(trace: str) -> None:
    result, policy = _run(trace)
    assert violations(result, GatewayConfig().slo_e2e_s) == []
    assert result.rejected == 0
    assert flaps(result, policy) == 0 and direction_changes(result) == 0


def test_flaps_count_an_up_inside_the_down_window_after_a_down() -> None:
    def result_with(events: tuple[tuple[float, int, int], ...]) -> Result:
        empty = np.zeros(1)
        return Result(empty, empty, empty, empty, empty, empty, events, 0.0, 0, 0, 0)

    flapping = result_with(((0.0, 2, 4), (400.0, 4, 3), (500.0, 3, 4)))
    assert flaps(flapping, POLICY) == 1 and direction_changes(flapping) == 2
    assert flaps(result_with(((0.0, 2, 4), (400.0, 4, 3), (800.0, 3, 4))), POLICY) == 0


def test_the_manifests_express_the_policy_the_simulator_reads() -> None:
    policy = load_policy()
    keda = ROOT / "deploy" / "k8s" / "components" / "keda" / "scaledobject.yaml"
    spec = yaml.safe_load(keda.read_text())["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (policy.min_replicas, policy.max_replicas)
    assert spec["pollingInterval"] == policy.polling_interval_s
    assert spec["cooldownPeriod"] == policy.cooldown_period_s
    queue, tokens = spec["triggers"]
    assert (queue["metricType"], queue["metadata"]["query"]) == ("Value", prometheus_query(policy))
    assert float(queue["metadata"]["threshold"]) == policy.target_per_replica
    assert (tokens["metricType"], tokens["metadata"]["query"]) == ("AverageValue", rate_query(policy))
    assert float(tokens["metadata"]["threshold"]) == policy.rate_target_per_replica
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == policy.up_window_s and up["selectPolicy"] == "Max"
    assert {(p["type"], p["value"], p["periodSeconds"]) for p in up["policies"]} == {
        ("Percent", policy.up_percent, policy.up_period_s), ("Pods", policy.up_pods, policy.up_period_s)}
    assert down["stabilizationWindowSeconds"] == policy.down_window_s
    assert [(p["type"], p["value"], p["periodSeconds"]) for p in down["policies"]] == [
        ("Pods", policy.down_pods, policy.down_period_s)]
    inference = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "inference.yaml").read_text())
    container = next(d for d in inference if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["startupProbe"]["periodSeconds"] == policy.startup_probe_period_s
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == policy.pre_stop_s
    assert GatewayConfig().resolve_interval_s == policy.gateway_resolve_interval_s
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["global"]["scrape_interval"] == f"{policy.scrape_interval_s:g}s"


def test_the_figures_cover_the_engine_and_a_bench_sweep_reads_as_figures(tmp_path: Path) -> None:
    figures = load_figures()
    assert figures.throughput_tok_s[-1][0] == SchedulerConfig().max_num_seqs
    assert "EPYC" in figures.cpu
    sweep = {"machine": {"cpu": "Test CPU"}, "d_sweep": {"new_tokens": 32, "points": [
        {"max_num_seqs": 1, "tokens_per_s": 40.0}, {"max_num_seqs": 64, "tokens_per_s": 800.0},
        {"max_num_seqs": 128, "tokens_per_s": 880.0}]}}
    (tmp_path / "engine.json").write_text(json.dumps(sweep))
    read = load_figures(tmp_path / "engine.json")
    assert read.cpu.startswith("Test CPU") and read.answer_tokens == 32
    assert read.throughput_tok_s == ((1, 40.0), (64, 800.0))  # past max_num_seqs is dropped
    assert read.latency_s(64) == pytest.approx(64 * 32 / 800.0)


def test_the_command_prints_a_summary_and_writes_the_plot_and_the_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "short.csv"
    trace.write_text("second,arrivals\n" + "".join(f"{s},{30 if 20 <= s < 60 else 3}\n" for s in range(120)))
    with pytest.raises(SystemExit) as exit_:
        main(["autoscale", "simulate", "--trace", str(trace), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 0
    assert "short: 120 s" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "short.json").read_text())
    assert report["requests"] == 40 * 30 + 80 * 3 and report["scale_events"] == len(report["events"]) > 0
    assert {"violation_seconds", "violations_at_s", "replica_seconds", "flaps"} <= set(report)
    assert (tmp_path / "out" / "short.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
