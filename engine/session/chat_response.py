"""Reading a generated answer through the chat format (spec section 9): what to show, and where it ends.

After the generation prompt the model is inside `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`;
a K3 answer closes `think`, opens `response`, writes the answer, closes `response` and the message and
ends with `<|end_of_msg|>`. None of those tags is the model's end-of-message stop id until the very
last one, so a caller that only stops on it prints the scaffolding and keeps generating past the
answer. `ResponseReader` follows the tags token by token:

    reader = None
    for token in session.generate(params=params):
        # the context as generation began: generate() may open the assistant turn first
        reader = reader or ResponseReader.after(tokenizer, session.tokens[:token.position], stop_strings=["\\n\\n"])
        print(reader.feed(token.id), end="")
        if reader.done:
            break
    print(reader.finish())

Text is shown inside the `response` section, and outside every section (a plain-text continuation);
thinking and the tags themselves are not (`take_thinking` hands the thinking text over separately).
The answer is done at the `<|close|>` that ends the response, at `<|end_of_msg|>`, or when the shown
text reaches one of `stop_strings` (the stop string and what follows it are not shown).
"""

from __future__ import annotations

import codecs
from typing import Sequence

from engine.errors import InputError
from engine.tokenizer import Tokenizer

RESPONSE = "response"
THINK = "think"
# tokens looked back through for the sections a context leaves open: the current turn's tags lie
# after the previous message's `<|end_of_msg|>`, and a generation prompt is a dozen tokens
_LOOKBACK = 1 << 16
_MAX_TAG_TOKENS = 64  # a tag name longer than this is not a tag the format writes


class ResponseReader:
    """Follows generated token ids through the chat tags; `feed` returns the text to show."""

    def __init__(self, tokenizer: Tokenizer, *, sections: Sequence[str] = (),
                 stop_strings: Sequence[str] = ()) -> None:
        """Args:
            tokenizer: the model's tokenizer (its control ids name the tags).
            sections: the sections open when generation starts, outermost first (`after` finds them).
            stop_strings: the answer also ends where its shown text first contains one of these.
        """
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise InputError(f"stop strings must be non-empty text, got {list(stop_strings)!r:.80}")
        self.tokenizer = tokenizer
        self.sections = list(sections)
        self.stop_strings = tuple(stop_strings)
        self.done = False
        self.saw_response = RESPONSE in self.sections
        self.hidden_tokens = 0  # generated tokens not shown (tags, thinking): tells a caller why nothing printed
        self._tag: list[int] | None = None  # ids of a tag name being read (after `<|open|>` / `<|close|>`)
        self._tag_opens = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # shown text not yet returned: it may be the start of a stop string
        self._thought_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._thought = ""  # text written inside `think`, not yet taken by `take_thinking`
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1

    @classmethod
    def after(cls, tokenizer: Tokenizer, context: Sequence[int], *, stop_strings: Sequence[str] = ()) -> "ResponseReader":
        """A reader for what follows `context` (token ids, the generation prompt included): the sections
        its last turn leaves open."""
        start = max(0, len(context) - _LOOKBACK)
        end_of_msg = tokenizer.end_of_msg_id
        for i in range(len(context) - 1, start - 1, -1):
            if context[i] == end_of_msg:
                start = i + 1
                break
        probe = cls(tokenizer)
        for token in context[start:]:
            probe._follow(int(token))
        return cls(tokenizer, sections=probe.sections, stop_strings=stop_strings)

    @property
    def showing(self) -> bool:
        """Whether text generated now is shown: inside `response`, or outside every section."""
        return not self.sections or self.sections[-1] == RESPONSE

    def feed(self, token_id: int) -> str:
        """The text `token_id` adds to the answer (may be empty); sets `done` when the answer ended."""
        if self.done:
            return ""
        was_showing = self.showing and self._tag is None
        was_thinking = bool(self.sections) and self.sections[-1] == THINK and self._tag is None
        ends = self._follow(token_id)
        if ends:
            self.done = True
            return self._release(final=True)
        plain = self._tag is None and token_id not in self.tokenizer.special_ids
        if not (was_showing and plain):
            self.hidden_tokens += 1
            if was_thinking and plain:
                self._thought += self._thought_decoder.decode(self._bytes(token_id))
            return ""
        self._held += self._decoder.decode(self._bytes(token_id))
        return self._release(final=False)

    def take_thinking(self, final: bool = False) -> str:
        """The text written inside `think` since the last call (not shown by `feed`; `final` also
        releases a partial character held back)."""
        if final:
            self._thought += self._thought_decoder.decode(b"", final=True)
        out, self._thought = self._thought, ""
        return out

    def finish(self) -> str:
        """The text still held back (a partial character, a possible stop-string start)."""
        if self.done and not self._held:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if final:
            self._held += self._decoder.decode(b"", final=True)
        for stop in self.stop_strings:
            at = self._held.find(stop)
            if at >= 0:
                self.done = True
                out, self._held = self._held[:at], ""
                return out
        keep = 0 if final else self._hold
        cut = max(0, len(self._held) - keep)
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def _bytes(self, token_id: int) -> bytes:
        try:
            return self.tokenizer.encoding.decode_single_token_bytes(token_id)
        except KeyError:  # an id past the tokenizer's vocabulary (a model larger than its tokenizer)
            return b""

    def _follow(self, token_id: int) -> bool:
        """Advance the tag state by one id; True when it ends the answer."""
        tok = self.tokenizer
        if token_id == tok.end_of_msg_id:
            return True
        if token_id in (tok.open_id, tok.close_id):
            if token_id == tok.close_id and self.sections and self.sections[-1] == RESPONSE:
                return True  # a close can only end the innermost section: the response is over
            self._tag, self._tag_opens = [], token_id == tok.open_id
            return False
        if self._tag is None:
            return False
        if token_id != tok.sep_id:
            self._tag.append(token_id)
            if len(self._tag) > _MAX_TAG_TOKENS:
                self._tag = None  # not a tag after all: the text goes on hidden or shown as before
            return False
        words = tok.decode(self._tag).split()
        name = words[0] if words else ""
        self._tag = None
        if self._tag_opens:
            self.sections.append(name)
            self.saw_response = self.saw_response or name == RESPONSE
        elif name in self.sections:
            del self.sections[len(self.sections) - 1 - self.sections[::-1].index(name):]
        return False
