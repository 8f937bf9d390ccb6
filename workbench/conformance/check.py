"""Does a deployment compute the model? The comparison of one endpoint reply with this engine, and the run.

Per prompt (`compare_reply`): the endpoint's tokens (its `prompt_token_ids` / `token_ids` when it returns
them, else the prompt as this engine renders it and the generated tokens from the bytes of `logprobs`),
teacher-forced through this exact engine (`reference.reference_run`), and compared:
- the log-probability of each generated token, there and here: a divergence where they differ by more
  than `tolerance` nats, where the endpoint's is not finite, or where the endpoint's greedy token is not
  the engine's argmax although the engine's top two are further apart than `tolerance` (a near-tie is
  not called a bug);
- the captured routes and DSA selections, per layer and position, beside the engine's tie bands
  (`layers.compare_layers`: a tie is counted, never called a divergence);
- the prompt's tokens: a prompt this engine renders differently diverges at the first differing token
  (another chat template). A follow-up built from an earlier reply is checked against the ids the server
  reports (the server renders its own replies from their exact ids, which re-encoding the text need not
  give back), and its restored prefix must be the earlier request's exact tokens.

Positions are sequence positions (0-based over prompt + generated tokens) of the forward that diverged:
the forward at position p consumed token p and computed the routes and selections of p and the
distribution of token p + 1, so a generated token k's log-probability belongs to position
prompt_tokens + k - 1. The first divergence of a prompt is its earliest; its layer is the first layer
whose routes or selections diverged anywhere (`layers.compare_layers`; None when the captures agree or
were not returned).

Suite items (`suite.SuiteItem`) add the run-to-run and concurrency checks: a `repeat` or `concurrent`
item must give exactly the ids and log-probabilities of the item it repeats (the concurrent ones are
sent all at once). An endpoint that fails a request says so as an error, not a divergence, except a
`workbench serve` failure coded `non_finite_output` (its model went NaN/inf) where this engine's output
is finite: that is a divergence, at the position and layer the server names.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from engine.errors import InputError, NumericsError
from engine.session.transcript import parse_messages, render_messages
from workbench.conformance.endpoint import EndpointError, EndpointReply, read_reply, timed_ask
from workbench.conformance.layers import DEFAULT_SCORE_MARGIN, compare_layers
from workbench.conformance.reference import reference_run
from workbench.conformance.suite import SuiteItem, as_items, messages_of

DEFAULT_TOLERANCE = 0.1  # nats: far above fp32-vs-fp32 noise, below any change a broken kernel makes
DEFAULT_ROUTE_MARGIN = 1e-4  # choice-score units (sigmoid + bias, O(1)): fp32 noise is ~1e-6


@dataclass
class PromptResult:
    """One prompt's comparison."""

    prompt: str                      # the prompt, shortened for the report
    kind: str = "single"             # single | repeat | follow-up | concurrent
    prompt_tokens: int = 0
    generated: int = 0
    cached_tokens: int | None = None  # the endpoint's reused prefix (usage.prompt_tokens_details)
    max_logprob_diff: float | None = None  # nats, over the generated tokens
    first_divergent_position: int | None = None  # sequence position of the first divergent forward
    first_divergent_layer: int | None = None
    first_divergent_token: int | None = None  # index of the first generated token whose log-prob diverged
    compared_rows: int = 0           # (position, layer) capture rows compared
    ties: int = 0                    # capture rows that differ only inside a tie
    verdict: str = "conforms"        # conforms | diverges | error
    detail: str = ""                 # what diverged, or the endpoint's error
    seconds: float = 0.0             # the endpoint's answer and this comparison, together


@dataclass
class ConformanceReport:
    verdict: str
    first_divergent_layer: int | None
    first_divergent_position: int | None
    prompts: list[PromptResult] = field(default_factory=list)
    endpoint: str = ""
    model: str = ""
    max_logprob_diff: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "first_divergent_layer": self.first_divergent_layer,
                "first_divergent_position": self.first_divergent_position, "endpoint": self.endpoint,
                "model": self.model, "max_logprob_diff": self.max_logprob_diff,
                "prompts": [asdict(p) for p in self.prompts]}


