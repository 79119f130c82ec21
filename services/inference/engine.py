"""The engine: requests in, token events out; the model runs in one dedicated worker thread.

This interim engine runs one request after another (prefill with a KV cache, then decode step
by step). Its public face, ``Engine.generate`` with ``GenerateRequest`` in and ``TokenEvent``
out, is the one the continuous-batching engine keeps. Asyncio callers never touch torch: they
enqueue a request, and the worker hands each event back with ``loop.call_soon_threadsafe``
into the request's own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from aiserve.common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from aiserve.common.logging import get_logger
from services.inference.model import LoadedModel
from services.inference.sampler import SamplingParams, new_generator, sample

log = get_logger("engine")

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """One generation, in token ids (keyword-only fields). ``deadline``: ``time.monotonic()``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    """Higher waits less: the queue is ordered by priority, then arrival."""
    deadline: float | None = None
    """Past it while still queued: DeadlineExceeded, and the request never runs."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New ids of one request; the last event has ``finish_reason`` set.

    Counters are running totals, final on the last event. An engine failure is raised from
    ``generate`` (never sent as an event), so "error" is reserved for batch-level reporting.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    compute_ms: float


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one request. Fields marked (lock) change only under the engine lock."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent | BaseException] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    is_waiting: bool = True  # (lock)
    is_cancelled: bool = False  # (lock)

    def post(self, item: TokenEvent | BaseException) -> None:
        """Hand ``item`` to the consumer's event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            self.is_cancelled = True


