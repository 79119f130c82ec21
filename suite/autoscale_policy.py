"""The inference autoscaling policy (deploy/autoscaling/policy.yaml) and the replica formula that
KEDA and the HPA apply to it, so that the simulator and the manifests' tests share one reading.

The HPA computes desired = ceil(ready * metric / target), keeps `current` while the ratio is
within the tolerance, then takes the highest recommendation of the scale-down stabilisation window
(the lowest of the scale-up window), limits the change to what the scaling policies allow per
period and clamps to [min, max] (kube-controller-manager's podautoscaler, `normalizeDesiredReplicas
WithBehaviors`: stabilise first, then the rate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

POLICY_PATH = Path(__file__).resolve().parent.parent / "deploy" / "autoscaling" / "policy.yaml"


@dataclass(frozen=True)
class Policy:
    """One reading of policy.yaml; the fields past `down_window_s` default to the shipped file's
    values so that a hand-built policy in a test names only what it is about."""

    metric_name: str
    target_per_replica: float
    min_replicas: int
    max_replicas: int
    tolerance: float
    up_window_s: float
    down_window_s: float
    up_percent: float = 100.0
    """Scale-up policy: at most this percentage of the replicas at the period's start added..."""
    up_pods: int = 4
    """...or this many pods, whichever is more (selectPolicy Max)."""
    up_period_s: float = 15.0
    down_pods: int = 1
    """Scale-down policy: at most this many pods removed per `down_period_s`."""
    down_period_s: float = 60.0
    sync_period_s: float = 15.0
    """The HPA reads the metric and decides this often."""
    scrape_interval_s: float = 15.0
    """Prometheus reads each replica's gauge this often."""
    polling_interval_s: float = 15.0
    cooldown_period_s: float = 300.0
    startup_probe_period_s: float = 2.0
    gateway_resolve_interval_s: float = 10.0
    pre_stop_s: float = 5.0
    rate_counter: str = ""
    """A second trigger, "" for none: the fleet's rate of this counter, compared per replica as an
    AverageValue (desired = ceil(total rate / target)); the HPA takes the larger proposal."""
    rate_window_s: float = 60.0
    rate_target_per_replica: float = 0.0


def load_policy(path: Path = POLICY_PATH) -> Policy:
    raw = yaml.safe_load(path.read_text())
    up, down = raw["scale_up"], raw["scale_down"]
    return Policy(
        metric_name=raw["metric"]["name"],
        target_per_replica=float(raw["metric"]["target_per_replica"]),
        min_replicas=int(raw["replicas"]["min"]),
        max_replicas=int(raw["replicas"]["max"]),
        tolerance=float(raw["hpa_tolerance"]),
        up_window_s=float(up["stabilization_window_s"]),
        down_window_s=float(down["stabilization_window_s"]),
        up_percent=float(up["max_percent_per_period"]),
        up_pods=int(up["max_pods_per_period"]),
        up_period_s=float(up["period_s"]),
        down_pods=int(down["max_pods_per_period"]),
        down_period_s=float(down["period_s"]),
        sync_period_s=float(raw["hpa_sync_period_s"]),
        scrape_interval_s=float(raw["metric"]["scrape_interval_s"]),
        polling_interval_s=float(raw["keda"]["polling_interval_s"]),
        cooldown_period_s=float(raw["keda"]["cooldown_period_s"]),
        startup_probe_period_s=float(raw["warm_up"]["startup_probe_period_s"]),
        gateway_resolve_interval_s=float(raw["warm_up"]["gateway_resolve_interval_s"]),
        pre_stop_s=float(raw["pre_stop_s"]),
        **_rate_trigger(raw.get("rate_metric")),
    )