def _shown(prompt: Any) -> str:
    return (prompt if isinstance(prompt, str) else json.dumps(prompt))[:80]


def _diverge(result: PromptResult, position: int, detail: str, layer: int | None = None) -> None:
    if result.first_divergent_position is None or position < result.first_divergent_position:
        result.first_divergent_position = position
    if layer is not None and result.first_divergent_layer is None:
        result.first_divergent_layer = layer
    result.verdict = "diverges"
    result.detail = "; ".join(d for d in (result.detail, detail) if d)


def _render(model: Any, tokenizer: Any, messages: list[dict], open_response: bool) -> list[int]:
    return render_messages(model, tokenizer, parse_messages(messages, image_root=None), add_generation_prompt=True,
                           open_response=open_response).ids


def compare_reply(model: Any, tokenizer: Any, messages: list[dict], reply: EndpointReply, result: PromptResult, *,
                  tolerance: float, open_response: bool, restored: list[int] | None = None,
                  route_margin: float = DEFAULT_ROUTE_MARGIN, score_margin: float = DEFAULT_SCORE_MARGIN) -> None:
    """Fill `result` with the comparison of `reply` to this engine (see the module docstring).
    `restored`: a follow-up's expected prefix (the earlier request's prompt and generated ids)."""
    if restored is not None and reply.prompt_ids is None:
        raise EndpointError("the endpoint returned no prompt_token_ids: a follow-up built from its reply cannot be "
                            "compared token for token (re-encoding the reply's text need not give its ids back)")
    rendered = _render(model, tokenizer, messages, open_response) if restored is None else None
    prompt = reply.prompt_ids if reply.prompt_ids is not None else rendered
    assert prompt is not None
    result.prompt_tokens, result.generated, result.cached_tokens = len(prompt), len(reply.generated), reply.cached_tokens
    if rendered is not None and reply.prompt_ids is None and reply.prompt_tokens not in (None, len(rendered)):
        _diverge(result, 0, f"the endpoint rendered {reply.prompt_tokens} prompt tokens, this engine {len(rendered)} "
                            "(another chat template, or the response opened on one side only)")
        return
    if rendered is not None and reply.prompt_ids is not None and rendered != reply.prompt_ids:
        at = next((i for i, (a, b) in enumerate(zip(rendered, reply.prompt_ids)) if a != b),
                  min(len(rendered), len(reply.prompt_ids)))
        _diverge(result, at, f"the endpoint's prompt differs from this engine's rendering at token {at} ({len(reply.prompt_ids)} "
                             f"vs {len(rendered)} tokens: another chat template)")
        return
    if restored is not None and prompt[: len(restored)] != restored:
        result.detail = "the follow-up's prompt does not start with the earlier request's exact tokens (no restore)"
    elif restored is not None and not reply.cached_tokens:
        result.detail = "the endpoint restored no cached prefix for the follow-up"
    if not reply.generated:
        return
    ids = list(prompt) + list(reply.generated)
    try:
        ref = reference_run(model, ids, len(prompt), routes=reply.routes is not None,
                            selections=reply.selections is not None, route_margin=route_margin)
    except NumericsError as exc:
        raise EndpointError(f"this engine's own output is not finite for these tokens ({str(exc)[:200]}): "
                            "no reference to compare with") from None
    theirs = torch.tensor(reply.logprobs, dtype=torch.float32)
    gen = torch.tensor(reply.generated)
    ours = ref.logprobs.gather(1, gen[:, None])[:, 0]
    diff = (ours - theirs).abs()
    finite = torch.isfinite(diff)
    result.max_logprob_diff = float(diff[finite].max()) if bool(finite.any()) else None
    if not bool(finite.all()):
        result.max_logprob_diff = float("inf")
    reserved = sorted(i for i in getattr(tokenizer, "reserved_ids", ()) if i < ref.logprobs.shape[-1])
    dist = ref.logprobs.index_fill(-1, torch.tensor(reserved, dtype=torch.long), float("-inf")) if reserved \
        else ref.logprobs
    top2 = dist.topk(2, -1)
    for k in range(len(gen)):  # greedy as this engine decodes: reserved ids are never generated
        margin = float(top2.values[k, 0] - top2.values[k, 1])
        not_argmax = int(gen[k]) != int(top2.indices[k, 0]) and margin > tolerance
        if not math.isfinite(float(theirs[k])) or float(diff[k]) > tolerance or not_argmax:
            result.first_divergent_token = k
            _diverge(result, len(prompt) + k - 1,
                     f"token {k} ({tokenizer.piece(int(gen[k]))!r}): log p {float(theirs[k]):.4f} there, "
                     f"{float(ours[k]):.4f} here" + (f"; not the engine's greedy choice (margin {margin:.3f} nats)"
                                                     if not_argmax else ""))
            break
    finding = compare_layers(reply.routes, reply.selections, ref.routes, ref.selections, score_margin=score_margin)
    result.compared_rows, result.ties = finding.compared, finding.ties
    if finding.first_layer is not None:
        assert finding.first_position is not None
        _diverge(result, finding.first_position, finding.detail, finding.first_layer)
        result.first_divergent_layer = finding.first_layer


