"""One answer loop: generate until the chat response ends (every front door calls it).

`generate_answer(session, ...)` streams `Session.generate` through a `ResponseReader`
(`engine.session.chat_response`): it stops where the chat format says the response ends (its
`<|close|>`, `<|end_of_msg|>`), at a stop string, on a stop id, at the budget, or when the caller's
`keep_going` says no; hands the shown text and the thinking to callbacks as they come; and returns an
`Answer` with the finish reason and the ids that close what the answer left open (so the context can
go on as a complete message). `read_answer` reads ids generated elsewhere (a rerun's branch) the same
way, so an answer's text never depends on which door produced it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from engine.errors import InputError
from engine.session.chat_response import RESPONSE, ResponseReader
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.session.sampling import SamplingParams
    from engine.session.session import GeneratedToken, Session

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class Answer:
    """What one `generate_answer` produced.

    Attributes:
        text: the response text shown (inside `response`, or outside every section for a plain-text
            continuation); a stop string and what follows it are not part of it.
        thinking: the text written inside `think`.
        ids: every generated token id, in order (the stop token included).
        first_position: the context position of the first generated token (None when none was).
        finish_reason: `stop` (the response ended, a stop string or a stop id), `length` (the budget or
            the context limit), `cancelled` (`keep_going` said no; that token is in `ids`).
        closing_ids: ids that close the sections and the message the answer left open (empty when it
            ended its message); appending them makes the context a complete assistant message.
        hidden_tokens: generated tokens not shown (chat tags, thinking).
        ttft_s: seconds from the call to the first token (the prefill of pending context included).
        responded: the model opened (or was inside) the `response` section.
    """

    text: str = ""
    thinking: str = ""
    ids: list[int] = field(default_factory=list)
    first_position: int | None = None
    finish_reason: FinishReason = "length"
    closing_ids: list[int] = field(default_factory=list)
    hidden_tokens: int = 0
    ttft_s: float | None = None
    responded: bool = False

    @property
    def generated(self) -> int:
        return len(self.ids)

    @property
    def closed(self) -> bool:
        """The response ended as the format requires (not cut by the budget or a cancel)."""
        return self.finish_reason == "stop"


def generate_answer(session: "Session", params: "SamplingParams | None" = None, *,
                    stop_strings: Sequence[str] = (), add_generation_prompt: bool | None = None,
                    on_text: Callable[[str], None] | None = None, on_thinking: Callable[[str], None] | None = None,
                    on_token: Callable[["GeneratedToken"], None] | None = None,
                    keep_going: Callable[["GeneratedToken"], bool] | None = None,
                    **overrides) -> Answer:
    """Generate one answer in `session` and read it through the chat format.

    Args:
        params / overrides: sampling, as `Session.generate` takes them (`temperature=0`, `max_new_tokens=`).
        stop_strings: the answer also ends where its shown text first contains one of these.
        add_generation_prompt: as `Session.generate` (default: open the assistant turn after a user message).
        on_text / on_thinking: called with each new piece of shown text / thinking as it is read.
        on_token: called with every generated token first (raw streaming, timing).
        keep_going: called after `on_token`; False stops the answer as `cancelled`.

    A session without a tokenizer cannot read chat tags: its answer is every token's text (`length`
    or `stop` on a stop id), with no closing ids.
    """
    tokenizer = session.tokenizer
    if stop_strings and tokenizer is None:
        raise InputError("stop strings need a tokenizer (the answer's text is read through it)")
    answer = Answer()
    reader: ResponseReader | None = None
    started = time.perf_counter()
    stop_ids = set(overrides.get("stop_ids", params.stop_ids if params is not None else ()))
    eos = session.config.special_token_id("eos_token_id")  # looked up once, not per token
    if eos is not None:
        stop_ids.add(eos)

    def show(text: str, thinking: str) -> None:
        if thinking:
            answer.thinking += thinking
            if on_thinking is not None:
                on_thinking(thinking)
        if text:
            answer.text += text
            if on_text is not None:
                on_text(text)

    for token in session.generate(params=params, add_generation_prompt=add_generation_prompt, **overrides):
        if answer.first_position is None:
            answer.first_position, answer.ttft_s = token.position, time.perf_counter() - started
            if tokenizer is not None:  # only now: generate() may have opened the assistant turn first
                reader = ResponseReader.after(tokenizer, session.tokens[:token.position], stop_strings=stop_strings)
        answer.ids.append(token.id)
        if on_token is not None:
            on_token(token)
        if keep_going is not None and not keep_going(token):
            answer.finish_reason = "cancelled"
            break
        if reader is None:
            show(token.text, "")
            if token.id in stop_ids:
                answer.finish_reason = "stop"
                break
            continue
        show(reader.feed(token.id), reader.take_thinking(final=reader.done))
        if reader.done or token.id in stop_ids:
            answer.finish_reason = "stop"
            break
    if reader is not None:
        if answer.finish_reason != "cancelled":
            show(reader.finish(), reader.take_thinking(final=True))
            answer.closing_ids = closing_ids(tokenizer, answer.ids, reader)
        answer.hidden_tokens = reader.hidden_tokens
        answer.responded = reader.saw_response
    return answer


def closing_ids(tokenizer: Tokenizer, ids: Sequence[int], reader: ResponseReader) -> list[int]:
    """The ids that close what a generated answer left open (its sections, then the assistant message), so
    the context holds a complete message: empty when the answer ended with `<|end_of_msg|>`."""
    if ids and ids[-1] == tokenizer.end_of_msg_id:
        return []
    out: list[int] = []
    sections = list(reader.sections)
    in_message = "message" in sections  # a plain-text continuation has no message to close
    if reader.done and ids and ids[-1] == tokenizer.close_id and sections[-1:] == [RESPONSE]:
        # the answer stopped on the `<|close|>` that ends the response: finish that tag
        out += tokenizer.encode(RESPONSE) + [tokenizer.sep_id]
        sections.pop()
    for name in reversed(sections):
        if name == "message":  # the message frame's own closing tag follows
            break
        out += tokenizer.section_tag(name, False)
    return out + (tokenizer.message_frame("assistant")[1] if in_message else [])


def read_answer(tokenizer: Tokenizer | None, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text `generate_answer` would have shown for `ids` generated after `context` (the response the
    chat tags delimit); without a tokenizer, the ids themselves."""
    if tokenizer is None:
        return " ".join(map(str, ids))
    reader = ResponseReader.after(tokenizer, context)
    parts = []
    for token in ids:
        parts.append(reader.feed(int(token)))
        if reader.done:
            break
    parts.append(reader.finish())
    return "".join(parts)