class Engine:
    """Runs generations on one model; ``generate`` streams each request's token events."""

    def __init__(self, model: LoadedModel, max_queue: int, max_new_tokens_limit: int) -> None:
        self.model = model
        self.max_queue = max_queue
        self.max_new_tokens_limit = max_new_tokens_limit
        self._lock = threading.Condition()
        self._waiting: list[tuple[int, int, _Sequence]] = []  # heap of (-priority, arrival no., seq)
        self._arrivals = itertools.count()
        self._running: _Sequence | None = None
        self._is_accepting = True
        self._is_stopping = False
        self._thread: threading.Thread | None = None

    @property
    def num_waiting(self) -> int:
        """Requests queued for the model (what ``max_queue`` bounds)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return 0 if self._running is None else 1

    @property
    def is_draining(self) -> bool:
        return not self._is_accepting

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="inference-engine", daemon=True)
            self._thread.start()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Queue ``request`` and yield its events as the tokens are made.

        Raises InvalidArgument (bad request), ResourceExhausted (queue full), Unavailable
        (draining or stopped), DeadlineExceeded (deadline passed while queued). Stopping the
        iteration (aclose, task cancelled) cancels the request; the worker drops it within one
        decode step.
        """
        seq = self._submit(request)
        is_finished = False
        try:
            while True:
                item = await self._next_item(seq)
                if isinstance(item, BaseException):
                    is_finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    is_finished = True
                    return
        finally:
            if not is_finished:
                self._cancel(seq)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait (on the engine's condition, no polling) until nothing is queued or running."""
        def idle() -> bool:
            return not self._waiting and self._running is None

        def wait() -> bool:
            with self._lock:
                return self._lock.wait_for(idle, timeout_s)

        return await asyncio.to_thread(wait)

    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Refuse new requests (Unavailable) and wait for the accepted ones to finish."""
        with self._lock:
            self._is_accepting = False
        return await self.wait_idle(timeout_s)

    async def stop(self) -> None:
        """Refuse new requests, fail the queued ones (Unavailable), cancel the running one, and
        end the worker thread."""
        with self._lock:
            self._is_accepting, self._is_stopping = False, True
            for _, _, seq in self._waiting:
                seq.is_waiting = False
                seq.post(Unavailable("inference is stopping"))
            self._waiting.clear()
            if self._running is not None:
                self._running.is_cancelled = True
            self._lock.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # --- asyncio side -------------------------------------------------------------------------

    def _validate(self, request: GenerateRequest) -> None:
        prompt, model = request.prompt_token_ids, self.model
        if not prompt:
            raise InvalidArgument("prompt_token_ids: must hold at least 1 id, got 0")
        if (bad := next((i for i in prompt if not 0 <= i < model.vocab_size), None)) is not None:
            raise InvalidArgument(
                f"prompt_token_ids: id {bad} is outside the vocabulary 0..{model.vocab_size - 1}")
        if not 1 <= request.max_new_tokens <= self.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens: must be 1..{self.max_new_tokens_limit}, "
                                  f"got {request.max_new_tokens}")
        if len(prompt) + request.max_new_tokens > model.context_length:
            raise InvalidArgument(
                f"prompt_token_ids + max_new_tokens: {len(prompt)} + {request.max_new_tokens} "
                f"exceeds the context length {model.context_length}")
        request.params.validate(model.vocab_size)

    def _submit(self, request: GenerateRequest) -> _Sequence:
        self._validate(request)
        if request.deadline is not None and request.deadline <= time.monotonic():
            raise DeadlineExceeded("deadline passed before the request was queued")
        seq = _Sequence(request, asyncio.get_running_loop())
        with self._lock:
            if not self._is_accepting:
                raise Unavailable("inference is draining; retry on another replica")
            if len(self._waiting) >= self.max_queue:
                raise ResourceExhausted(f"inference queue is full (max_queue {self.max_queue})")
            heapq.heappush(self._waiting, (-request.priority, next(self._arrivals), seq))
            self._lock.notify_all()
        return seq

    async def _next_item(self, seq: _Sequence) -> TokenEvent | BaseException:
        """The next event; while ``seq`` is still queued, bounded by its deadline."""
        deadline = seq.request.deadline
        if deadline is None or not seq.is_waiting:
            return await seq.events.get()
        try:
            return await asyncio.wait_for(seq.events.get(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            with self._lock:
                if seq.is_waiting:  # never reached the model: take it out of the queue
                    self._remove_waiting(seq)
                    return DeadlineExceeded("deadline passed while queued for the model")
            return await seq.events.get()  # it started meanwhile: deadlines bound queueing only

    def _cancel(self, seq: _Sequence) -> None:
        with self._lock:
            seq.is_cancelled = True
            if seq.is_waiting:
                self._remove_waiting(seq)

    def _remove_waiting(self, seq: _Sequence) -> None:
        """Drop ``seq`` from the queue (lock held)."""
        seq.is_waiting = False
        self._waiting = [entry for entry in self._waiting if entry[2] is not seq]
        heapq.heapify(self._waiting)
        self._lock.notify_all()

    # --- worker thread ------------------------------------------------------------------------

    def _work(self) -> None:
        while (seq := self._next_sequence()) is not None:
            try:
                self._run(seq)
            except Exception as exc:  # noqa: BLE001 - reported to its caller; the worker lives on
                log.exception("generation_failed", request_id=seq.request.request_id)
                seq.post(RuntimeError(f"generation failed: {exc}"))
            finally:
                with self._lock:
                    self._running = None
                    self._lock.notify_all()

    def _next_sequence(self) -> _Sequence | None:
        """Block until a request is queued; None once stopping. Expired requests are failed."""
        with self._lock:
            while True:
                self._lock.wait_for(lambda: self._waiting or self._is_stopping)
                if self._is_stopping:
                    return None
                _, _, seq = heapq.heappop(self._waiting)
                seq.is_waiting = False
                deadline = seq.request.deadline
                if deadline is not None and deadline <= time.monotonic():
                    seq.post(DeadlineExceeded("deadline passed while queued for the model"))
                    self._lock.notify_all()
                    continue
                self._running = seq
                return seq

    def _run(self, seq: _Sequence) -> None:
        """Prefill, then decode one token per step until a stop condition or cancellation."""
        request, model = seq.request, self.model
        queue_ms = (time.monotonic() - seq.arrived) * 1000
        compute_s = 0.0
        generator = new_generator(request.params, model.device)
        seen = list(request.prompt_token_ids)
        input_ids = torch.tensor([seen], dtype=torch.long, device=model.device)  # [1, T]
        cache = DynamicCache(config=model.model.config)
        with torch.inference_mode():
            for step in range(1, request.max_new_tokens + 1):
                if seq.is_cancelled:  # consumer gone or engine stopping: tell whoever listens
                    seq.post(TokenEvent((), "cancelled", len(request.prompt_token_ids), step - 1,
                                        queue_ms, compute_s * 1000))
                    return
                started = time.perf_counter()
                out = model.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
                token = int(sample(out.logits[:, -1, :], [request.params], [generator], [seen])[0])
                compute_s += time.perf_counter() - started
                seen.append(token)
                reason = self._finish_reason(request, token, step, len(seen))
                seq.post(TokenEvent((token,), reason, len(request.prompt_token_ids), step,
                                    queue_ms, compute_s * 1000))
                if reason is not None:
                    return
                input_ids = torch.tensor([[token]], dtype=torch.long, device=model.device)  # [1, 1]

    def _finish_reason(self, request: GenerateRequest, token: int, step: int,
                       num_tokens: int) -> FinishReason | None:
        if token in request.stop_token_ids or (
            not request.ignore_eos and token in self.model.eos_token_ids
        ):
            return "stop"
        if step >= request.max_new_tokens or num_tokens >= self.model.context_length:
            return "length"
        return None
