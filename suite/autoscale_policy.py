"""The inference autoscaling policy (deploy/autoscaling/policy.yaml) and the replica formula that
KEDA and the HPA apply to it, so that the simulator and the manifests' tests share one reading.

The HPA computes desired = ceil(current * metric / target), keeps `current` while the ratio is
within the tolerance, then takes the highest recommendation of the scale-down stabilisation window
(the lowest of the scale-up window) and clamps to [min, max].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

POLICY_PATH = Path(__file__).resolve().parent.parent / "deploy" / "autoscaling" / "policy.yaml"


@dataclass(frozen=True)
class Policy:
    metric_name: str
    target_per_replica: float
    min_replicas: int
    max_replicas: int
    tolerance: float
    up_window_s: float
    down_window_s: float


def load_policy(path: Path = POLICY_PATH) -> Policy:
    raw = yaml.safe_load(path.read_text())
    return Policy(
        metric_name=raw["metric"]["name"],
        target_per_replica=float(raw["metric"]["target_per_replica"]),
        min_replicas=int(raw["replicas"]["min"]),
        max_replicas=int(raw["replicas"]["max"]),
        tolerance=float(raw["hpa_tolerance"]),
        up_window_s=float(raw["scale_up"]["stabilization_window_s"]),
        down_window_s=float(raw["scale_down"]["stabilization_window_s"]),
    )


def raw_desired(current: int, metric_per_replica: float, target: float, tolerance: float) -> int:
    """The HPA formula for one reading: ceil(current * metric / target), or `current` when the
    ratio metric/target is within the tolerance of 1."""
    ratio = metric_per_replica / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio)


def desired(policy: Policy, current: int, waiting_per_replica: float) -> int:
    """The raw recommendation for `current` replicas reading `waiting_per_replica`."""
    return raw_desired(current, waiting_per_replica, policy.target_per_replica, policy.tolerance)


def prometheus_query(policy: Policy, model: str = "") -> str:
    """The query that KEDA's prometheus trigger (and prometheus-adapter) read: the mean of the
    queue gauge over the replicas. The inference service's gauge has no model label yet, so the
    shipped manifests (one model per Deployment) leave ``model`` empty and average every replica."""
    if not model:
        return f"avg({policy.metric_name})"
    return f'avg({policy.metric_name}{{model="{model}"}})'


def stabilised(now_s: float, current: int, history: list[tuple[float, int]], policy: Policy) -> int:
    """The replica count after stabilisation: `history` holds (time, raw recommendation) pairs,
    the latest last. Scaling up takes the lowest recommendation of the up window, scaling down the
    highest of the down window; the result is clamped to [min, max]."""
    latest = history[-1][1]
    if latest > current:
        recent = [r for t, r in history if now_s - t <= policy.up_window_s] or [latest]
        chosen = max(current, min(recent))
    else:
        recent = [r for t, r in history if now_s - t <= policy.down_window_s] or [latest]
        chosen = min(current, max(recent))
    return max(policy.min_replicas, min(policy.max_replicas, chosen))
