"""CPU tensors on 2 MiB pages: aligned, advised, the same values as ordinary ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiserve.common.huge_pages import (
    ALIGN,
    HUGE_PAGE,
    HugePageArena,
    empty_on_huge_pages,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    """Whether this kernel gives huge pages to memory that asks (``[madvise]`` or ``[always]``)."""
    try:
        return "[never]" not in THP.read_text()
    except OSError:
        return False


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_tensor_starts_on_a_huge_page_and_holds_what_it_is_filled_with() -> None:
    shape = (3, 5, 2, 64, 1000)  # 3.8 MB of bf16
    t = empty_on_huge_pages(shape, torch.bfloat16).zero_()
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(t, torch.zeros(shape, dtype=torch.bfloat16))
    ones = empty_on_huge_pages((4, HUGE_PAGE // 16), torch.float32).fill_(1)
    assert ones.data_ptr() % HUGE_PAGE == 0 and bool((ones == 1).all())


def test_a_small_tensor_or_another_device_is_an_ordinary_one() -> None:
    small = empty_on_huge_pages((16, 16), torch.float32)
    assert small.shape == (16, 16) and small.untyped_storage().nbytes() == 16 * 16 * 4
    meta = empty_on_huge_pages((1024, 1024), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (1024, 1024)


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
def test_the_kernel_backs_an_advised_tensor_with_huge_pages_once_it_is_filled() -> None:
    for _ in range(3):  # touched memory of the same size freed: an allocator would hand it out again
        torch.ones(5 * HUGE_PAGE, dtype=torch.uint8).sum()
    t = empty_on_huge_pages((4 * HUGE_PAGE,), torch.uint8).zero_()
    assert huge_kib_at(t.data_ptr()) >= 4 * 2048  # four 2 MiB pages back it


def test_the_arena_packs_tensors_one_after_another_each_a_copy() -> None:
    arena = HugePageArena(chunk_bytes=8 * HUGE_PAGE)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(rows, 576, generator=g) for rows in (576, 192, 3, 1536)]
    copies = [arena.copy(s, torch.bfloat16) for s in sources]
    for s, c in zip(sources, copies, strict=True):
        assert c.dtype == torch.bfloat16 and c.shape == s.shape and torch.equal(c, s.to(torch.bfloat16))
        assert c.data_ptr() % ALIGN == 0
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * 2) for c in copies)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))  # no overlap
    assert spans[0][0] % HUGE_PAGE == 0  # the chunk starts on a huge page
    assert spans[-1][1] - spans[0][0] < 8 * HUGE_PAGE  # one chunk holds them all
    big = arena.copy(torch.zeros(8 * HUGE_PAGE // 4 + 1, dtype=torch.float32))  # over half a chunk: its own
    assert big.data_ptr() % HUGE_PAGE == 0 and not spans[0][0] <= big.data_ptr() < spans[-1][1]


def test_the_arena_opens_a_new_chunk_when_one_is_full() -> None:
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    first = arena.empty((HUGE_PAGE + 1,), torch.uint8)
    second = arena.empty((HUGE_PAGE,), torch.uint8)  # fits after the first, 64-aligned
    third = arena.empty((2 * HUGE_PAGE,), torch.uint8)  # half a chunk does not fit after them: a new chunk
    assert second.data_ptr() == first.data_ptr() + HUGE_PAGE + ALIGN
    assert third.data_ptr() % HUGE_PAGE == 0 and third.data_ptr() != first.data_ptr()
