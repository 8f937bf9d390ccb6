"""The one thread that runs the model: requests in arrival order, each continued from the longest
cached prefix (`prefix_cache`), recorded into its conversation's trace, streamed back as events.

The HTTP side (`apps.serve.app`) never touches the model; it submits a `Job` and reads the events
the job emits (typed: `apps.serve.events`), in order: `Started` once the request rendered (its tokens
are known), then `TextDelta` for streamed response text, `ReasoningDelta` for streamed thinking and
`TokenLogprob` when asked (the answer is read by `engine.session.answer`: the scaffold tags never reach
the client, and generation stops where the response ends), then `Finished`; or `Failed` at any point. A job whose client went away has `cancelled` set:
it is skipped if still queued, and its generation stops after the current token otherwise. The queue
is bounded (`submit` returns False when full: the client gets 429). An exception inside one request
ends that request (and drops its conversation, whose state is then unknown), never the thread.

Stopping (`begin_shutdown`, then `stop`): no new job is taken; queued jobs end with a 503; the running
one stops after its current prefill chunk or token and ends with a 503 too; then every conversation's
trace is closed ("complete": what it holds was recorded in full), so nothing is left `recording`.
"""

from __future__ import annotations

import os
import queue
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

import torch

from apps.serve.captures import JobCapture, response_fields
from apps.serve.events import (Event, Failed, Finished, ReasoningDelta, Started, TextDelta,
                               TokenLogprob)
from apps.serve.prefix_cache import Conversation, PrefixCache, ReplyMemory
from apps.serve.protocol import ChatRequest, token_logprob
from apps.serve.ranks import IDLE_SECONDS, RankChannel
from engine.cache import MLACache
from engine.errors import EngineError, InputError, NumericsError
from engine.session.answer import Answer, generate_answer
from engine.session.sampling import SamplingParams
from engine.session.transcript import RenderedChat, append_rendered, render_messages
from workbench.sessions import open_session



@dataclass
class Job:
    """One request on its way through the worker."""

    request: ChatRequest
    request_id: str
    emit: Callable[[Event], None]  # thread-safe: hands an event to the HTTP side
    cancelled: threading.Event = field(default_factory=threading.Event)
    body: Any = None  # the decoded request body (what rank 0 hands the other ranks under torchrun)
    owner: str = ""  # whose conversations it may continue (`prefix_cache`)
    on_finish: Callable[[], None] | None = None  # called once the worker is done with it (run or skipped)


@dataclass
class ServeOptions:
    """How the worker runs sessions and records them."""

    model_name: str
    trace_root: Path | None = None
    policy: Any = "default"
    families: Collection[str] | None = None  # None: every registered signal family
    # from the model's card (`workbench.task_templates.card_of`): a model trained on task templates answers
    # in a response opened right after an empty think, so the server opens it (no tag eats max_tokens);
    # `notice` (what it can answer) goes with every free-form reply, as the CLI prints it
    open_response: bool = False
    notice: str = ""
    telemetry: Any = None  # an `apps.serve.telemetry.RequestTelemetry`: one span per request (--otel)
    cache_bytes: int = 4 << 30
    max_conversations: int = 64
    prefill_chunk: int = 2048
    max_queue: int = 16


