"""Domain enums <-> their proto enums, in one place (the services' pb adapters use these)."""

from __future__ import annotations

from aiserve.common.finish import FinishReason
from aiserve.v1 import common_pb2

_FINISH_PREFIX = "FINISH_REASON_"


def finish_reason_to_pb(reason: FinishReason | None) -> common_pb2.FinishReason:
    """FinishReason.STOP -> FINISH_REASON_STOP; None (still running) -> UNSPECIFIED."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return common_pb2.FinishReason.Value(_FINISH_PREFIX + reason.name)


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """FINISH_REASON_STOP -> FinishReason.STOP; UNSPECIFIED and unknown numbers -> None."""
    try:
        name = common_pb2.FinishReason.Name(value).removeprefix(_FINISH_PREFIX)  # type: ignore[arg-type]
    except ValueError:
        return None
    return FinishReason.__members__.get(name)
