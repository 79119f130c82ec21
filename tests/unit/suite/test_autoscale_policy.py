"""The replica formula against hand-worked cases, and the shipped policy file's reading."""
from suite.autoscale_policy import (
    Policy,
    desired,
    load_policy,
    prometheus_query,
    raw_desired,
    stabilised,
)

POLICY = Policy(metric_name="m", target_per_replica=8, min_replicas=1, max_replicas=8,
                tolerance=0.1, up_window_s=0, down_window_s=300)


def test_formula_hand_worked() -> None:
    # 2 replicas, 24 waiting each, target 8: ceil(2 * 3) = 6
    assert raw_desired(2, 24, 8, 0.1) == 6
    # 3 replicas, 4.1 waiting each: ceil(3 * 0.5125) = 2
    assert raw_desired(3, 4.1, 8, 0.1) == 2
    # ratio 1.09 is within the 10% tolerance: no change even though ceil(4 * 1.09) = 5
    assert raw_desired(4, 8.72, 8, 0.1) == 4
    # ratio 1.125 is outside it: ceil(4 * 1.125) = 5
    assert raw_desired(4, 9, 8, 0.1) == 5
    # ratio 0.9 is at the edge (inclusive): no change
    assert raw_desired(5, 7.2, 8, 0.1) == 5


def test_scale_down_takes_the_window_maximum() -> None:
    history = [(0.0, 6), (100.0, 2), (200.0, 3)]
    # at t=200 the window (300 s) still holds the 6: stay at the current 5
    assert stabilised(200.0, 5, history, POLICY) == 5
    # at t=350 the 6 is out of the window; the highest left is 3
    assert stabilised(350.0, 5, history + [(350.0, 2)], POLICY) == 3


def test_scale_up_is_immediate_and_clamped() -> None:
    assert stabilised(10.0, 2, [(10.0, 6)], POLICY) == 6
    assert stabilised(10.0, 2, [(10.0, 40)], POLICY) == 8
    assert stabilised(10.0, 1, [(10.0, 0)], POLICY) == 1


def test_shipped_policy_reads() -> None:
    policy = load_policy()
    assert policy.min_replicas >= 1 and policy.max_replicas >= policy.min_replicas
    assert policy.up_window_s < policy.down_window_s
    assert policy.tolerance == 0.1


def test_policy_helpers() -> None:
    assert desired(POLICY, 2, 24) == 6
    assert prometheus_query(POLICY, "smollm2@1") == 'avg(m{model="smollm2@1"})'
