"""The continuous-batching engine: many generations at once on one model, over the scheduler
(``scheduler.py``: what runs each step) and the runner (``runner.py``: the step on the device).

Asyncio callers never touch torch: ``generate`` queues a request with the scheduler (under the
engine lock) and awaits its events. One worker thread loops schedule -> execute -> update; the
model runs outside the lock, so new requests queue while a step computes and join the batch at
the next step. Each event goes back to the caller's loop with ``call_soon_threadsafe``.
Cancelling a caller's iteration aborts its sequence at the start of the next step, freeing
its KV slot; a failed step frees the slots of the sequences it held, is counted, and wakes
whoever watches ``step_errors``. ``probe`` runs one token through the model between two steps,
on a scratch slot of its own (health_probe.py), for the service's health loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from aiserve.common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from aiserve.common.finish import FinishReason
from aiserve.common.logging import get_logger, log_startup
from services.inference.draft_planning import max_logit_rows
from services.inference.engine_config import EngineConfig
from services.inference.engine_stats import EngineStats, StepStats, engine_stats
from services.inference.grammar import Grammars, RowGrammar
from services.inference.health_probe import LoopWakers, ModelProbe, ProbeCall, ProbeCalls, settle_all
from services.inference.kv_cache import KVCache, KVLayout, KVPlan
from services.inference.llama import LlamaModel
from services.inference.prefix_index import PrefixIndex
from services.inference.request import GenerateRequest, TokenEvent
from services.inference.request_record import Deliver, Post, RequestRecord, post_all
from services.inference.runner import KVCacheError, ModelRunner, Picked, RowSampling
from services.inference.sampler import MAX_TOP_LOGPROBS, new_generator
from services.inference.scheduler import Scheduler
from services.inference.scheduler_output import SchedulerOutput
from services.inference.sequence import Seq
from services.inference.speculative import NgramDrafter
from services.inference.torch_thread import adopt_thread_count

if TYPE_CHECKING:
    import xgrammar

log = get_logger("batch_engine")


class BatchEngine:
    """Runs many generations at once on one model; ``generate`` streams each one's events."""

    def __init__(self, model: LlamaModel, eos_ids: frozenset[int], config: EngineConfig | None = None,
                 grammars: Grammars | None = None) -> None:
        config = config or EngineConfig()
        c = model.config
        kv_dtype = torch.int8 if config.kv_cache.kv_dtype == "int8" else model.dtype
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
        plan = KVPlan.fit(config.kv_cache, layout, config.scheduler.max_num_seqs, c.max_position_embeddings)
        self.model, self.eos_ids, self.config = model, eos_ids, config
        self.grammars = grammars
        """Compiles constrained requests' grammars (None: constrained decoding is refused)."""
        self.cache = KVCache(layout, plan, model.device)
        prefix = PrefixIndex(plan.num_blocks, plan.block_size) if plan.num_blocks else None
        self.scheduler = Scheduler(config.scheduler, plan.num_slots, plan.slot_len, prefix)
        self.runner = ModelRunner(model, self.cache)
        self._probe = ModelProbe(model)
        self._lock = threading.Condition()
        self._records: dict[Seq, RequestRecord] = {}
        self._aborts: list[Seq] = []
        self._probes = ProbeCalls()  # asked for, not yet run (under the lock)
        self._error_watchers = LoopWakers()
        self._is_accepting, self._is_stopping = True, False
        self._thread: threading.Thread | None = None
        self._num_steps = self._num_generated = self._num_requests = self._num_step_errors = 0
        self.steps = StepStats()  # each step's time and tokens (the metrics' histograms)

    def stats(self) -> EngineStats:
        """A snapshot of the batch, the queue, the KV cache and the totals (no torch work)."""
        with self._lock:
            return engine_stats(self.scheduler, self.cache, self._num_steps, self._num_generated,
                                self._num_requests, self._num_step_errors)

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="inference-batch", daemon=True)
            self._thread.start()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Queue ``request`` and yield its events as its tokens are made.

        Raises InvalidArgument (bad request), ResourceExhausted (queue full), Unavailable
        (draining or stopped), DeadlineExceeded (deadline passed while queued), RuntimeError
        (the step failed). Stopping the iteration cancels the request: it leaves the batch at
        the next step and its KV slot is freed.
        """
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        cancel = self.submit(request, events.put_nowait)
        is_done = False
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    is_done = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    is_done = True
                    return
        finally:
            if not is_done:
                cancel()

    def submit(self, request: GenerateRequest, deliver: Deliver) -> Callable[[], None]:
        """Queue ``request``; ``deliver`` gets its events on this loop's thread, the last one
        with ``finish_reason`` set, or one exception instead (the errors of ``generate``).

        Returns ``cancel``: the request leaves the batch at the next step and its KV slot is
        freed; no further event is promised (a no-op once it finished). ``generate`` is this
        with a queue; the multiplexed RPC hands each step's events to one writer instead.
        Raises what ``generate`` raises before the request is queued.
        """
        self._validate(request)
        if request.constraint is None or self.grammars is None:
            return self._canceller(self._submit(request, deliver, None).seq)
        compiled = self.grammars.compile(request.constraint)
        if compiled.done():  # cached: InvalidArgument raised here when it cannot be enforced
            return self._canceller(self._submit(request, deliver, compiled.result()).seq)
        return self._submit_when_compiled(request, deliver, compiled)

    def _canceller(self, seq: Seq) -> Callable[[], None]:
        def cancel() -> None:
            with self._lock:
                self._aborts.append(seq)
                self._lock.notify_all()

        return cancel

    def _submit_when_compiled(self, request: GenerateRequest, deliver: Deliver,
                              compiled: Future[xgrammar.CompiledGrammar]) -> Callable[[], None]:
        """Queue ``request`` once its grammar is compiled (on the grammar thread: neither this
        loop nor the worker waits); a compile error or a refusal is delivered as its error."""
        loop, context = asyncio.get_running_loop(), contextvars.copy_context()
        queued: list[Seq] = []
        is_cancelled = False

        def queue() -> None:
            if is_cancelled:
                return
            try:
                queued.append(self._submit(request, deliver, compiled.result()).seq)
            except Exception as exc:  # noqa: BLE001 - the request's error (InvalidArgument, queue full, ...)
                deliver(exc)

        def compiled_done(_: Future[xgrammar.CompiledGrammar]) -> None:
            try:
                loop.call_soon_threadsafe(queue, context=context)
            except RuntimeError:  # the caller's loop is closed: nobody waits for it
                pass

        def cancel() -> None:
            nonlocal is_cancelled
            is_cancelled = True
            if queued:
                self._canceller(queued[0])()

        compiled.add_done_callback(compiled_done)
        return cancel

    async def probe(self, timeout_s: float) -> float:
        """Run one token through the model between two steps; returns the seconds from the ask
        to the answer (a step in flight counts). Raises what the forward raised, ProbeFailed
        (unusable logits), TimeoutError (past ``timeout_s``) or Unavailable (not running).

        It never waits behind the queue, takes no KV slot and preempts no sequence: the worker
        runs it as soon as its current step ends, on a scratch slot of its own."""
        started = time.perf_counter()
        with self._lock:
            if self._thread is None or self._is_stopping:
                raise Unavailable("inference engine is not running")
            done = self._probes.ask()
            self._lock.notify_all()
        await asyncio.wait_for(done, timeout_s)
        return time.perf_counter() - started

    def step_errors(self) -> asyncio.Event:
        """An event set on the calling loop after every failed step (the caller clears it), so
        a health loop can probe at once; ``stats().num_step_errors`` counts the failures."""
        with self._lock:
            return self._error_watchers.add()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait (on the engine's condition, no polling) until nothing is queued or running."""
        def wait() -> bool:
            with self._lock:
                return self._lock.wait_for(lambda: not self._records, timeout_s)

        return await asyncio.to_thread(wait)

    async def stop(self) -> None:
        """Refuse new requests, end the worker after its current step, then fail the queued
        requests (Unavailable) and cancel the running ones."""
        with self._lock:
            self._is_accepting, self._is_stopping = False, True
            self._lock.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.grammars is not None:
            self.grammars.close()
        with self._lock:
            settle_all(self._probes.take(), Unavailable("inference is stopping"))
            for seq, record in list(self._records.items()):
                was_waiting = seq.slot is None
                self.scheduler.abort(seq)
                record.post(Unavailable("inference is stopping") if was_waiting
                            else record.event((), FinishReason.CANCELLED))
            self._records.clear()
            self._lock.notify_all()

    # --- asyncio side -------------------------------------------------------------------------

    def _submit(self, request: GenerateRequest, deliver: Deliver,
                compiled: xgrammar.CompiledGrammar | None) -> RequestRecord:
        if request.deadline is not None and request.deadline <= time.monotonic():
            raise DeadlineExceeded("deadline passed before the request was queued")
        prompt = request.prompt_token_ids
        stop_ids = request.stop_token_ids | (frozenset() if request.ignore_eos else self.eos_ids)
        seq = Seq(list(prompt), len(prompt), request.max_new_tokens, request.priority,
                  request.deadline, stop_ids)
        if self.scheduler.config.num_speculative_tokens and request.params.is_argmax:
            seq.drafter = NgramDrafter()  # drafts are verified against the argmax
        if compiled is not None:
            seq.grammar = RowGrammar(compiled, max(1, self.scheduler.config.num_speculative_tokens))
        sampling = RowSampling(request.params, new_generator(request.params, self.model.device), request.top_logprobs)
        record = RequestRecord(request, seq, sampling, asyncio.get_running_loop(), deliver, contextvars.copy_context(),
                               self.cache.layout.bytes_per_token)
        with self._lock:
            if not self._is_accepting:
                raise Unavailable("inference is draining; retry on another replica")
            self._refuse_long_when_full(len(prompt) + request.max_new_tokens)
            self.scheduler.add(seq)  # ResourceExhausted when the queue is full
            self._records[seq] = record
            self._num_requests += 1
            self._lock.notify_all()
        return record

    def _refuse_long_when_full(self, num_tokens: int) -> None:
        """Past ``refuse_long_above`` of the KV cache in use, a long request is refused at once
        (lock held): queued, it would wait for or preempt what runs and be recomputed, thrashing."""
        kv = self.config.kv_cache
        if not kv.refuse_long_above or num_tokens <= kv.long_context_tokens:
            return
        s = engine_stats(self.scheduler, self.cache, 0, 0, 0, 0)
        fill = s.kv_used_bytes / s.kv_total_bytes if s.kv_total_bytes else 0.0
        if fill >= kv.refuse_long_above:
            raise ResourceExhausted(
                f"kv cache: {fill:.0%} in use, over the {kv.refuse_long_above:.0%} threshold (refuse_long_above); "
                f"requests of more than {kv.long_context_tokens} tokens (prompt + max_new_tokens: {num_tokens}) "
                "are refused until it drains; retry later, or ask for fewer tokens")

    def _validate(self, request: GenerateRequest) -> None:
        prompt, vocab = request.prompt_token_ids, self.model.config.vocab_size
        if not prompt:
            raise InvalidArgument("prompt_token_ids: must hold at least 1 id, got 0")
        if (bad := next((i for i in prompt if not 0 <= i < vocab), None)) is not None:
            raise InvalidArgument(f"prompt_token_ids: id {bad} is outside the vocabulary 0..{vocab - 1}")
        limit = self.config.max_new_tokens_limit
        if not 1 <= request.max_new_tokens <= limit:
            raise InvalidArgument(f"max_new_tokens: must be 1..{limit}, "
                                  f"got {request.max_new_tokens}")
        if len(prompt) + request.max_new_tokens > self.scheduler.slot_len:
            raise InvalidArgument(
                f"prompt_token_ids + max_new_tokens: {len(prompt)} + {request.max_new_tokens} "
                f"exceeds max_seq_len {self.scheduler.slot_len}")
        request.params.validate(vocab)
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs: must be 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        if request.constraint is not None:
            if self.grammars is None:
                raise InvalidArgument("decoding.constraint: this engine has no grammar compiler (no tokenizer)")
            if request.ignore_eos:
                raise InvalidArgument("decoding.ignore_eos: cannot be combined with a constraint "
                                      "(a constrained answer ends where its grammar ends)")

    # --- worker thread ------------------------------------------------------------------------

    def _work(self) -> None:
        """The worker thread: build the CPU kernels, then step while there is work."""
        adopt_thread_count()
        try:  # on this thread only (the one torch thread); a failure only leaves kernels to build later
            cfg = self.scheduler.config
            self.model.prepare_kernels(cfg.max_num_batched_tokens, max_logit_rows(cfg, self.scheduler.capacity))
            log_startup("kernels")
        except Exception:  # noqa: BLE001
            log.exception("prepare_kernels_failed")
        with torch.inference_mode():
            while (work := self._wait_for_work()) is not None:
                probes, is_step_due = work
                self._run_probe(probes)
                if not is_step_due:
                    continue
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - a bug: fail what runs, keep serving
                    log.exception("engine_step_failed")
                    with self._lock:
                        failed = self.scheduler.fail(SchedulerOutput(), everything=True)
                    self._fail(failed, exc)

    def _wait_for_work(self) -> tuple[list[ProbeCall], bool] | None:
        """Apply pending aborts; block until a probe is asked for or a step has work. Returns
        the probes to run and whether a step is due; None once stopping."""
        with self._lock:
            while not self._is_stopping:
                for seq in self._aborts:
                    self.scheduler.abort(seq)
                self._aborts.clear()
                wait_s = self.scheduler.wait_s()
                if wait_s == 0.0 or self._probes:
                    return self._probes.take(), wait_s == 0.0
                self._lock.notify_all()  # wake wait_idle
                self._lock.wait(wait_s)
            return None

    def _run_probe(self, probes: list[ProbeCall]) -> None:
        """One probe forward for everyone who asked since the last one and still waits."""
        waiting = [(loop, future) for loop, future in probes if not future.done()]
        if not waiting:
            return
        outcome: BaseException | None = None
        try:
            self._probe.run()
        except Exception as exc:  # noqa: BLE001 - the probe's verdict, reported to its askers
            outcome = exc
        settle_all(waiting, outcome)

    def _step(self) -> None:
        """One step: schedule (lock held), execute (lock free: requests queue meanwhile), account."""
        with self._lock:
            output = self.scheduler.schedule()
            sampling = {c.seq: self._records[c.seq].sampling for c in output.chunks if c.is_sampled}
            for seq in output.finished:
                self._finish_early(seq)
        if self.config.step_delay_ms:  # a test setting: a slower version on purpose
            time.sleep(self.config.step_delay_ms / 1000)
        started = time.perf_counter()
        try:
            picked = self.runner.execute(output, sampling)
        except Exception as exc:  # noqa: BLE001 - reported to the step's callers
            log.exception("engine_step_failed", num_seqs=len(output.chunks))
            with self._lock:
                failed = self.scheduler.fail(output, everything=isinstance(exc, KVCacheError))
            self._fail(failed, exc)
            return
        elapsed_s = time.perf_counter() - started
        with self._lock:
            posts = self._account(output, picked, elapsed_s)
            self._lock.notify_all()
        post_all(posts)

    def _account(self, output: SchedulerOutput, picked: list[Picked], elapsed_s: float) -> list[Post]:
        """Update the scheduler and the records with a step's results (lock held); returns the
        events to post, one per sequence that grew."""
        grown = self.scheduler.update(output, [p.token_ids for p in picked])
        logprobs = {c.seq: p.logprobs for c, p in zip((c for c in output.chunks if c.is_sampled), picked, strict=True)}
        self._num_steps += 1
        self.steps.record(elapsed_s, output.num_tokens)
        self._num_generated += sum(count for _, count in grown)
        for chunk in output.chunks:
            if (record := self._records.get(chunk.seq)) is not None:
                record.compute_s += elapsed_s
        posts: list[Post] = []
        for seq, count in grown:
            record = self._records[seq]
            posts.append((record, record.event(tuple(seq.token_ids[-count:]), seq.finish_reason,
                                               logprobs[seq][:count])))
            if seq.is_finished:
                del self._records[seq]
        return posts

    def _finish_early(self, seq: Seq) -> None:
        """Report a sequence that ended outside a forward (lock held)."""
        record = self._records.pop(seq, None)
        if record is None:
            return
        if seq.is_expired:
            record.post(DeadlineExceeded("deadline passed while queued for the model"))
        else:
            record.post(record.event((), FinishReason.CANCELLED))

    def _fail(self, failed: list[Seq], exc: Exception) -> None:
        """Fail the requests of ``failed`` sequences with the step's error; count the failed
        step and wake the ``step_errors`` watchers."""
        with self._lock:
            for seq in failed:
                if (record := self._records.pop(seq, None)) is not None:
                    record.post(RuntimeError(f"generation failed: {exc}"))
            self._num_step_errors += 1
            self._error_watchers.wake_all()
            self._lock.notify_all()