def _same_as(result: PromptResult, reply: EndpointReply, earlier: EndpointReply, earlier_index: int) -> None:
    """A repeated request must give exactly the earlier reply's ids and log-probabilities."""
    n = len(reply.prompt_ids or [])
    for k, (a, b) in enumerate(zip(reply.generated, earlier.generated)):
        if a != b:
            _diverge(result, n + k - 1, f"run-to-run: generated token {k} is {a} here, {b} in prompt {earlier_index}")
            return
    if len(reply.generated) != len(earlier.generated):
        k = min(len(reply.generated), len(earlier.generated))
        _diverge(result, n + k - 1, f"run-to-run: {len(reply.generated)} tokens here, {len(earlier.generated)} in "
                                    f"prompt {earlier_index}")
        return
    for k, (a, b) in enumerate(zip(reply.logprobs, earlier.logprobs)):
        if a != b and not (math.isnan(a) and math.isnan(b)):
            _diverge(result, n + k - 1, f"run-to-run: log p of token {k} is {a!r} here, {b!r} in prompt "
                                        f"{earlier_index} (not bit-identical)")
            return


def _non_finite(result: PromptResult, exc: EndpointError, model: Any, tokenizer: Any, messages: list[dict],
                open_response: bool) -> bool:
    """An endpoint whose model went non-finite where this engine's is finite diverged there (True when so)."""
    if exc.body.get("code") != "non_finite_output":
        return False
    where = exc.body.get("k3") if isinstance(exc.body.get("k3"), dict) else {}
    position = where.get("position")
    layers = [l for l in where.get("layers") or [] if isinstance(l, int)]
    try:
        ids = _render(model, tokenizer, messages, open_response)
        reference_run(model, ids, len(ids))
    except (NumericsError, InputError):
        return False  # this engine fails too: not the deployment's divergence
    _diverge(result, position if isinstance(position, int) else 0,
             f"the endpoint's output went non-finite ({str(exc)[:240]}); this engine's is finite",
             layers[0] if layers else None)
    return True