class EngineWorker:
    """Runs jobs on one model, one at a time (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, options: ServeOptions, channel: RankChannel | None = None) -> None:
        self.model, self.tokenizer, self.options = model, tokenizer, options
        # under torchrun: rank 0's worker announces each job, every rank runs it (`apps.serve.ranks`)
        self.channel = channel if channel is not None and channel.active else None
        self.cache = PrefixCache(options.cache_bytes, options.max_conversations)
        self.replies = ReplyMemory()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._outstanding = 0  # queued + running
        self._lock = threading.Lock()
        self._conversations = 0
        self._stopping = threading.Event()
        self._running: Conversation | None = None  # the conversation the running job extends
        self._failed_at: dict | None = None  # where the running job's forward went non-finite
        self._thread = threading.Thread(target=self._loop, name="k3wb-serve-engine", daemon=True)

    # ---- queue ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when `max_queue` requests already wait (besides the running one) or the
        server is stopping."""
        with self._lock:
            if self._outstanding > self.options.max_queue or self._stopping.is_set():
                return False
            self._outstanding += 1
        if self.options.telemetry is not None:  # the span runs from now (queued) to the job's last event
            job.emit = self.options.telemetry.observe(job.request, job.request_id, job.emit)
        self._jobs.put(job)
        return True

    def begin_shutdown(self) -> None:
        """Stop taking jobs and stop the running one after its current step; returns at once (safe in a
        signal handler). `stop` then waits for the thread and closes the traces."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            threading.Thread(target=self._interrupt_until_idle, name="k3wb-serve-stop", daemon=True).start()

    def _interrupt_until_idle(self) -> None:
        # asked again and again: a generation that starts after a request to stop resets the session's flag
        while self._thread.is_alive():
            running = self._running
            if running is not None:
                running.session.request_stop()
            self._thread.join(0.05)

    def stop(self, timeout: float = 120.0) -> bool:
        """Stop (see `begin_shutdown`), wait for the running job to end, close every conversation's trace;
        False when the thread did not end within `timeout` seconds."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for conv in self.cache.drain():
            self._close(conv, "complete")
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_SECONDS if self.channel is not None else None)
            except queue.Empty:  # keeps the other ranks' waiting broadcast within the group's timeout
                self.channel.announce("idle")  # type: ignore[union-attr]
                continue
            if job is None:
                if not self._stopping.is_set():
                    continue  # a stale wake-up; only begin_shutdown stops the loop
                self._refuse_queued()
                if self.channel is not None:
                    self.channel.announce("stop")
                return
            try:
                if self._stopping.is_set():
                    job.emit(_shutting_down())
                elif not job.cancelled.is_set():
                    if self.channel is not None:
                        self.channel.announce("job", body=job.body, request_id=job.request_id, owner=job.owner)
                    self._run(job)
            except NumericsError as exc:  # the model's numbers went NaN/inf: say where, for a conformance check
                print(f"workbench serve: {exc}", file=sys.stderr)
                job.emit(_non_finite(exc, self._failed_at))
                if self.channel is not None:
                    _end_job(self.channel, exc)
            except Exception as exc:  # noqa: BLE001 - one failed request must never stop the server
                traceback.print_exc(file=sys.stderr)
                job.emit(Failed(500, f"the engine failed on this request ({type(exc).__name__}); the server "
                                "keeps running"))
                if self.channel is not None:
                    _end_job(self.channel, exc)
            finally:
                self._finished(job)

    def _finished(self, job: Job) -> None:
        with self._lock:
            self._outstanding -= 1
        if job.on_finish is not None:
            job.on_finish()

    def _refuse_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit(_shutting_down())
                self._finished(job)

    def run_job(self, request: ChatRequest, request_id: str, owner: str = "") -> None:
        """Another rank: run the job rank 0 announced, as rank 0 runs it (its events go nowhere)."""
        try:
            self._run(Job(request, request_id, lambda event: None, owner=owner))
        except Exception as exc:  # ranks that diverge would wait in collectives: end the whole job
            traceback.print_exc(file=sys.stderr)
            _end_job(self.channel, exc)

    # ---- one request -----------------------------------------------------------------------------
    def _render(self, job: Job) -> RenderedChat | None:
        def replies(prefix: list[int], text: str) -> list[int] | None:
            return self.replies.lookup(prefix, text, job.owner)

        try:
            return render_messages(self.model, self.tokenizer, job.request.messages,
                                   add_generation_prompt=not job.request.continue_final, replies=replies,
                                   open_response=self.options.open_response,
                                   continue_final=job.request.continue_final)
        except InputError as exc:
            job.emit(Failed(400, str(exc), "messages"))
            return None

    def _new_conversation(self, owner: str) -> Conversation:
        self._conversations += 1
        conv_id = f"conv-{self._conversations:04d}-{secrets.token_hex(3)}"
        session = open_session(self.model, self.tokenizer, prefill_chunk=self.options.prefill_chunk,
                               model_name=self.options.model_name, progress=False)
        conv = Conversation(conv_id, session, owner=owner)
        if self.options.trace_root is not None:
            from workbench import ConversationTrace  # recording machinery loads only when recording

            conv.trace = ConversationTrace(session, self.options.trace_root / conv_id, policy=self.options.policy,
                                           families=self.options.families,
                                           info={"server": {"conversation": conv_id, "endpoint": "workbench serve"}})
        return conv

    def _close(self, conv: Conversation, status: str) -> None:
        if conv.trace is not None:
            try:
                conv.trace.close(status)
            except EngineError as exc:  # e.g. a full disk: the trace keeps what it flushed
                print(f"conversation {conv.id}: {exc}", file=sys.stderr)

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:  # checked when the request was parsed; again here, before any conversation is touched
            params = job.request.sampling()
        except InputError as exc:
            job.emit(Failed(400, str(exc)))
            return
        chat = self._render(job)
        if chat is None:
            return
        conv = self.cache.take(chat, job.owner)
        cached = conv.session.length if conv is not None else 0
        if conv is None:
            conv = self._new_conversation(job.owner)
        job.emit(Started(len(chat.ids), cached, conv.id))
        self._running = conv
        self._failed_at = None
        try:
            result = self._generate(job, conv, chat, params, started, cached)
        except BaseException as exc:
            if isinstance(exc, NumericsError):
                self._failed_at = nonfinite_state(conv.session)
            self._close(conv, "failed")
            if isinstance(exc, InputError):
                job.emit(Failed(400, str(exc)))
                return
            raise
        finally:
            self._running = None
        conv.turns += 1
        if result["finish_reason"] == "shutdown":
            self._close(conv, "complete")  # what it holds was recorded in full; the server is going away
            job.emit(_shutting_down(len(result["ids"])))
            return
        for old in self.cache.put(conv):
            self._close(old, "complete")
        if result["finish_reason"] != "cancelled" and result["ids"] and not job.request.continue_final:
            # keyed by the text the client received (the response only): that is what it sends back; a
            # continued message is sent back as the client's own start plus this text, so it is rendered anew
            opening = chat.pieces[-1].ids  # the generation prompt and what it opened
            ids = opening + result["ids"] + result["closing"]
            self.replies.remember(chat.ids[:len(chat.ids) - len(opening)], result["content"], ids, job.owner)
        notice = self.options.notice if not job.request.continue_final else ""
        request = job.request
        top, choice = response_fields(conv.captures, len(chat.ids), len(chat.ids) + len(result["ids"]),
                                      routes=request.return_routed_experts, selections=request.return_indexer_topk,
                                      sglang_start=request.routed_experts_start_len) \
            if conv.captures is not None and (request.return_routed_experts or request.return_indexer_topk) else ({}, {})
        if request.return_token_ids:  # vLLM's names
            top["prompt_token_ids"], choice["token_ids"] = list(chat.ids), list(result["ids"])
        job.emit(Finished(**result, fields=(top, choice), prompt_tokens=len(chat.ids), completion_tokens=len(result["ids"]),
                          cached_tokens=cached, conversation=conv.id, turn=conv.turns, notice=notice,
                          trace=conv.trace.path.name if conv.trace is not None else None))

    def _generate(self, job: Job, conv: Conversation, chat: RenderedChat, params: SamplingParams, started: float,
                  cached: int) -> dict[str, Any]:
        session = conv.session
        ttft: float | None = None
        last = 0.0

        want_logprobs, top = job.request.logprobs, job.request.top_logprobs
        logprobs: list[dict] = []

        def first_token(token: Any) -> None:
            nonlocal ttft, last
            last = time.perf_counter()
            if ttft is None:
                ttft = last - started
            if want_logprobs:  # the model's own distribution the token was drawn from (no temperature)
                dist = torch.log_softmax(session.last_logits.float(), -1)
                logprobs.append(token_logprob(self.tokenizer, token.id, dist, top))
                job.emit(TokenLogprob(logprobs[-1]))

        def keep_going(_token: Any) -> bool:
            go_on = not job.cancelled.is_set() and not self._stopping.is_set()
            if self.channel is not None:  # only rank 0 knows whether its client is still there
                go_on = self.channel.keep_going(go_on)
            return go_on

        turn_ctx = conv.trace.turn(job.request_id) if conv.trace is not None else _NoTurn(job.request_id)
        request = job.request
        capture = (JobCapture(self.model, request.return_routed_experts, request.return_indexer_topk)
                   if request.return_routed_experts or request.return_indexer_topk else None)
        with turn_ctx as turn:
            append_rendered(session, chat, skip=len(session.tokens))
            answer = Answer()
            if capture is not None:
                capture.attach()
            try:
                if not self._stopping.is_set():
                    answer = generate_answer(session, params, stop_strings=job.request.stop,
                                             add_generation_prompt=False,
                                             on_text=lambda text: job.emit(TextDelta(text)),
                                             on_thinking=lambda text: job.emit(ReasoningDelta(text)),
                                             on_token=first_token, keep_going=keep_going)
            finally:
                if capture is not None:
                    session.deliver_probes()
                    capture.detach()
            if capture is not None:
                conv.captures = capture.store(conv.captures, cached, session.length)
            finish = answer.finish_reason
            if self._stopping.is_set():
                finish = "shutdown"  # stopped in its prefill or after a token: never a complete reply
            # time per output token after the first (the decode rate a client sees)
            tpot = (last - started - ttft) / (answer.generated - 1) if ttft is not None and answer.generated > 1 else None
            turn.update(prompt_tokens=len(chat.ids), cached_tokens=cached, completion_tokens=answer.generated,
                        finish_reason=finish, ttft_s=ttft, tpot_s=tpot)
        # what closes the reply's sections and message, so the reply a client sends back renders as a
        # complete message that extends the cached state exactly
        closing = answer.closing_ids if finish not in ("cancelled", "shutdown") else []
        return {"content": answer.text, "reasoning": answer.thinking, "ids": answer.ids, "closing": closing,
                "finish_reason": finish, "ttft_s": ttft, "logprobs": logprobs if want_logprobs else None}


