"""Why a generation ended: one enum for the engine, the gateway, the cache and the ledger.

A ``StrEnum``, so a reason is also its plain string ("stop") in log lines, metric labels and
ledger rows. The proto enum ``aiserve.v1.FinishReason`` maps to it in one place
(``aiserve/common/pb_enums.py``).
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """An EOS or stop token, or a stop string."""
    LENGTH = "length"
    """max_new_tokens reached."""
    CANCELLED = "cancelled"
    """The caller cancelled, or its deadline passed, after generation had started."""
    ERROR = "error"
    """The generation failed."""


STORABLE = frozenset({FinishReason.STOP, FinishReason.LENGTH})
"""Reasons of a normally finished answer: the only ones billed in full and cached."""
