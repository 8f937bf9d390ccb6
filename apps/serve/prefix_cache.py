"""Exact prefix reuse across requests: the model state at the end of recent conversations, least
recently used out, within a memory budget.

A `Conversation` is a live `Session` (its state covers every token it holds but the last sampled one)
plus the trace it is recorded into. A new request continues the conversation whose tokens are the
longest prefix of the request's tokens, so turn N prefills only what is new. "Prefix" is exact:
equal token ids AND the same picture at every image position, since two different pictures of the
same size have identical media ids (a state keyed by ids alone would answer about the wrong image).
A request that matches no conversation starts a fresh one (and a fresh trace). A conversation
belongs to its `owner` (the API key a request was sent with and OpenAI's `user` field, hashed): a
request only ever continues a conversation of the same owner, so a client that sends another
user's history plus its own turn is served from a fresh state into a fresh trace, never theirs.

`ReplyMemory` keeps the exact token ids of every reply this server generated, keyed by what came
before it, the text the client received and its owner (the response only: the tags and the thinking are not in
it, and it may be empty): when the client sends that reply back in its next turn, the request is
rendered with the ids the model produced (the K3 format's think/response tags and all), not a
re-encoding of the text, so it extends the cached state token for token.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.session import Session
from engine.session.transcript import RenderedChat


def state_bytes(session: Session) -> int:
    """Bytes the session's model state holds (allocated cache capacity included)."""
    total = 0
    for layer in session.state.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _images_of(session: Session) -> list[tuple[int, int, str]]:
    return [(int(s.image["token_start"]), int(s.image["token_end"]), str(s.image["sha256"]))
            for s in session.segments if s.image is not None]


@dataclass
class Conversation:
    """One client conversation: its session (the cached state) and its trace (None when not recording)."""

    id: str
    session: Session
    trace: Any = None  # workbench.ConversationTrace
    owner: str = ""  # who may continue it (see the module docstring)
    turns: int = 0
    nbytes: int = 0
    images: list[tuple[int, int, str]] = field(default_factory=list)
    captures: Any = None  # apps.serve.captures.CaptureStore: the routes / selections requests asked for

    def matches(self, chat: RenderedChat) -> bool:
        """Whether every token of this conversation is an exact prefix of `chat` (ids and pictures)."""
        n = len(self.session.tokens)
        if n == 0 or n > len(chat.ids) or self.session.tokens != chat.ids[:n]:
            return False
        mine = [im for im in self.images if im[0] < n]
        theirs = [im for im in chat.images if im[0] < n]
        return mine == theirs and all(end <= n for _, end, _ in theirs)

    def refresh(self) -> None:
        self.nbytes = state_bytes(self.session)
        self.images = _images_of(self.session)


class PrefixCache:
    """Conversations by recency; `budget_bytes` bounds the states they hold together and `max_items`
    their number (each open conversation also holds an open trace: files and a writer thread)."""

    def __init__(self, budget_bytes: int, max_items: int = 64) -> None:
        self.budget_bytes = budget_bytes
        self.max_items = max_items
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._items.values())

    def take(self, chat: RenderedChat, owner: str = "") -> Conversation | None:
        """Remove and return `owner`'s conversation with the longest exact prefix of `chat`, if any."""
        mine = (c for c in self._items.values() if c.owner == owner and c.matches(chat))
        best = max(mine, key=lambda c: len(c.session.tokens), default=None)
        if best is not None:
            del self._items[best.id]
        return best

    def put(self, conv: Conversation) -> list[Conversation]:
        """Keep `conv` as the most recent; returns the conversations evicted to stay within the budget
        (the caller closes their traces). A conversation larger than the whole budget is not kept."""
        conv.refresh()
        self._items[conv.id] = conv
        self._items.move_to_end(conv.id)
        evicted = []
        while self._items and (self.nbytes > self.budget_bytes or len(self._items) > self.max_items):
            _, old = self._items.popitem(last=False)
            evicted.append(old)
        return evicted

    def drain(self) -> list[Conversation]:
        out = list(self._items.values())
        self._items.clear()
        return out


def _key(prefix: list[int], text: str, owner: str) -> bytes:
    h = hashlib.sha256()
    h.update(owner.encode("utf-8", "surrogatepass") + b"\0")
    h.update(len(prefix).to_bytes(8, "little"))
    h.update(np.asarray(prefix, dtype=np.int64).tobytes())
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()


class ReplyMemory:
    """Exact ids of replies this server generated (bounded by count, oldest out; ids are small
    beside model states, so it outlives the states it lets later turns reuse)."""

    def __init__(self, max_replies: int = 4096) -> None:
        self.max_replies = max_replies
        self._items: OrderedDict[bytes, list[int]] = OrderedDict()

    def remember(self, prefix: list[int], text: str, ids: list[int], owner: str = "") -> None:
        key = _key(prefix, text, owner)
        self._items[key] = list(ids)
        self._items.move_to_end(key)
        while len(self._items) > self.max_replies:
            self._items.popitem(last=False)

    def lookup(self, prefix: list[int], text: str, owner: str = "") -> list[int] | None:
        return self._items.get(_key(prefix, text, owner))
