"""Asking an OpenAI-compatible endpoint, and reading what it answered.

One chat-completions request per prompt: greedy (`temperature: 0`), `logprobs` with one top
alternative, vLLM's `return_token_ids` and, unless captures are off, SGLang's `return_routed_experts` /
`return_indexer_topk` (servers ignore fields they do not know; one that refuses them answers an HTTP
error, reported as an endpoint error). The reply is read into an `EndpointReply`:
the token ids (vLLM's `prompt_token_ids` / `choices[0].token_ids` when returned, else the generated
tokens from the bytes of `logprobs`), the per-token log-probabilities, and the captured arrays from
vLLM's fields (`prompt_routed_experts`, `choices[0].routed_experts`, `choices[0].indexer_topk`) or,
when those are absent, SGLang's `choices[0].sgl_ext` (the layouts: docs/captures.md), each checked
against the model config by the importer's own readers and mapped onto our layer numbering.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import InputError
from workbench.captures.arrays import flat_array, npy_array
from workbench.captures.records import layer_choices, layer_map


class EndpointError(Exception):
    """The endpoint refused or failed a request (reported as such, never as a divergence), except
    `NonFiniteOutput`: the endpoint says its own model output went NaN/inf (see `check`)."""

    def __init__(self, message: str, body: dict | None = None) -> None:
        super().__init__(message)
        self.body = body or {}


@dataclass
class EndpointReply:
    generated: list[int]                       # the generated token ids
    logprobs: list[float]                      # the endpoint's log-probability of each (NaN kept as NaN)
    prompt_ids: list[int] | None = None        # when the endpoint returned them
    prompt_tokens: int | None = None           # usage.prompt_tokens
    cached_tokens: int | None = None           # usage.prompt_tokens_details.cached_tokens
    content: str = ""                          # the reply's text (what a client sends back next turn)
    routes: tuple[np.ndarray, int] | None = None       # [rows, hidden layers, k], first position
    selections: tuple[np.ndarray, int] | None = None
    seconds: float = 0.0


def ask(endpoint: str, model_id: str, messages: list[dict], max_tokens: int, timeout: float,
        api_key: str | None, *, captures: bool = True) -> dict:
    """POST one greedy chat completion; EndpointError for anything but a JSON reply."""
    body: dict[str, Any] = {"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    if captures:
        body.update(return_routed_experts=True, return_indexer_topk=True)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(endpoint.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - the user's own endpoint
            return json.loads(reply.read(1 << 30))
    except urllib.error.HTTPError as exc:
        text = exc.read(65536).decode("utf-8", errors="replace")
        error: dict = {}
        try:
            error = json.loads(text)["error"]
            text = error["message"]
        except (ValueError, KeyError, TypeError):
            error = error if isinstance(error, dict) else {}
        raise EndpointError(f"HTTP {exc.code}: {str(text)[:300]}", error) from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        raise EndpointError(f"{type(exc).__name__}: {str(exc)[:300]}") from None


def _ids_from_bytes(tokenizer: Any, entries: list[dict]) -> list[int]:
    ids = []
    for i, entry in enumerate(entries):
        raw = entry.get("bytes") if isinstance(entry, dict) else None
        if not isinstance(raw, list) or not all(isinstance(b, int) and 0 <= b < 256 for b in raw):
            raise EndpointError(f"logprobs entry {i} has no token bytes")
        try:
            ids.append(tokenizer.encoding.encode_single_token(bytes(raw)))
        except KeyError:
            raise EndpointError(f"logprobs entry {i}: bytes {bytes(raw)[:20]!r} are no token of this model's "
                                "tokenizer") from None
    return ids


def _int_list(value: Any, where: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab
                                              for v in value):
        raise EndpointError(f"{where} is not a list of token ids of this model")
    return list(value)


def _hidden(array: np.ndarray, config: Any, family: str, where: str) -> np.ndarray:
    """A captured [rows, layers, width] array on our hidden-layer axis (family-only layer axes mapped)."""
    try:
        mapping = layer_map(config, family, array.shape[1])
    except InputError as exc:
        raise EndpointError(f"{where}: {exc}") from None
    out = np.full((array.shape[0], config.num_hidden_layers, array.shape[2]), 0 if family == "moe" else -1, np.int32)
    out[:, list(mapping.layers)] = array[:, list(mapping.entries)]
    return out


def _npy(text: Any, max_rows: int, config: Any, family: str, where: str) -> np.ndarray:
    width = config.num_experts_per_token if family == "moe" else config.dsa.topk
    largest = config.num_experts - 1 if family == "moe" else max(max_rows - 1, 0)
    try:
        rows = npy_array(text, max_rows, layer_choices(config, family), width, largest,
                         "expert ids" if family == "moe" else "key positions", where)
    except InputError as exc:
        raise EndpointError(str(exc)) from None
    return _hidden(rows.read(0, rows.rows).astype(np.int32), config, family, where)


def _flat(text: Any, dtype: Any, rows: int, config: Any, family: str, where: str) -> np.ndarray:
    width = config.num_experts_per_token if family == "moe" else config.dsa.topk
    largest = config.num_experts - 1 if family == "moe" else max(rows - 1, 0)
    try:
        array = flat_array(text, dtype, rows, layer_choices(config, family), width, largest,
                           "expert ids" if family == "moe" else "key positions", where)
    except InputError as exc:
        raise EndpointError(str(exc)) from None
    return _hidden(array.read(0, array.rows).astype(np.int32), config, family, where)


def read_reply(reply: dict, tokenizer: Any, config: Any) -> EndpointReply:
    """The parts of a chat-completions reply the comparison reads (EndpointError when one is malformed)."""
    try:
        choice = reply["choices"][0]
        entries = choice["logprobs"]["content"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError("the reply holds no choices[0].logprobs.content (does the server return logprobs?)") \
            from None
    if not isinstance(entries, list):
        raise EndpointError("choices[0].logprobs.content is not a list")
    vocab = config.vocab_size
    generated = (_int_list(choice["token_ids"], "choices[0].token_ids", vocab) if choice.get("token_ids") is not None
                 else _ids_from_bytes(tokenizer, entries))
    if len(generated) != len(entries):
        raise EndpointError(f"choices[0].token_ids holds {len(generated)} tokens, logprobs {len(entries)}")
    logprobs = []
    for i, e in enumerate(entries):
        value = e.get("logprob") if isinstance(e, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EndpointError(f"logprobs entry {i} has no numeric logprob")
        logprobs.append(float(value))  # NaN / inf kept: a non-finite log-probability is a divergence
    usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    out = EndpointReply(generated, logprobs,
                        prompt_tokens=usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None,
                        cached_tokens=details.get("cached_tokens") if isinstance(details.get("cached_tokens"), int)
                        else None, content=message.get("content") or "")
    if reply.get("prompt_token_ids") is not None:
        out.prompt_ids = _int_list(reply["prompt_token_ids"], "prompt_token_ids", vocab)
    if out.prompt_ids is None or not generated:
        return out  # arrays are placed by the token counts: without the prompt's ids they cannot be
    total = len(out.prompt_ids) + len(generated)
    end = total - 1
    if reply.get("prompt_routed_experts") is not None and choice.get("routed_experts") is not None:  # vLLM
        prompt = _npy(reply["prompt_routed_experts"], len(out.prompt_ids), config, "moe", "prompt_routed_experts")
        rest = _npy(choice["routed_experts"], end, config, "moe", "choices[0].routed_experts")
        if len(rest) != end - len(out.prompt_ids):
            raise EndpointError(f"choices[0].routed_experts holds {len(rest)} rows; the generated tokens fed forward "
                                f"are {end - len(out.prompt_ids)}")
        both = np.concatenate([prompt, rest])
        out.routes = (both, end - len(both))
    ext = choice.get("sgl_ext") if isinstance(choice.get("sgl_ext"), dict) else {}
    if out.routes is None and ext.get("routed_experts") is not None:  # SGLang
        start = ext.get("routed_experts_start_len", 0)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= end:
            raise EndpointError(f"sgl_ext.routed_experts_start_len {start!r:.40} is not a position before {end}")
        out.routes = (_flat(ext["routed_experts"], ext.get("routed_experts_dtype"), end - start, config, "moe",
                            "choices[0].sgl_ext.routed_experts"), start)
    if config.dsa is not None:
        if choice.get("indexer_topk") is not None:
            sel = _npy(choice["indexer_topk"], end, config, "dsa", "choices[0].indexer_topk")
            out.selections = (sel, end - len(sel))
        elif ext.get("indexer_topk") is not None:
            start = out.routes[1] if out.routes is not None else 0
            out.selections = (_flat(ext["indexer_topk"], None, end - start, config, "dsa",
                                    "choices[0].sgl_ext.indexer_topk"), start)
    return out


def timed_ask(endpoint: str, model_id: str, messages: list[dict], max_tokens: int, timeout: float,
              api_key: str | None, captures: bool) -> tuple[dict, float]:
    started = time.perf_counter()
    reply = ask(endpoint, model_id, messages, max_tokens, timeout, api_key, captures=captures)
    return reply, time.perf_counter() - started


__all__ = ["EndpointError", "EndpointReply", "ask", "read_reply", "timed_ask"]
