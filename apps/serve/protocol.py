"""The OpenAI chat-completions wire format: request checks, response bodies, error bodies.

`parse_chat_request(body, ...)` turns a decoded JSON body into a `ChatRequest` or raises
`RequestError` (HTTP status, message, offending parameter), which `error_body` renders the way
OpenAI's API does: `{"error": {"message", "type", "param", "code"}}`. Fields the engine has no
use for (`tools`, `response_format`, ...) are accepted and ignored, as other OpenAI-compatible
servers do; fields that would change the answer and that the engine cannot honour (`n` > 1,
penalties, `logit_bias`, a `response_format` other than text) are refused rather than
silently dropped. `return_routed_experts` / `return_indexer_topk` (SGLang's flags) and `return_token_ids`
(vLLM's) add the captures and token ids in both engines' response fields (`apps.serve.captures`).
`logprobs` / `top_logprobs` (at most 20) are answered the OpenAI way, for every
generated token (the chat tags included: they are tokens the model computed, and a conformance check
compares them too). `user` (OpenAI's end-user id) keeps that end
user's conversations apart from everyone else's. Every field is checked here, in the engine's own
ranges (the sampling parameters are built by `SamplingParams` itself), so a request the engine would
refuse never reaches a cached conversation or a trace.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import InputError
from engine.session.sampling import SamplingParams
from engine.session.transcript import TranscriptMessage, parse_messages

if TYPE_CHECKING:
    import torch

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
SEED_RANGE = (0, 2 ** 64 - 1)  # the engine's generator seeds


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `kind`, the `param` at fault."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def error_body(exc: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.code}}

MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass(frozen=True)
class ChatRequest:
    """A checked `POST /v1/chat/completions` body."""

    messages: list[TranscriptMessage]
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    user: str | None = None  # OpenAI's end-user id: conversations of different users never mix
    continue_final: bool = False  # vLLM's continue_final_message: the last assistant message is a response start
    logprobs: bool = False  # each generated token's log-probability (and the `top_logprobs` most likely)
    top_logprobs: int = 0
    # captures (`apps.serve.captures`): SGLang's request flags; vLLM's `return_token_ids`
    return_routed_experts: bool = False
    return_indexer_topk: bool = False
    return_token_ids: bool = False
    routed_experts_start_len: int = 0  # SGLang's: its arrays start at this position

    def sampling(self) -> SamplingParams:
        """The engine's sampling parameters of this request (checked when the request was parsed)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              max_new_tokens=self.max_tokens)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {str(value)[:40]!r}", param=name)
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be in [{lo:g}, {hi:g}], got {value:g}", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {str(value)[:40]!r}", param=name)
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return value


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if (not isinstance(values, list) or len(values) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in values)):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at "
                           f"most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(values)


def parse_chat_request(body: Any, *, max_tokens_limit: int, image_root: Path | None) -> ChatRequest:
    """Check a decoded request body (raises RequestError naming the parameter)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "messages" not in body:
        raise RequestError("messages is required", param="messages")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", param="model")
    n = _integer(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise RequestError("only n=1 is supported (one model, one sequence per request)", param="n")
    logprobs = _flag(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _number(body, penalty, 0.0, -2.0, 2.0) != 0:
            raise RequestError(f"{penalty} is not supported by this server (only 0)", param=penalty)
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or bias):
        raise RequestError("logit_bias is not supported by this server (only an empty object)", param="logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError("response_format: only {\"type\": \"text\"} is supported by this server",
                           param="response_format")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("stream_options must be an object {\"include_usage\": bool}", param="stream_options")
    limit = _integer(body, "max_completion_tokens", 1, max_tokens_limit)
    if limit is None:
        limit = _integer(body, "max_tokens", 1, max_tokens_limit)
    top_p = _number(body, "top_p", 0.95, 0.0, 1.0)
    if top_p == 0:
        raise RequestError("top_p must be greater than 0 (use temperature 0 for greedy decoding)", param="top_p")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise RequestError(f"user must be a string of at most {MAX_USER_CHARS} characters", param="user")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    seed = _integer(body, "seed", *SEED_RANGE)
    stop = _stop(body)
    continue_final = _flag(body, "continue_final_message", False)
    if _flag(body, "add_generation_prompt", True) == continue_final:
        # vLLM's pair: a new assistant turn (the default), or the last assistant message continued
        raise RequestError("continue_final_message: true needs add_generation_prompt: false, and "
                           "add_generation_prompt: false is only for continuing a final assistant message",
                           param="add_generation_prompt")
    try:
        messages = parse_messages(body["messages"], image_root=image_root)
    except InputError as exc:
        raise RequestError(str(exc), param="messages") from None
    request = ChatRequest(messages=messages, stream=bool(stream), include_usage=bool(options.get("include_usage")),
                          temperature=temperature, top_p=top_p,
                          max_tokens=limit if limit is not None else min(256, max_tokens_limit),
                          seed=seed, stop=stop, user=user, continue_final=continue_final, logprobs=logprobs,
                          top_logprobs=top_logprobs,
                          return_routed_experts=_flag(body, "return_routed_experts", False),
                          return_indexer_topk=_flag(body, "return_indexer_topk", False),
                          return_token_ids=_flag(body, "return_token_ids", False),
                          routed_experts_start_len=_integer(body, "routed_experts_start_len", 0, 1 << 40) or 0)
    try:
        request.sampling()  # the engine's own checks, now rather than after a cached conversation is taken
    except InputError as exc:
        raise RequestError(str(exc)) from None
    return request


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_body(request_id: str, model: str, content: str, finish_reason: str, usage_: dict,
                    extra: dict[str, Any], reasoning: str | None = None,
                    logprobs: list[dict] | None = None, choice_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole reply: `content` is the response text only; the thinking (when the model wrote any) is
    `reasoning_content`, as vLLM and SGLang return it for reasoning models."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": {"content": logprobs} if logprobs is not None else None, **(choice_extra or {})}],
            "usage": usage_, **extra}


def chunk_body(request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None = None,
               usage_: dict | None = None, logprobs: list[dict] | None = None) -> dict[str, Any]:
    choices = [] if usage_ is not None else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                              "logprobs": {"content": logprobs} if logprobs is not None else None}]
    out: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def token_logprob(tokenizer: Any, token: int, logprobs: "torch.Tensor", top: int) -> dict[str, Any]:
    """One generated token the OpenAI way: `{token, logprob, bytes, top_logprobs: [...]}` from the
    log-probabilities `[vocab]` it was sampled from."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(t) if tokenizer is not None else b""
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

    out = entry(token, float(logprobs[token]))
    best = logprobs.topk(top) if top else None
    out["top_logprobs"] = ([entry(int(t), float(v)) for v, t in zip(best.values.tolist(), best.indices.tolist())]
                           if best is not None else [])
    return out