def _rate_trigger(raw: dict[str, Any] | None) -> dict[str, Any]:
    """The optional `rate_metric` section as Policy fields (none: no second trigger)."""
    if not raw:
        return {}
    if raw["type"] != "AverageValue":
        raise ValueError(f"rate_metric.type: a fleet total is compared as AverageValue, got {raw['type']}")
    return {"rate_counter": str(raw["counter"]), "rate_window_s": float(raw["window_s"]),
            "rate_target_per_replica": float(raw["target_per_replica"])}


def raw_desired(current: int, metric_per_replica: float, target: float, tolerance: float,
                ready: int | None = None) -> int:
    """The HPA formula for one reading of a per-replica mean compared as a Value: `current` when
    the ratio metric/target is within the tolerance of 1, else ceil(ready * ratio), where `ready`
    (the pods Ready now) defaults to `current`."""
    ratio = metric_per_replica / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil((current if ready is None else ready) * ratio)


def desired(policy: Policy, current: int, waiting_per_replica: float, ready: int | None = None) -> int:
    """The raw recommendation for `current` replicas (`ready` of them Ready) reading `waiting_per_replica`."""
    return raw_desired(current, waiting_per_replica, policy.target_per_replica, policy.tolerance, ready)


def average_value_desired(current: int, total: float, target_per_replica: float, tolerance: float) -> int:
    """The HPA formula for a fleet total compared as an AverageValue: `current` while
    total / (target * current) is within the tolerance of 1, else ceil(total / target)."""
    if current and abs(total / (target_per_replica * current) - 1.0) <= tolerance:
        return current
    return math.ceil(total / target_per_replica)


def rate_query(policy: Policy) -> str:
    """The second trigger's query: the counter's rate summed over the fleet."""
    return f"sum(rate({policy.rate_counter}[{policy.rate_window_s:g}s]))"


def gauges(policy: Policy) -> list[str]:
    """The gauges the metric adds up per replica: its name is one gauge or a sum ``a + b``."""
    return [g.strip() for g in policy.metric_name.split("+")]


def prometheus_query(policy: Policy, model: str = "") -> str:
    """The query that KEDA's prometheus trigger (and prometheus-adapter) read: the mean over the
    replicas of the metric's gauge (or of the sum of its gauges, taken per replica). The inference
    service's gauges have no model label yet, so the shipped manifests (one model per Deployment)
    leave ``model`` empty and average every replica."""
    selector = f'{{model="{model}"}}' if model else ""
    return f"avg({' + '.join(g + selector for g in gauges(policy))})"


def stabilised(now_s: float, current: int, history: list[tuple[float, int]], policy: Policy) -> int:
    """The replica count after stabilisation: `history` holds (time, raw recommendation) pairs,
    the latest last. Scaling up takes the lowest recommendation of the up window, scaling down the
    highest of the down window (a recommendation counts while younger than the window, as the HPA's
    `After(cutoff)`); the result is clamped to [min, max]."""
    latest = history[-1][1]
    if latest > current:
        recent = [r for t, r in history if now_s - t < policy.up_window_s] or [latest]
        chosen = max(current, min(recent))
    else:
        recent = [r for t, r in history if now_s - t < policy.down_window_s] or [latest]
        chosen = min(current, max(recent))
    return max(policy.min_replicas, min(policy.max_replicas, chosen))


def rate_limited(now_s: float, current: int, wanted: int, events: list[tuple[float, int]], policy: Policy) -> int:
    """`wanted` limited by the scaling policies: `events` holds (time, signed change) of the scale
    events so far. The limit counts from the replicas at the start of each policy's period
    (current minus what was added plus what was removed in it), as the HPA does."""
    def at_period_start(period_s: float) -> int:
        return current - sum(change for t, change in events if now_s - t < period_s)

    if wanted > current:
        start = at_period_start(policy.up_period_s)
        limit = max(math.ceil(start * (1 + policy.up_percent / 100)), start + policy.up_pods)
        return min(wanted, max(limit, current))
    if wanted < current:
        limit = at_period_start(policy.down_period_s) - policy.down_pods
        return max(wanted, min(limit, current))
    return wanted
