"""The HTTP side of `workbench serve`: a Starlette app speaking the OpenAI chat-completions API.

Routes: `GET /v1/models`, `POST /v1/chat/completions` (server-sent events when `stream` is true).
Every request passes `Guard` first: its `Host` (and `Origin`, when a browser sends one) must name
this server (the dashboard's `HostPolicy`: a web page under a rebound DNS name is refused, 403), and
when an API key is set, `Authorization: Bearer KEY` must match it (compared in constant time; the
key is never logged or echoed). Bodies are read up to a size limit before they are parsed.

What a request may cost is bounded before it is spent (`apps.serve.limits`): the bytes of every body
being read, waiting or running together (`max_pending_bytes`: more gets 429); the JSON values and
nesting of a body, counted on its bytes before `json.loads`; the characters of its messages before
they are tokenized; the number, pixel area and patches of its pictures, read from their headers
before they are decoded. Parsing runs on one thread of its own, never on the event loop, one body
at a time. A conversation belongs to the API key and the `user` field it was started with
(`prefix_cache`): two end users never share one, whatever they send.

The model runs on the worker thread (`apps.serve.worker`); a handler submits a job and relays its
events. A client that disconnects cancels its job (still queued: skipped; running: stopped after
the current token). Any error becomes an OpenAI-style error body with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from apps.web_guard import HostPolicy
from apps.serve.limits import (MAX_IMAGE_AREA, MAX_IMAGE_PATCHES, MAX_IMAGES, MAX_JSON_DEPTH, MAX_JSON_VALUES,
                               PendingBytes, RequestLimits, check_json_shape, check_request_cost)
from apps.serve.events import Event, Failed, Finished, ReasoningDelta, TextDelta, TokenLogprob
from apps.serve.protocol import (ChatRequest, RequestError, chunk_body, completion_body, error_body,
                                 parse_chat_request, usage)
from apps.serve.worker import EngineWorker, Job

POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks that its client is still there


@dataclass(frozen=True)
class AppConfig:
    """What the HTTP side enforces."""

    model_id: str
    hosts: HostPolicy
    api_key: str | None = None
    max_body_bytes: int = 64 << 20
    max_tokens: int = 4096
    image_root: Path | None = None
    max_pending_bytes: int = 256 << 20  # bodies being read, waiting or running, together
    max_json_values: int = MAX_JSON_VALUES
    max_json_depth: int = MAX_JSON_DEPTH
    max_images: int = MAX_IMAGES
    max_image_area: int = MAX_IMAGE_AREA
    max_image_patches: int = MAX_IMAGE_PATCHES


def _json_error(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


class Guard:
    """ASGI middleware: Host/Origin policy and API key, before any route runs."""

    def __init__(self, app: ASGIApp, config: AppConfig) -> None:
        self.app, self.config = app, config
        self._key = hashlib.sha256(config.api_key.encode()).digest() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # no websocket routes exist; lifespan events carry no request
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        reason = self.config.hosts.refusal(headers.get("host"), headers.get("origin"), service="this server")
        if reason is not None:
            refused = RequestError(reason, status=403,
                                   kind="permission_error", code="host_not_allowed")
            await _json_error(refused)(scope, receive, send)
            return
        if self._key is not None and not self._authorised(headers.get("authorization", "")):
            refused = RequestError("invalid or missing API key (send Authorization: Bearer KEY)", status=401,
                                   kind="invalid_request_error", code="invalid_api_key")
            await _json_error(refused, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        # digests of equal length, compared in constant time: the time says nothing about the key or its length
        given_digest = hashlib.sha256(given.strip().encode("utf-8", "replace")).digest()
        ok = hmac.compare_digest(given_digest, self._key or b"")
        return ok and scheme.lower() == "bearer"


def _too_busy(pending: PendingBytes) -> RequestError:
    return RequestError(f"the server holds {pending.budget >> 20} MiB of request bodies already (being read, waiting "
                        "or running); retry later", status=429, kind="rate_limit_error", code="rate_limit_exceeded")


async def _read_body(request: Request, limit: int, pending: PendingBytes, held: list[int]) -> bytes:
    """The raw body, at most `limit` bytes; every byte read is held in `pending` (and counted in `held`)
    until the caller gives it back, so bodies being read count against the budget too. Bytes are held as
    they arrive, not as declared: a client that declares 64 MiB and sends nothing holds nothing."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestError(f"the request body is larger than the {limit:,} bytes allowed", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body is larger than the {limit:,} bytes allowed", status=413)
        if size > held[0]:
            if not pending.take(size - held[0]):
                raise _too_busy(pending)
            held[0] = size
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(raw: bytes, config: AppConfig, limits: RequestLimits) -> tuple[ChatRequest, Any]:
    """Raw bytes -> (checked request, decoded body), each bound checked before the step it protects."""
    check_json_shape(raw, limits)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not UTF-8 (byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise RequestError(f"the request body is not valid JSON ({str(exc)[:200]})") from None
    req = parse_chat_request(body, max_tokens_limit=config.max_tokens, image_root=config.image_root)
    check_request_cost(req, limits)
    return req, body


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Any:
    """The worker's way to hand an event to a handler; a no-op once the loop is gone (a forced stop: the
    second Ctrl-C cancels the handlers and closes the loop while the engine finishes its step)."""
    def emit(event: Event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    return emit


def _owner(api_key: str | None, user: str | None) -> str:
    """Who a conversation belongs to: the API key it was sent with and OpenAI's `user` field, hashed."""
    if not api_key and user is None:
        return ""
    h = hashlib.sha256()
    for part in (api_key or "", "\0", user if user is not None else "\1"):
        h.update(part.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


def _bearer(request: Request) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode("utf-8")


def create_app(worker: EngineWorker, config: AppConfig) -> ASGIApp:
    """The ASGI application (the worker must be started by the caller)."""
    pending = PendingBytes(max(config.max_pending_bytes, config.max_body_bytes))
    parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3wb-serve-parse")  # one body at a time
    limits: list[RequestLimits] = []

    def request_limits() -> RequestLimits:
        if not limits:  # read from the model on first use (the guard's tests run without one)
            limits.append(RequestLimits.for_model(
                worker.model, worker.tokenizer, max_values=config.max_json_values, max_depth=config.max_json_depth,
                max_images=config.max_images, max_image_area=config.max_image_area,
                max_image_patches=config.max_image_patches))
        return limits[0]

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": config.model_id, "object": "model",
                                                         "created": 0, "owned_by": "k3-workbench"}]})

    async def chat(request: Request) -> Response:
        held = [0]  # body bytes this request holds in `pending`, given back once the worker is done with it

        def give_back() -> None:
            pending.give_back(held[0])
            held[0] = 0

        submitted = False
        try:
            if worker.stopping:
                raise _shutting_down()
            raw = await _read_body(request, config.max_body_bytes, pending, held)
            loop = asyncio.get_running_loop()
            try:
                req, body = await loop.run_in_executor(parser, _decode, raw, config, request_limits())
            except (RequestError, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - a reader's own failure: one line, the server goes on
                print(f"workbench serve: reading a request failed: {type(exc).__name__}: {str(exc)[:200]}",
                      file=sys.stderr)
                raise RequestError(f"the server could not read this request ({type(exc).__name__})", status=500,
                                   kind="server_error") from None
            del raw
            events: asyncio.Queue = asyncio.Queue()
            request_id = f"chatcmpl-{secrets.token_hex(12)}"
            # the decoded body travels only where other ranks need it (it is as large as the request)
            job = Job(req, request_id, _emitter(loop, events),
                      body=body if worker.channel is not None else None, owner=_owner(_bearer(request), req.user),
                      on_finish=give_back)  # the worker's thread: PendingBytes takes a lock
            del body
            if worker.stopping:
                raise _shutting_down()
            if not worker.submit(job):
                if worker.stopping:
                    raise _shutting_down()
                busy = RequestError(f"the server's queue is full ({worker.options.max_queue} requests wait for the "
                                    "model); retry later", status=429, kind="rate_limit_error",
                                    code="rate_limit_exceeded")
                return _json_error(busy, {"Retry-After": "1"})
            submitted = True
        except RequestError as exc:
            return _json_error(exc, {"Retry-After": "1"} if exc.status in (429, 503) else None)
        finally:
            if not submitted:
                give_back()

        async def next_event() -> Event | None:
            """The job's next event; None (and the job cancelled) once the client has gone."""
            while True:
                try:
                    return await asyncio.wait_for(events.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancelled.set()
                        return None

        try:
            first = await next_event()
        except BaseException:
            job.cancelled.set()
            raise
        if first is None:
            return Response(status_code=499)
        if isinstance(first, Failed):
            return _failed(first)
        if req.stream:
            return StreamingResponse(_stream(job, events, config.model_id, req.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-store"})
        content: list[str] = []
        reasoning: list[str] = []
        try:
            while True:
                event = await next_event()
                if event is None:
                    return Response(status_code=499)
                if isinstance(event, TextDelta):
                    content.append(event.text)
                elif isinstance(event, ReasoningDelta):
                    reasoning.append(event.text)
                elif isinstance(event, Failed):
                    return _failed(event)
                elif isinstance(event, Finished):
                    return JSONResponse(completion_body(
                        request_id, config.model_id, "".join(content), _finish(event.finish_reason),
                        usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens),
                        {"k3": _k3_info(event), **event.fields[0]}, reasoning="".join(reasoning) or None,
                        logprobs=event.logprobs, choice_extra=event.fields[1]))
        except BaseException:
            job.cancelled.set()
            raise

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return _json_error(RequestError(f"{request.method} {request.url.path[:200]} is not an endpoint of this server "
                                        "(POST /v1/chat/completions, GET /v1/models)", status=status))

    app = Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                            Route("/v1/chat/completions", chat, methods=["POST"])],
                    exception_handlers={404: not_found, 405: not_found})
    return Guard(app, config)


def _failed(event: Failed) -> JSONResponse:
    """A failed job's error body; a failure the model's numbers caused says where (`error.k3`)."""
    body = error_body(RequestError(event.message, status=event.status, param=event.param, code=event.code,
                                   kind="invalid_request_error" if event.status < 500 else "server_error"))
    if event.where is not None:
        body["error"]["k3"] = event.where
    return JSONResponse(body, status_code=event.status)


def _shutting_down() -> RequestError:
    return RequestError("the server is shutting down; retry on another server or later", status=503,
                        kind="server_error", code="server_shutting_down")


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _k3_info(done: Finished) -> dict:
    """What this server adds to a response: the conversation, its trace and turn, the reused prefix."""
    out = {"conversation": done.conversation, "trace": done.trace, "turn": done.turn,
           "cached_tokens": done.cached_tokens, "ttft_s": done.ttft_s}
    if done.notice:  # what the model can answer (its card), with every free-form reply
        out["notice"] = done.notice
    return out


async def _stream(job: Job, events: asyncio.Queue, model_id: str, include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events of a running job; cancelling the stream (the client left) cancels the job."""
    rid = job.request_id
    try:
        yield _sse(chunk_body(rid, model_id, {"role": "assistant", "content": ""}))
        while True:
            event = await events.get()
            if isinstance(event, TextDelta):
                yield _sse(chunk_body(rid, model_id, {"content": event.text}))
            elif isinstance(event, ReasoningDelta):  # the field vLLM and SGLang stream a reasoning model's thinking in
                yield _sse(chunk_body(rid, model_id, {"reasoning_content": event.text}))
            elif isinstance(event, TokenLogprob):  # one generated token's log-probabilities, as it is drawn
                yield _sse(chunk_body(rid, model_id, {}, logprobs=[event.entry]))
            elif isinstance(event, Failed):
                yield _sse(error_body(RequestError(event.message, status=event.status, kind="server_error")))
                return
            elif isinstance(event, Finished):
                last = chunk_body(rid, model_id, {}, _finish(event.finish_reason))
                last["choices"][0].update(event.fields[1])  # captures and token ids, with the last chunk
                yield _sse({**last, "k3": _k3_info(event), **event.fields[0]})
                if include_usage:
                    yield _sse(chunk_body(rid, model_id, {}, usage_=usage(
                        event.prompt_tokens, event.completion_tokens, event.cached_tokens)))
                yield b"data: [DONE]\n\n"
                return
    finally:
        job.cancelled.set()  # a no-op once the job is done; stops generation when the client went away


__all__ = ["AppConfig", "Guard", "create_app"]
