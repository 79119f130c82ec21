"""Where a request's answer lives in the cache: its namespace and what is matched by meaning.

No grpc, no pb (``cache_client.py`` sends the key to the cache service).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from services.gateway.domain import CacheKey, CacheScope


def cache_key(model: str, tenant: str, params: str, rendered: str,
              messages: Sequence[tuple[str, str]] | None, is_truncated: bool) -> CacheKey:
    """The namespace is model, tenant, decoding parameters and the conversation before the last
    user message (system prompt, earlier turns; as a sha256, the cache only compares it). Only a
    chat's last user message is matched by meaning: a raw prompt is text to continue, where the
    wording is the content, and a truncated prompt is not what the user wrote."""
    query, context = "", ""
    if messages and not is_truncated and messages[-1][0] == "user":
        query = messages[-1][1]
        earlier = json.dumps([list(m) for m in messages[:-1]], ensure_ascii=False, separators=(",", ":"))
        context = hashlib.sha256(earlier.encode("utf-8")).hexdigest()
    return CacheKey(CacheScope(model=model, tenant=tenant, params=params, context=context), rendered, query)
