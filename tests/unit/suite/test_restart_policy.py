"""The supervisor's backoff and give-up rule (decision 47), as arithmetic."""

from __future__ import annotations

import pytest

from suite.restart_policy import RestartPolicy


def test_the_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=30.0, max_start_failures=5)
    delays = [policy.after_exit(reached_serving=True) for _ in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert policy.start_failures == 0  # every one of them had served: no failed start


def test_serving_again_starts_a_new_row() -> None:
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.after_exit(True), policy.after_exit(False), policy.after_exit(False)] == [1.0, 2.0, 4.0]
    assert policy.start_failures == 2
    policy.serving()
    assert policy.start_failures == 0
    assert policy.after_exit(True) == 1.0


def test_it_gives_up_after_max_start_failures_in_a_row() -> None:
    policy = RestartPolicy(first_backoff_s=0.5, max_backoff_s=4.0, max_start_failures=3)
    assert policy.after_exit(True) == 0.5  # a crash after serving: restart
    assert policy.after_exit(False) == 1.0  # restart 1 failed to start
    assert policy.after_exit(False) == 2.0  # restart 2 too
    assert policy.after_exit(False) is None  # the third failed start in a row: give up
    assert policy.start_failures == 3


def test_failed_starts_count_only_in_a_row() -> None:
    policy = RestartPolicy(max_start_failures=2)
    assert policy.after_exit(False) is not None
    policy.serving()  # one start succeeded in between
    assert policy.after_exit(False) is not None
    assert policy.after_exit(False) is None


def test_a_huge_row_stays_at_the_cap() -> None:
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=30.0)
    for _ in range(2000):
        delay = policy.after_exit(True)
    assert delay == 30.0


@pytest.mark.parametrize(("first", "cap", "failures"), [(-1.0, 30.0, 5), (2.0, 1.0, 5), (1.0, 30.0, 0)])
def test_nonsense_settings_are_refused(first: float, cap: float, failures: int) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(first, cap, failures)
