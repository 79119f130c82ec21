"""CPU matrix products on oneDNN-packed weights, and the row-count buckets their kernels are
built for: the inference service's forward (which dtype its products run in is chosen in
services/inference/precision.py) and the cache's embedding model (services/cache/minilm.py).

``F.linear`` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every
call; a weight packed once at load runs the same kernel without that (docs/engine.md, "Packed
weights"). In float32, ``F.linear`` runs MKL's sgemm, which on the AMD EPYC measured 2-3x slower
than oneDNN on a packed float32 weight at 4 to 64 rows, AVX-512 or capped to AVX2. bf16 weights
are packed only where the packed product equals ``F.linear`` bit for bit, float32 ones where it
is within float32 rounding of it (another summation order): ``pack_checked``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 64  # oneDNN's layout hint; any row count runs on the packed weight
# Larger steps (a budget above this) build their few kernels when they first run: warming them
# would run products of gigabytes at start for a budget that is rarely used in full.
PREPARE_MAX_ROWS = 4096


PACKABLE = (torch.bfloat16, torch.float32)


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` [out, in] (bf16 or float32, on the CPU) reordered once into oneDNN's blocked layout,
    or None where that is not available.

    ``F.linear`` on a bf16 CPU tensor runs the same oneDNN kernel but reorders the weight on
    every call; packed, a decode step's products run 1.3-2.8x faster (1 to 64 rows, measured
    on the 2-core VM) with bit-identical results, which ``packing_is_exact`` checks at load.
    Which bf16 weights the callers pack is theirs to say (where the CPU has bf16 instructions).
    """
    if w.device.type != "cpu" or w.dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return None


def pack_checked(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """``pack_weight(w)`` where its product is ``F.linear``'s, else None: the weight to run
    packed, or run it unpacked. bf16: bit for bit (``packing_is_exact``); float32: within
    float32 rounding (``packing_is_close``)."""
    packed = pack_weight(w)
    if packed is None:
        return None
    check = packing_is_exact if w.dtype == torch.bfloat16 else packing_is_close
    return packed if check(w, b, packed) else None


def bucket_rows(rows: int) -> int:
    """The row count a packed product runs with: ``rows`` up to 32, then rounded up to one of
    four steps per power of two (40, 48, 56, 64, 80, ...), so at most 25% more rows.

    oneDNN builds a kernel for each input shape (~1-1.5 ms, measured) and caches up to 1,024 of
    them; a step's row count is its number of new tokens, which varies from step to step.
    Unbucketed, serving kept building kernels, and the cache grew resident memory by ~350 MB
    over 2,000 soak requests (AMX VM, 2026-12-03). Bucketed, the default 512-token step budget
    needs 48 kernels per weight shape, all built at start (``prepare_kernels``).
    """
    if rows <= 32:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, in] @ the packed weight, run on ``bucket_rows(M)`` rows (zeros below ``x``)."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")


def packing_is_exact(w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor) -> bool:
    """The packed product equals ``F.linear`` bit for bit on a few row counts."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 64):
        x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
        if not torch.equal(packed_linear(x, packed, b), F.linear(x, w, b)):
            return False
    return True


def packing_is_close(w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor) -> bool:
    """The packed product is within float32 rounding of ``F.linear`` (1e-5 of the largest
    output) on a few row counts: another summation order, not another layout (a wrong one is
    off by the outputs' own size)."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 64):
        x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
        expected = F.linear(x, w, b)
        scale = float(expected.abs().max()) or 1.0
        if not torch.allclose(packed_linear(x, packed, b), expected, rtol=0.0, atol=1e-5 * scale):
            return False
    return True


def kernel_buckets(max_rows: int) -> list[int]:
    """Every bucketed row count up to ``max_rows`` (at most ``PREPARE_MAX_ROWS``), ascending."""
    buckets, limit = [bucket_rows(1)], min(max_rows, PREPARE_MAX_ROWS)
    while buckets[-1] < limit:  # each bucket once, without walking every row count
        buckets.append(bucket_rows(buckets[-1] + 1))
    return buckets


def build_kernels(weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]], max_rows: int) -> int:
    """Run each packed weight ``(packed, b)`` once at every bucket up to ``max_rows``, so oneDNN
    builds its kernels now and not while serving. Returns the number of products run."""
    buckets = kernel_buckets(max_rows)
    with torch.inference_mode():
        for packed, b in weights:
            for rows in buckets:
                packed_linear(torch.zeros(rows, packed.shape[1], dtype=packed.dtype), packed, b)
    return len(weights) * len(buckets)
