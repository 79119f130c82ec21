"""The engine's health probe: one token through the real model on a scratch KV cache of its own.

The probe must show that the model still computes (weights, kernels, device) without touching
what the batch owns: it writes its K/V into one scratch slot of ``PROBE_SLOT_LEN`` tokens
allocated once at start, so it never takes one of the ``max_num_seqs`` slots, never preempts a
sequence and never changes a running sequence's cache. The engine runs it on its worker thread
between two steps (batch_engine.py); ``ProbeCalls`` and ``settle_all`` carry the asks and the
answers between the asyncio callers and that thread, and ``LoopWakers`` wakes the health loop
after a failed step.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch

from services.inference.llama import LlamaModel
from services.inference.runner import BatchRow, build_batch

PROBE_SLOT_LEN = 1
"""Tokens of the scratch slot: one, the probe's only token, at position 0."""
PROBE_TOKEN_ID = 0
"""The token the probe computes (any id of the vocabulary would do)."""

ProbeCall = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]
"""A probe someone awaits: their loop and the future to settle on it."""


class ProbeFailed(RuntimeError):
    """The model ran but its output is not usable (wrong shape, not finite, argmax outside the vocabulary)."""


class ModelProbe:
    """A one-token forward of ``model`` into a scratch K/V slot of its own; ``run`` checks the logits."""

    def __init__(self, model: LlamaModel) -> None:
        c = model.config
        self.model = model
        shape = (c.num_layers, 1, c.num_kv_heads, PROBE_SLOT_LEN, c.head_dim)
        self._k = torch.zeros(shape, dtype=model.dtype, device=model.device)  # [L, 1, KVH, 1, D]
        self._v = torch.zeros(shape, dtype=model.dtype, device=model.device)  # [L, 1, KVH, 1, D]
        self._batch = build_batch([BatchRow(0, 0, (PROBE_TOKEN_ID,), True)], c, PROBE_SLOT_LEN, model.device)

    def run(self) -> None:
        """One forward (call it on the torch thread, under inference mode); raises ProbeFailed
        when the logits are unusable, anything the forward raises otherwise."""
        logits = self.model.forward(self._batch, self._k, self._v)  # [1, V]
        vocab = self.model.config.vocab_size
        if tuple(logits.shape) != (1, vocab):
            raise ProbeFailed(f"logits have shape {tuple(logits.shape)}, expected (1, {vocab})")
        if not bool(torch.isfinite(logits).all()):
            raise ProbeFailed("logits are not finite")
        top = int(logits.argmax())
        if not 0 <= top < vocab:
            raise ProbeFailed(f"argmax {top} is outside the vocabulary 0..{vocab - 1}")


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (``torch.cuda.mem_get_info``); None for other devices."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


class ProbeCalls:
    """Probes asked for and not yet run (the engine guards it with its lock)."""

    def __init__(self) -> None:
        self._pending: list[ProbeCall] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def ask(self) -> asyncio.Future[None]:
        """A new probe for the running loop: the future the worker settles once it ran."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._pending.append((loop, future))
        return future

    def take(self) -> list[ProbeCall]:
        """Every pending probe, leaving none."""
        taken, self._pending = self._pending, []
        return taken


def settle_all(calls: list[ProbeCall], outcome: BaseException | None) -> None:
    """Answer each probe on its own loop (from any thread): passed, or failed with ``outcome``."""
    for loop, future in calls:
        with contextlib.suppress(RuntimeError):  # that loop has closed
            loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[None], outcome: BaseException | None) -> None:
    if future.done():  # its asker gave up (timed out or cancelled)
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)


class LoopWakers:
    """asyncio events, each of its own loop, that another thread can set."""

    def __init__(self) -> None:
        self._events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def add(self) -> asyncio.Event:
        """A new event of the running loop (its owner clears it)."""
        event = asyncio.Event()
        self._events.append((asyncio.get_running_loop(), event))
        return event

    def wake_all(self) -> None:
        """Set every event on its own loop (safe from any thread)."""
        for loop, event in self._events:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(event.set)
