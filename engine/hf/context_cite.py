"""ContextCite on `K3ForCausalLM`: our sentence splitter and the K3 prompt layout.

ContextCite (`context_cite.ContextCiter`) splits the context with nltk's punkt model, which it tries
to download on import; CI has no network. `SentencePartitioner` implements ContextCite's partitioner
interface (`BaseContextPartitioner`) with a small splitter of our own (a sentence ends at `.`, `!`
or `?` followed by white space, or at a line break), keeping the separators so that any ablation
mask rebuilds the context exactly.

ContextCite lays its prompt out as one user message (`prompt_template` in a chat template). A K3
task often has another shape (the trained demo: a system message, the documents as plain text, the
question as a user message, and the response opened with a prefix). `K3ContextCiter` takes that
layout as a function of the (ablated) context text, `k3_layout(...)` builds it, and the prompt text
ContextCite re-tokenizes is checked to give the same ids.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import numpy as np
from context_cite import ContextCiter
from context_cite.context_partitioner import BaseContextPartitioner

from engine.errors import InputError
from engine.tokenizer import Message, Tokenizer

# a sentence ends at . ! ? (and any closing quotes or brackets) before white space, or at a line break
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n+")

Layout = Callable[[str], Sequence[int]]


class SentencePartitioner(BaseContextPartitioner):
    """ContextCite's partitioner interface: sentences (see the module doc) and their separators, no nltk."""

    def __init__(self, context: str) -> None:
        if not isinstance(context, str):
            raise InputError(f"the context must be text, got {type(context).__name__}")
        super().__init__(context)
        self.parts: list[str] = []
        self.separators: list[str] = []
        self.starts: list[int] = []  # each source's first character in `context`
        self.split_context()

    def split_context(self) -> None:
        self.parts, self.separators, self.starts = [], [], []
        at = 0
        for m in _SENTENCE_END.finditer(self.context):
            self._add(at, m.start() + len(m.group(0).rstrip()))
            at = m.end()
        self._add(at, len(self.context))

    def _add(self, start: int, end: int) -> None:
        piece = self.context[start:end]
        if not piece.strip():
            return
        first = start + len(piece) - len(piece.lstrip())
        previous_end = self.starts[-1] + len(self.parts[-1]) if self.parts else 0
        self.separators.append(self.context[previous_end:first])
        self.parts.append(self.context[first:end])
        self.starts.append(first)

    @property
    def num_sources(self) -> int:
        return len(self.parts)

    def get_source(self, index: int) -> str:
        return self.parts[index]

    def get_context(self, mask: np.ndarray | None = None) -> str:
        """The context with the sources `mask` drops left out (their separators too, except the first kept one's)."""
        if mask is None:
            mask = np.ones(self.num_sources, dtype=bool)
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (self.num_sources,):
            raise InputError(f"an ablation mask needs {self.num_sources} entries, got shape {mask.shape}")
        out: list[str] = []
        for keep, sep, part in zip(mask, self.separators, self.parts):
            if keep:
                out.append(sep + part if out else part)
        return "".join(out)


def k3_layout(tokenizer: Tokenizer, *, question: str, system: str | None = None,
              response_prefix: str | None = None) -> Layout:
    """The K3 prompt around a context, as a `Session` lays it out: an optional system message, the
    context as plain text, the question as a user message, the assistant turn opened (and with
    `response_prefix`, its think section closed and the response started with that text)."""
    head = tokenizer.chat_prompt([Message("system", system)], add_generation_prompt=False) if system else []
    tail = tokenizer.chat_prompt([Message("user", question)], add_generation_prompt=True)
    if response_prefix is not None:
        tail = tail + tokenizer.response_prefix(response_prefix)

    def layout(context: str) -> list[int]:
        return head + tokenizer.encode(context) + tail

    return layout


class K3ContextCiter(ContextCiter):
    """`ContextCiter` whose prompt is `layout(context)` (default: ContextCite's own chat-template prompt).

    Args:
        layout: ids of the whole prompt for a context text (`k3_layout`); the prompt text ContextCite
            re-tokenizes (the tokenizer's decode of those ids) must encode back to them (InputError).
        Other arguments as `ContextCiter`; `partitioner` defaults to `SentencePartitioner(context)`.
    """

    def __init__(self, model: Any, tokenizer: Any, context: str, query: str, *, layout: Layout | None = None,
                 partitioner: BaseContextPartitioner | None = None, **kwargs: Any) -> None:
        super().__init__(model, tokenizer, context, query,
                         partitioner=partitioner if partitioner is not None else SentencePartitioner(context), **kwargs)
        self.layout = layout

    def _get_prompt_ids(self, mask: np.ndarray | None = None, return_prompt: bool = False):
        if self.layout is None:
            return super()._get_prompt_ids(mask, return_prompt)
        ids = list(self.layout(self.partitioner.get_context(mask)))
        prompt = self.tokenizer.decode(ids)
        if return_prompt:
            again = self.tokenizer.encode(prompt, add_special_tokens=False)
            if again != ids:
                raise InputError("the layout's prompt does not re-tokenize to its own ids (ContextCite reads the "
                                 "prompt back as text): build the layout from text pieces that meet at special tokens")
            return ids, prompt
        return ids
