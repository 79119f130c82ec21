"""``aiserve autoscale simulate --trace FILE``: replays an arrival trace against the fleet that
deploy/autoscaling/policy.yaml scales (suite/autoscale_sim.py), then prints a summary and writes a
PNG (replicas, the queue per replica, the fleet's tokens/s and the P99 over time) and a JSON
(SLO violations, replica-seconds, scale events, flaps).

A flap is a scale-up less than the scale-down stabilisation window after a scale-down: the window
exists to stop exactly that, so a policy that flaps on a trace is one whose trigger misreads it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from services.gateway.config import GatewayConfig
from suite.autoscale_inputs import FIGURES_PATH, Figures, load_figures, load_trace
from suite.autoscale_policy import POLICY_PATH, Policy, load_policy, prometheus_query, rate_query
from suite.autoscale_sim import Result, simulate

DEFAULT_OUT = Path("var") / "autoscale"


def flaps(result: Result, policy: Policy) -> int:
    """Scale-ups that came less than the scale-down window after the scale-down before them."""
    count, last_down = 0, -math.inf
    for t, before, after in result.scale_events:
        if after < before:
            last_down = t
        elif t - last_down < policy.down_window_s:
            count += 1
    return count


def direction_changes(result: Result) -> int:
    """How often the fleet turned from growing to shrinking or back."""
    signs = [1 if after > before else -1 for _, before, after in result.scale_events]
    return sum(a != b for a, b in zip(signs, signs[1:], strict=False))


def violations(result: Result, slo_s: float) -> list[int]:
    """The seconds whose P99 (over the window ending there) is above the target."""
    return [int(s) for s in np.flatnonzero(np.nan_to_num(result.p99_s, nan=0.0) > slo_s)]


def summary(result: Result, policy: Policy, figures: Figures, slo_s: float, window_s: float) -> dict[str, Any]:
    """The run in figures: what it served, what it cost, how it scaled and where it missed the SLO."""
    late = violations(result, slo_s)
    finite = result.p99_s[np.isfinite(result.p99_s)]
    return {
        "seconds": len(result.arrivals), "requests": int(result.arrivals.sum()), "completed": result.completed,
        "rejected": result.rejected, "unfinished": result.unfinished,
        "replicas": {"min": int(result.replicas.min()), "max": int(result.replicas.max()),
                     "mean": round(float(result.replicas.mean()), 2)},
        "replica_seconds": round(result.replica_seconds, 1),
        "scale_events": len(result.scale_events),
        "scale_ups": sum(after > before for _, before, after in result.scale_events),
        "direction_changes": direction_changes(result), "flaps": flaps(result, policy),
        "slo_p99_s": slo_s, "p99_window_s": window_s, "violation_seconds": len(late),
        "first_violation_s": late[0] if late else None, "last_violation_s": late[-1] if late else None,
        "p99_max_s": "inf (requests refused)" if np.isinf(result.p99_s).any() else
        round(float(finite.max()), 2) if finite.size else None,
        "figures_cpu": figures.cpu,
        "triggers": [prometheus_query(policy)] + ([rate_query(policy)] if policy.rate_counter else []),
    }


def write_json(path: Path, report: dict[str, Any], result: Result, slo_s: float) -> None:
    events = [{"t_s": t, "from": before, "to": after} for t, before, after in result.scale_events]
    path.write_text(json.dumps({**report, "violations_at_s": violations(result, slo_s), "events": events},
                               indent=1) + "\n")


def plot(path: Path, result: Result, policy: Policy, slo_s: float, title: str) -> None:
    """Four panels over the trace's seconds: arrivals, replicas, the triggers, the P99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = np.arange(len(result.arrivals))
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True)
    axes[0].plot(seconds, result.arrivals, lw=0.6, color="grey")
    axes[0].set_ylabel("arrivals / s")
    axes[1].step(seconds, result.replicas, where="post", label="desired (spec.replicas)")
    axes[1].step(seconds, result.serving, where="post", label="taking traffic")
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper right")
    queue_label = f"{prometheus_query(policy)} (target {policy.target_per_replica:g})"
    axes[2].plot(seconds, result.metric, lw=0.8, label=queue_label)
    axes[2].set_ylabel("waiting / replica")
    axes[2].set_ylim(bottom=0)
    if policy.rate_counter:
        twin = axes[2].twinx()
        twin.plot(seconds, result.token_rate / policy.rate_target_per_replica, lw=0.8, color="tab:green",
                  label="tokens/s over the fleet / target per replica")
        twin.set_ylabel("replicas' worth of tokens/s")
        twin.set_ylim(bottom=0)
        twin.legend(loc="upper right")
    axes[2].legend(loc="upper left")
    top = 2 * slo_s
    p99 = np.where(np.isinf(result.p99_s), top, result.p99_s)
    axes[3].plot(seconds, p99, lw=0.8, label="P99, queue wait + service (refusals drawn at the top)")
    axes[3].axhline(slo_s, color="red", ls="--", label=f"target {slo_s:g} s")
    axes[3].set_ylim(0, top * 1.05)
    axes[3].set_ylabel("seconds")
    axes[3].set_xlabel("trace second")
    axes[3].legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def format_summary(name: str, report: dict[str, Any]) -> str:
    r = report
    return "\n".join([
        f"{name}: {r['seconds']} s, {r['requests']} requests ({r['completed']} done, {r['rejected']} refused, "
        f"{r['unfinished']} still running at the end)",
        f"  replicas {r['replicas']['min']}-{r['replicas']['max']} (mean {r['replicas']['mean']}), "
        f"{r['replica_seconds']:.0f} replica-seconds",
        f"  {r['scale_events']} scale events ({r['scale_ups']} up), {r['direction_changes']} direction changes, "
        f"{r['flaps']} flaps",
        f"  P99 > {r['slo_p99_s']:g} s in {r['violation_seconds']} s"
        + (f" (seconds {r['first_violation_s']}-{r['last_violation_s']})" if r["violation_seconds"] else "")
        + f"; highest P99 {r['p99_max_s']}",
        f"  figures: {r['figures_cpu']}",
    ])


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        policy, figures = load_policy(Path(args.policy)), load_figures(Path(args.figures))
        trace = load_trace(Path(args.trace))
        result = simulate(policy, figures, trace, args.step_s, args.window_s)
    except (OSError, ValueError, KeyError) as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    name = Path(args.trace).stem
    report = {"trace": args.trace, **summary(result, policy, figures, args.slo_s, args.window_s)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", report, result, args.slo_s)
    plot(out / f"{name}.png", result, policy, args.slo_s, f"{name}: {Path(args.policy).name} on {figures.cpu}")
    print(format_summary(name, report))
    print(f"  wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return 0


def add_autoscale_command(sub: Any) -> None:
    """Register ``autoscale simulate`` on the ``aiserve`` parser."""
    autoscale = sub.add_parser("autoscale", help="the inference autoscaling policy")
    commands = autoscale.add_subparsers(dest="autoscale_command", required=True)
    sim = commands.add_parser("simulate", help="replay an arrival trace against the policy")
    sim.add_argument("--trace", required=True, help="requests per second: CSV second,arrivals or a JSON list")
    sim.add_argument("--figures", default=str(FIGURES_PATH),
                     help="one replica's figures (YAML like the default, or a bench JSON with a sweep)")
    sim.add_argument("--policy", default=str(POLICY_PATH), help="the policy (default: the manifests' own)")
    sim.add_argument("--slo-s", type=float, default=GatewayConfig().slo_e2e_s,
                     help="P99 target in seconds (default: the gateway's slo_e2e_s)")
    sim.add_argument("--window-s", type=float, default=60.0, help="seconds of finished requests each P99 covers")
    sim.add_argument("--step-s", type=float, default=0.1, help="simulation step (must divide 1 s)")
    sim.add_argument("--out", default=str(DEFAULT_OUT), help="folder for TRACE.png and TRACE.json")
    sim.set_defaults(func=cmd_simulate)
