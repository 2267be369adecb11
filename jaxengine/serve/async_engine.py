"""The engine on its own thread, for the server.

Requests come in through a command queue; the thread steps the engine and, while the device
computes a step, turns the previous step's tokens into per-request deltas (text, token ids,
logprobs, finish reason) that it hands to each request's asyncio queue. The event loop never
waits on the device, and the scheduler is only ever touched by the engine thread.

Prompts are tokenized (and chat templates applied) on a small thread pool, off the event loop,
each thread with its own copy of the tokenizer: the engine thread decodes with the original.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from jaxengine.llm import LLM
from jaxengine.output_processor import OutputProcessor
from jaxengine.request import Request, RequestStatus, Sequence
from jaxengine.sampling_params import SamplingParams
from jaxengine.tokenizer import PerThreadTokenizer, apply_chat_template

# Tokenizing shares the host's cores with the engine thread; two threads keep one long prompt
# from holding up the short ones behind it.
TOKENIZER_THREADS = 2

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]]]   # per new token: (its logprob, top-k)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    """What one request gained since its previous delta."""

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None       # the request failed (``error_status``: the HTTP status to report)
    error_status: int = 500


@dataclass
class _Tracked:
    """Per-request streaming state, owned by the engine thread."""

    request: Request
    deliver: Callable[[RequestDelta], None]
    output: OutputProcessor
    sent: dict[int, int] = field(default_factory=dict)    # seq_id -> output tokens delivered
    done: set[int] = field(default_factory=set)           # seq_ids whose finish was delivered
    last_emit: float | None = None


class AsyncEngine:
    """``async for delta in engine.generate(...)`` for each request, one engine thread for all.

    ``max_waiting_requests`` bounds the waiting queue (``QueueFullError`` beyond it).
    ``observer`` (optional) gets ``on_step(engine)``, ``on_tokens(request, n, itl)`` and
    ``on_finish(request)`` calls from the engine thread (the Prometheus metrics).
    """

    def __init__(self, llm: LLM, *, max_waiting_requests: int = 1024, observer=None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer           # the engine thread's (decoding)
        self.tokenizers = None if llm.tokenizer is None else PerThreadTokenizer(llm.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="jaxengine-tokenize")
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._num_queued = 0          # added by clients, not yet seen by the engine thread
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxengine-engine", daemon=True)

    # ---- event-loop side ----
    def start(self) -> None:
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._num_queued

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked) + self._num_queued

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids, on the tokenizer pool; token-id lists pass through."""
        if not isinstance(prompt, str):
            return list(prompt)
        tokenizer = self._tokenizer_or_error("prompt")
        return await self._on_pool(lambda: tokenizer.get().encode(prompt, add_special_tokens=add_special_tokens))

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """A conversation through the chat template -> token ids, on the tokenizer pool."""
        tokenizer = self._tokenizer_or_error("messages")
        return await self._on_pool(lambda: apply_chat_template(tokenizer.get(), messages, add_generation_prompt))

    async def decode(self, token_ids: list[int]) -> str:
        tokenizer = self._tokenizer_or_error("tokens")
        return await self._on_pool(lambda: tokenizer.get().decode(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (the calling thread's own tokenizer)."""
        return self.tokenizers.get().decode([token_id]) if self.tokenizers is not None else str(token_id)

    def _tokenizer_or_error(self, field_name: str) -> PerThreadTokenizer:
        if self.tokenizers is None:
            raise ValueError(f"{field_name}: the server runs without a tokenizer (skip_tokenizer_init)")
        return self.tokenizers

    async def _on_pool(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise before anything is queued: ValueError naming the field for a request that can
        never be served, QueueFullError / EngineStoppedError when the server can't take it now."""
        self.llm.check_request(prompt_token_ids, params)
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (the bound is "
                                 f"{self.max_waiting_requests}); retry later")

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0) -> AsyncIterator[RequestDelta]:
        """Queue a request (``check`` it first); returns the iterator of its deltas, which ends
        with one that has ``finished``. Leaving the iteration early (a client that went away)
        aborts the request and frees its blocks. Call from the event loop."""
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            self._num_queued += 1
        self._commands.put(("add", request_id, prompt_token_ids, params, priority,
                            lambda d: _deliver(loop, deltas, d)))
        return self._deltas(request_id, deltas)

    async def _deltas(self, request_id: str, deltas: asyncio.Queue) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking requests, abort what is left, and stop the engine thread."""
        self._stopping = True
        self._tokenize_pool.shutdown(wait=False)
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # ---- engine thread ----
    def _loop(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self._emit_all()                        # the last step's outputs, before going idle
            if not self._drain_commands(block=not engine.has_unfinished_requests()):
                break
            if engine.has_unfinished_requests():
                try:
                    engine.step(while_running=self._emit_all)
                except Exception as error:              # noqa: BLE001 - one bad step must not kill the server
                    logger.exception("engine step failed")
                    self._fail_all(f"internal error in the engine step: {error}")
                if self.observer is not None:
                    self.observer.on_step(engine)
            elif self.observer is not None:
                self.observer.on_idle(engine)
        self._fail_all("the server shut down before the request finished", status=503)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False on the stop command."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            getattr(self, f"_do_{command[0]}")(*command[1:])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _do_add(self, request_id: str, ids: list[int], params: SamplingParams, priority: int, deliver) -> None:
        with self._lock:
            self._num_queued -= 1
        try:
            request = self.engine.add_request(request_id, ids, params, priority=priority)
        except Exception as error:                      # noqa: BLE001 - reported to that request only
            deliver(RequestDelta(request_id, [], finished=True, error=str(error), error_status=400))
            return
        output = OutputProcessor(request, self.tokenizer, self.engine.scheduler.finish_sequence)
        self._tracked[request_id] = _Tracked(request, deliver, output)

    def _do_abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            if self.observer is not None:
                self.observer.on_abort()

    def _fail_all(self, message: str, status: int = 500) -> None:
        for request_id, tracked in list(self._tracked.items()):
            self.engine.abort(request_id)
            tracked.deliver(RequestDelta(request_id, [], finished=True, error=message, error_status=status))
        self._tracked.clear()

    # ---- output processing (runs while the device computes the next step) ----
    def _emit_all(self) -> None:
        now = time.monotonic()
        for request_id, tracked in list(self._tracked.items()):
            try:
                delta = self._delta(tracked, now)
            except Exception as error:                  # noqa: BLE001 - fail this request, keep serving
                logger.exception("output processing failed for %s", request_id)
                self.engine.abort(request_id)
                delta = RequestDelta(request_id, [], finished=True, error=f"internal error: {error}")
            if delta is None:
                continue
            if delta.finished:
                del self._tracked[request_id]
            tracked.deliver(delta)

    def _delta(self, tracked: _Tracked, now: float) -> RequestDelta | None:
        request = tracked.request
        choices = [c for seq in list(request.seqs) if (c := self._choice_delta(tracked, seq)) is not None]
        finished = request.is_finished
        if not choices and not finished:
            return None
        new_tokens = sum(len(c.token_ids) for c in choices)
        if self.observer is not None and new_tokens:
            itl = None if tracked.last_emit is None else now - tracked.last_emit
            self.observer.on_tokens(request, new_tokens, itl)
        if new_tokens:
            tracked.last_emit = now
        delta = RequestDelta(request.request_id, choices, finished, request.num_prompt_tokens,
                             request.num_cached_tokens)
        if finished:
            if request.status in (RequestStatus.FINISHED_IGNORED, RequestStatus.FINISHED_ERROR):
                delta.error = request.status_reason or "the request could not be served"
                delta.error_status = 400 if request.status is RequestStatus.FINISHED_IGNORED else 500
            if self.observer is not None:
                self.observer.on_finish(request)
        return delta

    def _choice_delta(self, tracked: _Tracked, seq: Sequence) -> ChoiceDelta | None:
        """What ``seq`` gained: its new tokens and their text (a stop string found here finishes
        the sequence; its token in the step now running is discarded)."""
        sent = tracked.sent.get(seq.seq_id, 0)
        text = tracked.output.new_text(seq)
        new = seq.token_ids[seq.num_prompt_tokens + sent:seq.num_real_tokens]      # placeholders excluded
        finished = seq.is_finished and seq.seq_id not in tracked.done
        if not new and not finished:
            return None
        params = tracked.request.sampling_params
        logprobs = seq.logprobs[sent:sent + len(new)] if params.logprobs is not None else []
        tracked.sent[seq.seq_id] = sent + len(new)
        if finished:
            tracked.done.add(seq.seq_id)
            text += tracked.output.new_text(seq, final=True)
        return ChoiceDelta(seq.sample_index, text, new, logprobs, seq.status.finish_reason if finished else None,
                           seq.stop_reason if finished else None)


def _deliver(loop: asyncio.AbstractEventLoop, deltas: asyncio.Queue, delta: RequestDelta) -> None:
    """Hand a delta to the event loop (from the engine thread); a loop already closed (the
    server is gone) has nobody to tell."""
    try:
        loop.call_soon_threadsafe(deltas.put_nowait, delta)
    except RuntimeError:
        pass