def nonfinite_state(session: Any) -> dict:
    """Where a forward that went non-finite started, and which layers' carried state (KDA recurrent and
    conv state, MLA caches) holds NaN/inf: the session rolled its state back to before that forward, so a
    layer named here carried the bad values into it."""
    length = int(session.length)
    layers = []
    for i, layer in enumerate(session.state.layers):
        # an MLA cache's rows past `length` were written by the failed forward itself: not carried into it
        tensors = layer.to_tensors(length) if isinstance(layer, MLACache) else layer.to_tensors()
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values()):
            layers.append(i)
    return {"position": length, "layers": layers}


def _non_finite(exc: NumericsError, where: dict | None) -> Failed:
    where = where or {}
    layers = where.get("layers") or []
    said = (f"; the state layer(s) {', '.join(map(str, layers))} carried into it hold NaN/inf" if layers
            else "; no layer's carried state holds NaN/inf (the values went bad inside that forward)")
    message = (f"the model's output went non-finite in the forward starting at position {where.get('position')}"
               f"{said} ({str(exc)[:200]})")
    return Failed(500, message, code="non_finite_output", where=where or None)


def _shutting_down(generated: int | None = None) -> Event:
    if generated is None:
        done = " before it ran"
    else:
        done = f" after {generated} generated token(s)" if generated else " in the prefill of its prompt"
    return Failed(503, f"the server is shutting down; this request was stopped{done}")


def _end_job(channel: RankChannel | None, exc: BaseException) -> None:
    """Under torchrun a rank whose request failed cannot rejoin the others' collectives: it reports the
    failure (every rank's watchdog then exits naming it) and exits."""
    watchdog = getattr(channel.ctx, "watchdog", None) if channel is not None else None
    if watchdog is not None:
        watchdog.report(exc)
    sys.stderr.flush()
    os._exit(1)


class _NoTurn:
    """The turn context when nothing is recorded."""

    def __init__(self, request_id: str) -> None:
        self.entry: dict[str, Any] = {"id": request_id}

    def __enter__(self) -> dict[str, Any]:
        return self.entry

    def __exit__(self, *exc: Any) -> None:
        return None
