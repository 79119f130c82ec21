"""CPU tensors on 2 MiB pages: the inference service's model weights.

A decode step reads the whole model (268 MB in bf16 for the default model): on 4 KiB pages
~65,000 pages a step, each a TLB entry to fetch and a new stream for the hardware prefetcher.
Where the kernel offers transparent huge pages to memory that asks for them
(``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise`` or ``always``), tensors from
here ask with ``madvise(MADV_HUGEPAGE)`` before their pages are first touched, so they fault in
as 2 MiB pages. Measured on the 2-core AMD EPYC (2026-12-07, two processes in turns, docs/engine.md
"Weights on huge pages"): the one-row products (``csrc/gemv.cpp``) over every weight 19-27%
faster, one sequence decoding ~6% faster. The KV cache is not put here: see that page.

Where the advice is not available (not Linux, THP ``never``, another device) the tensors are
ordinary ones: the advice changes where the pages come from, never what the tensor holds.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 1 << 21
"""The x86-64 transparent huge page: 2 MiB."""
ALIGN = 64
"""Where ``HugePageArena`` starts each tensor: a cache line (what torch's own allocator gives)."""
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
                        ) -> torch.Tensor:
    """``torch.empty(shape)`` whose storage starts on a 2 MiB boundary of a mapping of its own,
    advised to 2 MiB pages (on the CPU, at least a huge page of bytes, on Linux); otherwise
    plain ``torch.empty``. Fill it before use: its pages are backed as they are first touched.

    The mapping is a fresh private anonymous one (``mmap``), not torch's allocator: memory that
    allocator hands out again was touched before, on 4 KiB pages, and advice does not change
    pages that exist already. The tensor keeps the mapping alive."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE or _ADVICE is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    # One huge page of slack to start on a boundary; it is never touched, so never resident.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds ``region`` as long as it lives
    offset = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages
        region.madvise(_ADVICE, offset, nbytes)
    return raw[offset:offset + nbytes].view(dtype).view(tuple(shape))


class HugePageArena:
    """Many CPU tensors packed one after another into chunks on 2 MiB pages: the model's
    weights, each a few hundred KiB to a few MiB, too small to start on a huge page of their own.
    A tensor larger than half a chunk gets a mapping of its own (``empty_on_huge_pages``). What a
    chunk has left at its end is never touched, so never resident."""

    def __init__(self, chunk_bytes: int = 32 * HUGE_PAGE) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` in the arena."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.chunk_bytes // 2:
            return empty_on_huge_pages(shape, dtype)
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self.chunk_bytes:
            self._chunk, start = empty_on_huge_pages((self.chunk_bytes,), torch.uint8), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(tuple(shape))

    def copy(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``t`` (converted to ``dtype``) copied into the arena."""
        return self.empty(t.shape, dtype or t.dtype).copy_(t)
