"""A discrete-time simulation of the inference fleet under the autoscaling policy, so that a
policy change can be judged on a trace before it reaches a cluster.

Each step (0.1 s by default) arrivals from the trace go round-robin to the pods in the gateway's
list (as services/gateway/replicas.py picks); a pod runs up to max_num_seqs requests at once and
queues the rest, refusing past max_queue. Running requests share the pod's measured throughput at
that concurrency, so a request alone takes `latency_s(1)` and one among 64 `latency_s(64)`.
Prometheus scrapes each pod's gauge (the waiting count) and the fleet's generated-tokens counter
every scrape interval; every sync period the HPA reads the last scrape's mean gauge and the
counter's rate over its window, takes the larger of the two triggers' counts and applies
suite/autoscale_policy.py (formula, tolerance, stabilisation, rate limits, bounds). A new pod
exports its gauge after its cold start, is Ready at the next startup probe, and takes traffic at
the gateway's next lookup; a pod told to stop takes traffic for its preStop pause and leaves once
it has finished what it holds. The fleet starts warm at the minimum. Pod scheduling, image pulls
and node provisioning are not modelled (a node with room and the image is assumed).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from suite.autoscale_inputs import Figures
from suite.autoscale_policy import Policy, average_value_desired, desired, gauges, rate_limited, stabilised


@dataclass
class Pod:
    """One inference pod: when it is up, Ready and in the gateway's list, and what it holds."""

    up_s: float
    ready_s: float
    serving_s: float
    slots: int
    stop_s: float = math.inf
    waiting: deque[float] = field(default_factory=deque)
    remaining: np.ndarray = field(init=False)  # [slots] tokens left per running request
    arrived: np.ndarray = field(init=False)    # [slots] arrival time of each running request
    active: np.ndarray = field(init=False)     # [slots] whether the slot runs a request

    def __post_init__(self) -> None:
        self.remaining = np.zeros(self.slots)
        self.arrived = np.zeros(self.slots)
        self.active = np.zeros(self.slots, dtype=bool)

    def is_ready(self, t: float) -> bool:
        return self.ready_s <= t < self.stop_s

    def is_idle(self) -> bool:
        return not self.waiting and not self.active.any()


GAUGES: dict[str, Callable[[Pod], int]] = {
    "aiserve_inference_queue_length": lambda pod: len(pod.waiting),
    "aiserve_inference_running": lambda pod: int(pod.active.sum()),
}
"""What each of the inference service's gauges reads on a simulated pod (services/inference/server.py)."""
TOKENS_COUNTER = "aiserve_inference_generated_tokens_total"
"""The one counter a rate trigger may read: tokens the fleet generated."""


@dataclass(frozen=True)
class Result:
    """Per-second series (index = second of the trace) and the run's totals."""

    arrivals: np.ndarray
    replicas: np.ndarray
    """Pods the HPA asked for (the Deployment's spec.replicas) at each second."""
    serving: np.ndarray
    """Pods in the gateway's list at each second."""
    metric: np.ndarray
    """The query's value at each second: the policy's gauge(s), averaged over the pods exporting them."""
    token_rate: np.ndarray
    """The fleet's tokens per second as the rate trigger last read it (rate over the scrapes)."""
    p99_s: np.ndarray
    """P99 of queue wait + service over the requests that finished (or were refused: infinite)
    in the window ending at each second; NaN when none did."""
    scale_events: tuple[tuple[float, int, int], ...]
    """(time, replicas before, replicas after) of each change the HPA made."""
    replica_seconds: float
    """Seconds of every pod that existed, from its start to its exit (what the fleet costs)."""
    completed: int
    rejected: int
    unfinished: int
    finished_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """When each completed request finished, in order."""


