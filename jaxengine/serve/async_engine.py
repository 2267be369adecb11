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

from jaxengine.host import EngineHost
from jaxengine.lora_request import LoRARequest
from jaxengine.output_processor import OutputProcessor
from jaxengine.request import LatencyTargets, Request, RequestStatus, Sequence
from jaxengine.sampling_params import SamplingParams
from jaxengine.tokenizer import PerThreadTokenizer, apply_chat_template

# Tokenizing shares the host's cores with the engine thread; two threads keep one long prompt
# from holding up the short ones behind it.
TOKENIZER_THREADS = 2

logger = logging.getLogger(__name__)
MAX_LOOP_FAILURES = 3       # consecutive failures outside the step before the engine gives up
THREAD_STOPPED = "the engine thread stopped; restart the server"


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


class OverloadedError(RuntimeError):
    """The autopilot predicts the request would miss its time-to-first-token target by a margin
    (overload policy reject); the client should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineUnhealthyError(RuntimeError):
    """The engine failed in a way it cannot recover from; the server must be restarted."""


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
    # With prompt logprobs, in the request's first delta: per prompt position, {token id:
    # logprob} of the prompt token there and the most likely ones (None for the first position).
    prompt_logprobs: list[dict[int, float] | None] | None = None
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
    prompt_logprobs_sent: bool = False


class AsyncEngine:
    """``async for delta in engine.generate(...)`` for each request, one engine thread for all.

    ``max_waiting_requests`` bounds the waiting queue (``QueueFullError`` beyond it).
    ``observer`` (optional) gets ``on_step(engine)``, ``on_tokens(request, n, itl)`` and
    ``on_finish(request)`` calls from the engine thread (the Prometheus metrics); an observer
    that raises is logged and otherwise ignored.

    Failures: a step that raises fails the requests it touched (an error delta, status 500) and
    frees their blocks; the others go on. When the engine cannot go on (its device state is lost,
    or the loop keeps failing) it turns unhealthy: ``health_problem`` says why, every request
    still held and every new one gets a 503, and only a restart helps.
    """

    def __init__(self, host: EngineHost, *, max_waiting_requests: int = 1024, observer=None) -> None:
        self.host = host
        self.engine = host.engine
        self.tokenizer = host.tokenizer          # the engine thread's (decoding)
        self.tokenizers = None if host.tokenizer is None else PerThreadTokenizer(host.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="jaxengine-tokenize")
        self.max_waiting_requests = max_waiting_requests
        self.observer = None if observer is None else _GuardedObserver(observer)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._num_queued = 0          # added by clients, not yet seen by the engine thread
        self._stopping = False
        self._unhealthy: str | None = None      # why the engine can no longer serve
        self._thread = threading.Thread(target=self._loop, name="jaxengine-engine", daemon=True)

    # ---- event-loop side ----
    def start(self) -> None:
        self._thread.start()

    @property
    def health_problem(self) -> str | None:
        """None while the engine serves; else why it cannot (for /health and 503 responses)."""
        if self._unhealthy is not None:
            return self._unhealthy
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return THREAD_STOPPED
        return None

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._num_queued

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked) + self._num_queued

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids, on the tokenizer pool; token-id lists pass through."""
        if not isinstance(prompt, str):
            return list(prompt)
        tokenizer = self._tokenizer_or_error("prompt")
        return await self._on_pool(lambda: tokenizer.get().encode(prompt, add_special_tokens=add_special_tokens))

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """A conversation (and the tools offered) through the chat template -> token ids, on the
        tokenizer pool."""
        tokenizer = self._tokenizer_or_error("messages")
        return await self._on_pool(lambda: apply_chat_template(tokenizer.get(), messages, add_generation_prompt,
                                                               tools=tools, template_kwargs=template_kwargs))

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

    def check(self, prompt_token_ids: list[int], params: SamplingParams, slo: LatencyTargets | None = None) -> None:
        """Raise before anything is queued: ValueError naming the field for a request that can
        never be served, QueueFullError / OverloadedError / EngineStoppedError when the server
        can't take it now."""
        self.host.check_request(prompt_token_ids, params)
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if (problem := self.health_problem) is not None:
            raise EngineUnhealthyError(problem)
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (the bound is "
                                 f"{self.max_waiting_requests}); retry later")
        if (retry_after := self.engine.overload_retry_after(prompt_token_ids, slo)) is not None:
            if self.observer is not None:
                self.observer.on_overload()
            raise OverloadedError(f"overloaded: this request would miss its time-to-first-token target behind the "
                                  f"{self.num_waiting} requests waiting; retry later", retry_after)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, slo: LatencyTargets | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestDelta]:
        """Queue a request (``check`` it first); returns the iterator of its deltas, which ends
        with one that has ``finished``. Leaving the iteration early (a client that went away)
        aborts the request and frees its blocks. Call from the event loop."""
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            self._num_queued += 1
        # Stamped now, not when the engine thread takes it in after its current step: the wait
        # behind a long step is queueing, and the delay factor and fcfs must count it.
        arrival = self.engine.clock()
        self._commands.put(("add", request_id, prompt_token_ids, params, priority, slo, arrival, lora_request,
                            lambda d: _deliver(loop, deltas, d)))
        return self._deltas(request_id, deltas)

    async def run_on_engine_thread(self, fn: Callable[[], object]):
        """``fn()`` run on the engine thread between steps (what changes the engine's state, such as
        loading an adapter); its result, or its exception raised here."""
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if (problem := self.health_problem) is not None:
            raise EngineUnhealthyError(problem)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(outcome: tuple[bool, object]) -> None:
            if not done.done():
                ok, value = outcome
                done.set_result(value) if ok else done.set_exception(value)

        self._commands.put(("call", fn, lambda outcome: loop.call_soon_threadsafe(settle, outcome)))
        return await done

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
        """Serve until the stop command. No exception ends this thread: one outside the step is
        logged and the loop goes on, unless it keeps coming back, which makes the engine
        unhealthy; an unhealthy engine answers every request with an error until stopped."""
        failures = 0
        try:
            while self._unhealthy is None:
                try:
                    if not self._turn():
                        return
                    failures = 0
                except Exception as error:              # noqa: BLE001 - the thread must outlive it
                    logger.exception("engine loop failed")
                    failures += 1
                    if failures >= MAX_LOOP_FAILURES:
                        self._turn_unhealthy(f"the engine loop keeps failing ({error}); restart the server")
            self._refuse_until_stopped()
        finally:
            self._fail_all("the server shut down before the request finished" if self._stopping else
                           THREAD_STOPPED, status=503)
            self._settle_left_calls()
            self.engine.flush_trace()

    def _turn(self) -> bool:
        """Apply commands and run one step (or wait for commands when idle); False on stop."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            self._emit_all()                        # the last step's outputs, before going idle
            engine.flush_trace()                    # an idle server's trace file is complete
        if not self._drain_commands(block=not engine.has_unfinished_requests()):
            return False
        if engine.has_unfinished_requests():
            self._step()
        elif self.observer is not None:
            self.observer.on_idle(engine)
        return True

    def _step(self) -> None:
        try:
            self.engine.step(while_running=self._emit_all)
        except Exception as error:                      # noqa: BLE001 - one bad step must not kill the server
            logger.exception("engine step failed")
            self._recover_from_failed_step(f"internal error in the engine step: {error}")
            return
        if self.observer is not None:
            self.observer.on_step(self.engine)

    def _recover_from_failed_step(self, message: str) -> None:
        """Fail the requests the failed step touched; the others go on, unless the engine
        cannot (then it turns unhealthy)."""
        try:
            request_ids = self.engine.abandon_failed_step()
        except Exception as error:                      # noqa: BLE001 - reported through /health
            logger.exception("the engine cannot recover from the failed step")
            self._turn_unhealthy(f"{message}; the engine cannot recover from it ({error}); restart the server")
            return
        for request_id in request_ids:
            self._fail(request_id, message, 500)

    def _turn_unhealthy(self, reason: str) -> None:
        self._unhealthy = reason
        self._fail_all(reason, status=503)

    def _refuse_until_stopped(self) -> None:
        """Unhealthy: answer each queued request with the reason (nobody waits forever)."""
        while True:
            command = self._commands.get()
            if command[0] == "stop":
                return
            if command[0] == "add":
                with self._lock:
                    self._num_queued -= 1
                command[-1](RequestDelta(command[1], [], finished=True, error=self._unhealthy, error_status=503))
            elif command[0] == "call":
                command[-1]((False, EngineUnhealthyError(self._unhealthy)))

    def _settle_left_calls(self) -> None:
        """Calls still queued when the thread ends (after the stop command) are answered, not left
        waiting; requests queued then get ``add``'s answer from the event loop's own check."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "call":
                command[-1]((False, EngineStoppedError("the server is shutting down")))
            elif command[0] == "add":
                with self._lock:
                    self._num_queued -= 1
                command[-1](RequestDelta(command[1], [], finished=True, error="the server is shutting down",
                                         error_status=503))

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

    def _do_add(self, request_id: str, ids: list[int], params: SamplingParams, priority: int,
                slo: LatencyTargets | None, arrival: float, lora_request: LoRARequest | None, deliver) -> None:
        with self._lock:
            self._num_queued -= 1
        # An adapter unloaded between the request's check and now: not brought back for it.
        if lora_request is not None and getattr(self.host, "loras", {}).get(lora_request.lora_name) != lora_request:
            deliver(RequestDelta(request_id, [], finished=True, error=f"model: the adapter `{lora_request.lora_name}` "
                                 f"was unloaded before the request started", error_status=404))
            return
        try:
            request = self.host.add_request(request_id, ids, params, priority=priority, arrival_time=arrival, slo=slo,
                                           lora_request=lora_request)
        except Exception as error:                      # noqa: BLE001 - reported to that request only
            deliver(RequestDelta(request_id, [], finished=True, error=str(error), error_status=400))
            return
        output = OutputProcessor(request, self.tokenizer, self.engine.finish_sequence)
        self._tracked[request_id] = _Tracked(request, deliver, output)

    @staticmethod
    def _do_call(fn: Callable[[], object], settle) -> None:
        try:
            settle((True, fn()))
        except Exception as error:                      # noqa: BLE001 - raised where it was asked for
            settle((False, error))

    def _do_abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            if self.observer is not None:
                self.observer.on_abort()

    def _fail(self, request_id: str, message: str, status: int) -> None:
        """End a request with an error; a request that already finished keeps its outcome (its
        last delta is still to be sent)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.request.is_finished:
            return
        del self._tracked[request_id]
        try:
            self.engine.abort(request_id)
        finally:
            tracked.deliver(RequestDelta(request_id, [], finished=True, error=message, error_status=status))

    def _fail_all(self, message: str, status: int = 500) -> None:
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:                           # noqa: BLE001 - the client must hear back regardless
                logger.exception("abort of %s failed", request_id)
            tracked.deliver(RequestDelta(request_id, [], finished=True, error=message, error_status=status))
        self._tracked.clear()

    # ---- output processing (runs while the device computes the next step) ----
    def _emit_all(self) -> None:
        now = time.monotonic()
        for request_id, tracked in list(self._tracked.items()):
            times = tracked.request.times
            if times.first_scheduled is None and times.finished is None:
                continue        # still queued: nothing to say (overload keeps many; skip them cheaply)
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
        if request.beam is not None and not request.is_finished:
            return None             # a beam search's choices are its hypotheses, known at its end
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
        if request.prompt_logprobs is not None and not tracked.prompt_logprobs_sent:
            delta.prompt_logprobs, tracked.prompt_logprobs_sent = list(request.prompt_logprobs), True
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
        asked = params.logprobs is not None and tracked.request.beam is None      # beams' are internal
        logprobs = seq.logprobs[sent:sent + len(new)] if asked else []
        tracked.sent[seq.seq_id] = sent + len(new)
        if finished:
            tracked.done.add(seq.seq_id)
            text += tracked.output.new_text(seq, final=True)
        return ChoiceDelta(seq.sample_index, text, new, logprobs, seq.status.finish_reason if finished else None,
                           seq.stop_reason if finished else None)


class _GuardedObserver:
    """The observer's calls, each of which logs a failure instead of raising it: metrics must
    not fail a request or stop the engine. The first failure of each call is logged in full."""

    def __init__(self, observer) -> None:
        self.observer = observer
        self.failures: dict[str, int] = {}

    def _call(self, name: str, *args) -> None:
        try:
            getattr(self.observer, name)(*args)
        except Exception:                               # noqa: BLE001 - see the class docstring
            count = self.failures[name] = self.failures.get(name, 0) + 1
            if count == 1:
                logger.exception("metrics observer %s failed (later failures are counted, not logged)", name)

    def on_step(self, engine) -> None:
        self._call("on_step", engine)

    def on_idle(self, engine) -> None:
        self._call("on_idle", engine)

    def on_tokens(self, request: Request, num_tokens: int, itl: float | None) -> None:
        self._call("on_tokens", request, num_tokens, itl)

    def on_overload(self) -> None:
        self._call("on_overload")

    def on_finish(self, request: Request) -> None:
        self._call("on_finish", request)

    def on_abort(self) -> None:
        self._call("on_abort")


def _deliver(loop: asyncio.AbstractEventLoop, deltas: asyncio.Queue, delta: RequestDelta) -> None:
    """Hand a delta to the event loop (from the engine thread); a loop already closed (the
    server is gone) has nobody to tell."""
    try:
        loop.call_soon_threadsafe(deltas.put_nowait, delta)
    except RuntimeError:
        pass
