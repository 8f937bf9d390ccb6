"""Does a deployment compute the model? `conformance(endpoint, model, prompts)` asks an OpenAI-compatible
endpoint (vLLM, SGLang, `workbench serve`) for greedy answers with their log-probabilities, runs the same
prompt and the same generated tokens through this exact engine (teacher-forced: one forward), and
compares them position by position.

Per prompt: the endpoint's tokens (from the bytes its `logprobs` return), the log-probability of each
under the endpoint and under the engine, their largest difference, and the first position where they
differ by more than `tolerance` nats, or where the endpoint's greedy token is not the engine's argmax
although the engine's top two are further apart than `tolerance` (a near-tie is not called a bug).
The verdict is `conforms`, `diverges` (with the first divergent prompt and position) or `error` (the
endpoint refused or failed: its message, not a verdict). Which layer first diverges needs the
endpoint's captures (routes, DSA selections): `first_divergent_layer` stays None until those are read.

The prompts are rendered in the K3 chat format by this engine (`engine.session.transcript`), as a K3
deployment's chat template renders them; a deployment whose template differs diverges at position 0.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.errors import InputError
from engine.session.transcript import parse_messages, render_messages

MAX_PROMPTS = 1000
DEFAULT_TOLERANCE = 0.1  # nats: far above fp32-vs-fp32 noise, below any change a broken kernel makes


@dataclass
class PromptResult:
    """One prompt's comparison."""

    prompt: str                      # the prompt, shortened for the report
    prompt_tokens: int = 0
    generated: int = 0
    max_logprob_diff: float | None = None  # nats, over the generated tokens
    first_divergent_position: int | None = None  # index of the first divergent generated token
    verdict: str = "conforms"        # conforms | diverges | error
    detail: str = ""                 # what diverged, or the endpoint's error


@dataclass
class ConformanceReport:
    verdict: str
    first_divergent_layer: int | None
    first_divergent_position: int | None
    prompts: list[PromptResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "first_divergent_layer": self.first_divergent_layer,
                "first_divergent_position": self.first_divergent_position,
                "prompts": [asdict(p) for p in self.prompts]}


def read_prompts(path: str | Path) -> list[Any]:
    """`--prompts FILE`: a JSON list whose items are strings or OpenAI message lists (checked)."""
    from engine.io.files import parse_json, read_limited

    raw = parse_json(read_limited(Path(path), "a prompts file", InputError, 64 << 20), str(path), InputError)
    if not isinstance(raw, list) or not raw or len(raw) > MAX_PROMPTS:
        raise InputError(f"{path}: expected a JSON list of 1 to {MAX_PROMPTS} prompts (strings or message lists)")
    for i, item in enumerate(raw):
        if not (isinstance(item, str) and item) and not (isinstance(item, list) and item):
            raise InputError(f"{path}: prompt {i} must be a non-empty string or a list of messages")
    return raw


def long_context_suite(tokenizer: Any, *, lengths: Sequence[int] = (100, 509, 1031, 2053)) -> list[Any]:
    """Prompts built to trigger the known failure classes: lengths that cross prefill chunk boundaries at
    odd offsets, a second request that continues a cached prefix at an odd length, a repeated request
    (run-to-run determinism)."""
    words = "the quick brown fox jumps over the lazy dog while a needle waits in the hay ".split()
    prompts: list[Any] = []
    for n in lengths:
        text = " ".join(words[i % len(words)] for i in range(n))
        prompts.append(f"{text}\nWhat waits in the hay?")
    prompts.append(prompts[1])  # the same request again: a deployment must answer it the same way
    first = [{"role": "user", "content": prompts[0]}]
    prompts.append(first + [{"role": "assistant", "content": "a needle"}, {"role": "user", "content": "Where?"}])
    return prompts