class Simulation:
    """One run of `policy` over `trace` (requests arriving in each second) with `figures`."""

    def __init__(self, policy: Policy, figures: Figures, trace: np.ndarray, step_s: float = 0.1,
                 window_s: float = 60.0) -> None:
        if policy.min_replicas < 1:
            raise ValueError("min replicas must be >= 1: the mean of no replica's gauge is no reading, "
                             "so KEDA could never activate a fleet scaled to zero on this query")
        self.policy, self.figures, self.trace, self.dt, self.window_s = policy, figures, trace, step_s, window_s
        self.steps_per_s = round(1 / step_s)
        if not math.isclose(self.steps_per_s * step_s, 1.0):
            raise ValueError(f"step_s must divide one second, got {step_s}")
        unknown = [g for g in gauges(policy) if g not in GAUGES]
        if policy.rate_counter not in ("", TOKENS_COUNTER):
            unknown.append(policy.rate_counter)
        if unknown:
            raise ValueError(f"the simulator models the gauges {sorted(GAUGES)}, not {unknown}")
        self.pods: list[Pod] = [Pod(0.0, 0.0, 0.0, figures.max_concurrency) for _ in range(policy.min_replicas)]
        self.rate = np.array([figures.throughput(n) / n if n else 0.0 for n in range(figures.max_concurrency + 1)])
        self.metric: float | None = None
        self.tokens = 0.0  # the fleet's generated-tokens counter
        self.scrapes: deque[tuple[float, float]] = deque()  # (time, counter) of the scrapes in the rate window
        self.history: list[tuple[float, int]] = []
        self.events: list[tuple[float, int]] = []
        self.scale_events: list[tuple[float, int, int]] = []
        self.finished: list[np.ndarray] = []  # [2, n] finish time, latency
        self.rejected: list[float] = []
        self.next_pod = 0
        self.replica_seconds = 0.0

    def _spec(self) -> list[Pod]:
        return [p for p in self.pods if p.stop_s == math.inf]

    def _gauge(self, t: float) -> float | None:
        """The query's value now: the mean over the pods that export the gauges of their sum."""
        up = [sum(GAUGES[g](p) for g in gauges(self.policy)) for p in self.pods if p.up_s <= t]
        return float(np.mean(up)) if up else None

    def _scrape(self, t: float) -> None:
        self.metric = self._gauge(t)
        self.scrapes.append((t, self.tokens))
        while t - self.scrapes[0][0] > self.policy.rate_window_s:
            self.scrapes.popleft()

    def _rate(self) -> float:
        """rate(counter[window]) over the scrapes in the window (0 until there are two)."""
        (t0, c0), (t1, c1) = self.scrapes[0], self.scrapes[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0

    def _proposal(self, current: int, ready: int) -> int:
        """The HPA's raw count: the larger of each trigger's."""
        assert self.metric is not None
        raw = desired(self.policy, current, self.metric, ready)
        if self.policy.rate_counter:
            raw = max(raw, average_value_desired(current, self._rate(), self.policy.rate_target_per_replica,
                                                 self.policy.tolerance))
        return raw

    def _sync(self, t: float) -> None:
        """One HPA decision from the last scrape."""
        if self.metric is None:
            return
        spec = self._spec()
        current, ready = len(spec), sum(p.is_ready(t) for p in spec)
        self.history.append((t, self._proposal(current, ready)))
        horizon = max(self.policy.up_window_s, self.policy.down_window_s)
        self.history = [(s, r) for s, r in self.history if t - s < horizon] or self.history[-1:]
        wanted = stabilised(t, current, self.history, self.policy)
        new = rate_limited(t, current, wanted, self.events, self.policy)
        if new != current:
            self.events.append((t, new - current))
            self.scale_events.append((t, current, new))
            self._scale(t, spec, new)

    def _scale(self, t: float, spec: list[Pod], new: int) -> None:
        """Start pods, or stop the ones a ReplicaSet removes first: not Ready, then the newest."""
        pol, cold = self.policy, self.figures.cold_start_s
        for _ in range(new - len(spec)):
            ready = t + math.ceil(cold / pol.startup_probe_period_s) * pol.startup_probe_period_s
            serving = math.ceil(ready / pol.gateway_resolve_interval_s) * pol.gateway_resolve_interval_s
            self.pods.append(Pod(t + cold, ready, serving, self.figures.max_concurrency))
        for pod in sorted(spec, key=lambda p: (p.is_ready(t), -p.ready_s))[:max(0, len(spec) - new)]:
            pod.stop_s = t

    def _dispatch(self, t: float, arrivals: np.ndarray) -> None:
        """Round-robin over the pods in the gateway's list; a full queue refuses the request."""
        listed = [p for p in self.pods if p.serving_s <= t < p.stop_s + self.policy.pre_stop_s]
        for at in arrivals:
            if not listed:
                self.rejected.append(float(at))
                continue
            pod = listed[self.next_pod % len(listed)]
            self.next_pod += 1
            if len(pod.waiting) >= self.figures.max_queue:
                self.rejected.append(float(at))
            else:
                pod.waiting.append(float(at))

    def _serve(self, t: float, pod: Pod) -> None:
        """Admit from the queue into free slots, then advance every running request one step."""
        if pod.waiting and not pod.active.all():
            for slot in np.flatnonzero(~pod.active)[:len(pod.waiting)]:
                pod.arrived[slot], pod.remaining[slot], pod.active[slot] = pod.waiting.popleft(), \
                    self.figures.answer_tokens, True
        n = int(pod.active.sum())
        if not n:
            return
        rate = self.rate[n]  # tokens/s each running request gets
        self.tokens += rate * n * self.dt
        pod.remaining[pod.active] -= rate * self.dt
        done = pod.active & (pod.remaining <= 0)
        if done.any():
            finish = t + self.dt + pod.remaining[done] / rate
            self.finished.append(np.stack([finish, finish - pod.arrived[done]]))
            pod.active[done] = False

    def run(self) -> Result:
        seconds = len(self.trace)
        arrivals = np.concatenate([s + (np.arange(k) + 0.5) / k for s, k in enumerate(self.trace) if k] or [[]])
        scrape_every = round(self.policy.scrape_interval_s * self.steps_per_s)
        sync_every = round(self.policy.sync_period_s * self.steps_per_s)
        series = np.zeros((4, seconds))
        head = 0
        for i in range(seconds * self.steps_per_s):
            t = i / self.steps_per_s
            if i % scrape_every == 0:
                self._scrape(t)
            if i % sync_every == sync_every // 2:  # the HPA's reads fall between two scrapes
                self._sync(t)
            end = int(np.searchsorted(arrivals, t + self.dt))
            self._dispatch(t, arrivals[head:end])
            head = end
            for pod in self.pods:
                self._serve(t, pod)
            self.pods = [p for p in self.pods if not (t >= p.stop_s + self.policy.pre_stop_s and p.is_idle())]
            self.replica_seconds += len(self.pods) * self.dt
            if i % self.steps_per_s == 0:
                listed = sum(p.serving_s <= t < p.stop_s for p in self.pods)
                series[:, i // self.steps_per_s] = (len(self._spec()), listed, self._gauge(t) or 0.0, self._rate())
        return self._result(series, head)

    def _result(self, series: np.ndarray, dispatched: int) -> Result:
        done = np.concatenate(self.finished, axis=1) if self.finished else np.zeros((2, 0))
        refused = np.array(self.rejected)
        times = np.concatenate([done[0], refused])
        latencies = np.concatenate([done[1], np.full(len(refused), np.inf)])
        order = np.argsort(times)
        times, latencies = times[order], latencies[order]
        p99 = np.full(len(self.trace), np.nan)
        for s in range(len(self.trace)):
            lo, hi = np.searchsorted(times, [s + 1 - self.window_s, s + 1])
            if hi > lo:
                window = np.sort(latencies[lo:hi])
                p99[s] = window[max(0, math.ceil(0.99 * len(window)) - 1)]  # nearest rank
        return Result(arrivals=self.trace.copy(), replicas=series[0].astype(int), serving=series[1].astype(int),
                      metric=series[2], token_rate=series[3], p99_s=p99, scale_events=tuple(self.scale_events),
                      replica_seconds=self.replica_seconds, completed=done.shape[1], rejected=len(refused),
                      unfinished=dispatched - done.shape[1] - len(refused), finished_s=np.sort(done[0]))


def simulate(policy: Policy, figures: Figures, trace: np.ndarray, step_s: float = 0.1,
             window_s: float = 60.0) -> Result:
    """Replay `trace` against the fleet that `policy` scales; see the module's docstring."""
    return Simulation(policy, figures, trace, step_s, window_s).run()
