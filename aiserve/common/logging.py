"""JSON logs to stdout through structlog, with the request id bound to every line, and the
``startup`` lines that time a process's start."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

from aiserve.common.context import request_id_var, traceparent_var


def _add_request_context(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if (rid := request_id_var.get()) and "request_id" not in event:
        event["request_id"] = rid
    if tp := traceparent_var.get():
        event.setdefault("traceparent", tp)
    return event


def configure_logging(service: str, level: str = "info") -> None:
    """One JSON object per line on stdout: timestamp, level, service, event, request_id, ..."""
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(stream=sys.stdout, level=numeric, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_request_context,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name) if name else structlog.get_logger()


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc, 10 ms resolution; 0.0 elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


def log_startup(phase: str, **fields: object) -> None:
    """One ``startup`` log line for a phase of the process's start ("imported", "loaded",
    "warmed", ...) with the seconds since the process started and the CPU seconds it has used
    (``bench/cold_start.py`` reads them, with the ``health_changed`` line that reports SERVING)."""
    get_logger("startup").info("startup", phase=phase, process_age_s=round(process_age_s(), 3),
                               cpu_s=round(time.process_time(), 3), **fields)
