"""What the engine thread tells a request's HTTP handler, as typed events (never tuples read by index).

The worker emits, in order: `Started` once the prompt is rendered and its conversation found, then
`TextDelta` / `ReasoningDelta` / `TokenLogprob` as the answer is read, and `Finished` with the reply and
its figures; or `Failed` at any point (an HTTP status and a one-line message). The HTTP side
(`apps.serve.app`) and the telemetry (`apps.serve.telemetry`) match on the classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.sessions import AnswerText, AnswerThinking


@dataclass(frozen=True)
class Started:
    """The request's prompt is rendered and its conversation chosen (`cached_tokens` of it reused)."""

    prompt_tokens: int
    cached_tokens: int
    conversation: str


# the run core's answer events, as the engine thread hands them on (one definition: `workbench.sessions`)
TextDelta = AnswerText            # a piece of the reply's shown text
ReasoningDelta = AnswerThinking   # a piece of what the model wrote inside `think` (`reasoning_content`)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probabilities, the OpenAI way (`apps.serve.protocol.token_logprob`)."""

    entry: dict[str, Any]


@dataclass(frozen=True)
class Finished:
    """The reply, whole, and what the server measured of it.

    Attributes:
        finish_reason: stop, length, cancelled or shutdown (the last two never reach a client as a reply).
        ids / closing: the generated ids and those that close the message they left open.
        trace: the conversation's trace directory name (None when not recording).
        notice: the model card's notice for a free-form reply ("" when none).
    """

    content: str
    reasoning: str
    ids: list[int]
    closing: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    conversation: str
    turn: int
    ttft_s: float | None = None
    trace: str | None = None
    notice: str = ""
    logprobs: list[dict] | None = field(default=None, repr=False)
    # what the request asked for besides the reply: vLLM's / SGLang's capture and token-id fields, as
    # (response-level, choice-level) dicts (`apps.serve.captures.response_fields`)
    fields: tuple[dict[str, Any], dict[str, Any]] = field(default=({}, {}), repr=False)


@dataclass(frozen=True)
class Failed:
    """The request failed or was refused: an HTTP `status`, one line, and the parameter at fault."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None  # OpenAI's error `code` (e.g. "non_finite_output")
    where: dict[str, Any] | None = None  # where the model's computation failed (`error.k3` of the body)


Event = Started | TextDelta | ReasoningDelta | TokenLogprob | Finished | Failed

__all__ = ["Event", "Failed", "Finished", "ReasoningDelta", "Started", "TextDelta", "TokenLogprob"]