def _messages(prompt: Any) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _ask(endpoint: str, model_id: str, messages: list[dict], max_tokens: int, timeout: float,
         api_key: str | None) -> dict:
    body = json.dumps({"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "logprobs": True, "top_logprobs": 1}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(endpoint.rstrip("/") + "/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - the user's own endpoint
            return json.loads(reply.read(64 << 20))
    except urllib.error.HTTPError as exc:
        text = exc.read(4096).decode("utf-8", errors="replace")
        try:
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise EndpointError(f"HTTP {exc.code}: {str(text)[:300]}") from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        raise EndpointError(f"{type(exc).__name__}: {str(exc)[:300]}") from None


class EndpointError(Exception):
    """The endpoint refused or failed a request (reported as such, never as a divergence)."""


def _token_ids(tokenizer: Any, entries: list[dict]) -> list[int]:
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


def compare_prompt(model: Any, tokenizer: Any, prompt: Any, reply: dict, tolerance: float, *,
                   open_response: bool = False) -> PromptResult:
    """The engine's log-probabilities of the endpoint's tokens beside the endpoint's own."""
    messages = _messages(prompt)
    shown = (prompt if isinstance(prompt, str) else json.dumps(prompt))[:80]
    result = PromptResult(shown)
    try:
        entries = reply["choices"][0]["logprobs"]["content"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError("the reply holds no choices[0].logprobs.content (does the server return logprobs?)") \
            from None
    ids = _token_ids(tokenizer, entries)
    rendered = render_messages(model, tokenizer, parse_messages(messages, image_root=None),
                               add_generation_prompt=True, open_response=open_response).ids
    result.prompt_tokens, result.generated = len(rendered), len(ids)
    theirs_prompt = (reply.get("usage") or {}).get("prompt_tokens")
    if isinstance(theirs_prompt, int) and theirs_prompt != len(rendered):
        result.verdict, result.first_divergent_position = "diverges", 0
        result.detail = (f"the endpoint rendered {theirs_prompt} prompt tokens, this engine {len(rendered)} "
                         "(another chat template, or the response opened on one side only)")
        return result
    if not ids:
        return result
    with torch.no_grad():
        logits = model(torch.tensor([rendered + ids], device=model.lm_head.weight.device))[0]
    dist = torch.log_softmax(logits[len(rendered) - 1:-1].float(), -1).cpu()
    theirs = torch.tensor([float(e["logprob"]) for e in entries])
    ours = dist.gather(1, torch.tensor(ids)[:, None])[:, 0]
    diff = (ours - theirs).abs()
    result.max_logprob_diff = float(diff.max())
    # greedy as this engine decodes: reserved ids are never generated (`Session.suppressed_ids`)
    reserved = sorted(i for i in getattr(tokenizer, "reserved_ids", ()) if i < dist.shape[-1])
    top2 = (dist.index_fill(-1, torch.tensor(reserved, dtype=torch.long), float("-inf")) if reserved else dist).topk(2, -1)
    for pos in range(len(ids)):
        margin = float(top2.values[pos, 0] - top2.values[pos, 1])
        not_argmax = ids[pos] != int(top2.indices[pos, 0]) and margin > tolerance
        if not math.isfinite(float(theirs[pos])) or float(diff[pos]) > tolerance or not_argmax:
            result.first_divergent_position, result.verdict = pos, "diverges"
            result.detail = (f"token {pos} ({tokenizer.piece(ids[pos])!r}): log p {float(theirs[pos]):.4f} there, "
                             f"{float(ours[pos]):.4f} here" + ("; not the engine's greedy choice (margin "
                                                               f"{margin:.3f} nats)" if not_argmax else ""))
            break
    return result


def conformance(endpoint: str, model: Any, tokenizer: Any, prompts: Sequence[Any], *, model_id: str,
                max_tokens: int = 16, tolerance: float = DEFAULT_TOLERANCE, timeout: float = 600.0,
                api_key: str | None = None, open_response: bool = False) -> ConformanceReport:
    """`open_response`: render as a server of a templated model does (its card's `tasks`: the response is
    opened after the generation prompt; `workbench serve` does so for builtin:demo)."""
    if tokenizer is None:
        raise InputError("conformance needs the model's tokenizer files (the endpoint's tokens are read through it)")
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 100):
        raise InputError(f"tolerance must be a positive number of nats, got {tolerance!r:.40}")
    results = []
    for prompt in prompts:
        try:
            reply = _ask(endpoint, model_id, _messages(prompt), max_tokens, timeout, api_key)
            results.append(compare_prompt(model, tokenizer, prompt, reply, tolerance, open_response=open_response))
        except EndpointError as exc:
            shown = (prompt if isinstance(prompt, str) else json.dumps(prompt))[:80]
            results.append(PromptResult(shown, verdict="error", detail=str(exc)))
    diverged = next((r for r in results if r.verdict == "diverges"), None)
    verdict = "diverges" if diverged else "error" if any(r.verdict == "error" for r in results) else "conforms"
    return ConformanceReport(verdict, None, diverged.first_divergent_position if diverged else None, results)


__all__ = ["ConformanceReport", "DEFAULT_TOLERANCE", "PromptResult", "conformance", "long_context_suite",
           "read_prompts"]
