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

import ctypes
import ctypes.util
import math
import sys
from collections.abc import Callable, Sequence
from functools import cache

import torch

HUGE_PAGE = 1 << 21
"""The x86-64 transparent huge page: 2 MiB."""
MADV_HUGEPAGE = 14
ALIGN = 64
"""Where ``HugePageArena`` starts each tensor: a cache line (what torch's own allocator gives)."""


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn  # type: ignore[no-any-return]


def advise_huge(address: int, nbytes: int) -> bool:
    """Ask for 2 MiB pages over ``[address, address + nbytes)`` (``address`` 4 KiB-aligned);
    whether the kernel took the advice (False where it has no THP, or refuses)."""
    fn = _madvise()
    return fn is not None and nbytes > 0 and fn(address, nbytes, MADV_HUGEPAGE) == 0


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
                        ) -> torch.Tensor:
    """``torch.empty(shape)`` whose storage starts on a 2 MiB boundary and is advised to 2 MiB
    pages (on the CPU, at least a huge page of bytes); otherwise plain ``torch.empty``. Fill it
    before use: its pages are backed as they are first touched."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or _madvise() is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    # The slack of one huge page is never touched, so never resident.
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    advise_huge(raw.data_ptr() + offset, nbytes)
    return raw[offset:offset + nbytes].view(dtype).view(tuple(shape))


class HugePageArena:
    """Many CPU tensors packed one after another into chunks on 2 MiB pages: the model's
    weights, each a few hundred KiB to a few MiB, too small to start on a huge page of their own.
    A tensor larger than a chunk gets its own (``empty_on_huge_pages``). What a chunk has left
    at its end is never touched, so never resident."""

    def __init__(self, chunk_bytes: int = 32 * HUGE_PAGE) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` in the arena."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
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
