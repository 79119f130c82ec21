"""Fixtures of the inference tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def two_torch_threads() -> Iterator[None]:
    """torch on 2 intra-op threads for the module's tests; the previous count is restored after
    it, since the setting is process-wide and would otherwise leak into later modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
