"""Facts of the API that both ends of a call rely on, defined once."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20
"""Largest gRPC message a service sends or accepts (servers and the channels between services)."""
MAX_MUX_STREAMS = 10_000
"""Open streams one multiplexed call (GenerateMux, DetokenizeMux) may hold at once; the gateway
holds one per running or queued generation."""
CHAT_ROLES = ("system", "user", "assistant")
"""The roles a chat message may have."""