def conformance(endpoint: str, model: Any, tokenizer: Any, prompts: Sequence[Any], *, model_id: str,
                max_tokens: int = 16, tolerance: float = DEFAULT_TOLERANCE, timeout: float = 600.0,
                api_key: str | None = None, open_response: bool = False, captures: bool = True,
                route_margin: float = DEFAULT_ROUTE_MARGIN) -> ConformanceReport:
    """Check every prompt (plain prompts or `SuiteItem`s; see the module docstring).

    `open_response`: render as a server of a templated model does (its card's `tasks`: the response is
    opened after the generation prompt; `workbench serve` does so for builtin:demo). `captures`: ask for
    the routes and selections (vLLM / SGLang fields) and compare them per layer."""
    if tokenizer is None:
        raise InputError("conformance needs the model's tokenizer files (the endpoint's tokens are read through it)")
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 100):
        raise InputError(f"tolerance must be a positive number of nats, got {tolerance!r:.40}")
    items = as_items(prompts)
    results: list[PromptResult] = [PromptResult(_shown(item.prompt), kind=item.kind) for item in items]
    replies: list[EndpointReply | None] = [None] * len(items)
    sent: list[list[dict] | None] = [None] * len(items)

    def messages(i: int) -> list[dict] | None:
        item = items[i]
        if item.kind != "follow-up":
            return messages_of(item.prompt)
        earlier = replies[item.of] if item.of is not None else None
        if earlier is None:
            return None
        return (list(sent[item.of] or []) + [{"role": "assistant", "content": earlier.content}]
                + messages_of(item.prompt))

    def answer(i: int) -> tuple[int, dict | EndpointError, float]:
        msgs = sent[i]
        assert msgs is not None
        try:
            reply, seconds = timed_ask(endpoint, model_id, msgs, max_tokens, timeout, api_key, captures)
            return i, reply, seconds
        except EndpointError as exc:
            return i, exc, 0.0

    def check(i: int, raw: dict | EndpointError, seconds: float) -> None:
        result, item, msgs = results[i], items[i], sent[i] or []
        started = time.perf_counter()
        try:
            if isinstance(raw, EndpointError):
                if not _non_finite(result, raw, model, tokenizer, msgs, open_response):
                    result.verdict, result.detail = "error", str(raw)
                return
            reply = read_reply(raw, tokenizer, model.config)
            replies[i] = reply
            restored = None
            if item.kind == "follow-up" and item.of is not None and replies[item.of] is not None:
                earlier = replies[item.of]
                restored = list(earlier.prompt_ids or []) + list(earlier.generated)
            compare_reply(model, tokenizer, msgs, reply, result, tolerance=tolerance, open_response=open_response,
                          restored=restored, route_margin=route_margin)
            if item.kind in ("repeat", "concurrent") and item.of is not None and replies[item.of] is not None:
                _same_as(result, reply, replies[item.of], item.of)  # type: ignore[arg-type]
        except EndpointError as exc:
            result.verdict, result.detail = "error", str(exc)
        finally:
            result.seconds = seconds + time.perf_counter() - started

    i = 0
    while i < len(items):
        group = [i]
        while items[i].kind == "concurrent" and group[-1] + 1 < len(items) and items[group[-1] + 1].kind == "concurrent":
            group.append(group[-1] + 1)
        for j in group:
            sent[j] = messages(j)
            if sent[j] is None:
                results[j].verdict, results[j].detail = "error", f"prompt {items[j].of} it follows has no reply"
        live = [j for j in group if sent[j] is not None]
        if len(live) > 1:  # sent at once: the endpoint may batch them
            with ThreadPoolExecutor(max_workers=len(live)) as pool:
                answers = list(pool.map(answer, live))
        else:
            answers = [answer(j) for j in live]
        for j, raw, seconds in answers:
            check(j, raw, seconds)
        i = group[-1] + 1
    first = next((r for r in results if r.verdict == "diverges"), None)
    verdict = "diverges" if first else "error" if any(r.verdict == "error" for r in results) else "conforms"
    diffs = [r.max_logprob_diff for r in results if r.max_logprob_diff is not None]
    return ConformanceReport(verdict, first.first_divergent_layer if first else None,
                             first.first_divergent_position if first else None, results, endpoint=endpoint,
                             model=model_id, max_logprob_diff=max(diffs) if diffs else None)


__all__ = ["ConformanceReport", "DEFAULT_TOLERANCE", "PromptResult", "compare_reply", "conformance"]
