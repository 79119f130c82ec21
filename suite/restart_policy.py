"""When the supervisor restarts a child that exited unasked, and when it gives up.

Pure arithmetic, no processes and no clock (docs/decisions.md, decision 47): the delay before
restart k in a row is ``first_backoff_s * 2**k`` capped at ``max_backoff_s`` (1 s, 2 s, 4 s, ...
30 s); once a restarted child reports SERVING the row ends and the next delay is the first
again. A child that exits before it reports SERVING is a failed start; ``max_start_failures`` of
them in a row and the supervisor gives up.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """The backoff and give-up rule of one supervised instance."""

    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_start_failures: int = 5
    start_failures: int = field(default=0, init=False)
    """Starts in a row that ended before SERVING."""
    _in_a_row: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.first_backoff_s < 0 or self.max_backoff_s < self.first_backoff_s:
            raise ValueError(f"backoff: need 0 <= first ({self.first_backoff_s}) <= max ({self.max_backoff_s})")
        if self.max_start_failures < 1:
            raise ValueError(f"max_start_failures: must be at least 1, got {self.max_start_failures}")

    def after_exit(self, reached_serving: bool) -> float | None:
        """Seconds to wait before restarting a child that exited unasked, or None: give up.

        ``reached_serving``: whether that child had reported SERVING (else it failed to start)."""
        if not reached_serving:
            self.start_failures += 1
            if self.start_failures >= self.max_start_failures:
                return None
        delay = min(self.first_backoff_s * 2 ** min(self._in_a_row, 32), self.max_backoff_s)  # no float overflow
        self._in_a_row += 1
        return delay

    def serving(self) -> None:
        """The restarted child reports SERVING: the next exit starts a new row."""
        self._in_a_row = 0
        self.start_failures = 0
