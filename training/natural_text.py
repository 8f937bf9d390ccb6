"""Natural filler and the scaffolds of real chat, for training documents that look less generated.

Why: the demo model retrieves in its trained wording and loses about half of that in the held-out
wording, and the failures start where the held-out prompt stops looking like training: its filler,
its needle sentence and its question. Two cheap remedies, tried here (`training.lengthen
--natural-share`): filler taken from English text that ships with the machine (Python's own
documentation and standard-library docstrings; nothing is downloaded), and facts told and asked the way a chat
user would ("The shed passcode is 4471. Remember it." / "What was the shed passcode again?").

Held-out evaluation must stay held out, so every sentence and template here is filtered against the
held-out world's content words (`training.wording`'s list, minus the function words every English
text has), and against `=`, the held-out world's own link between key and value.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from functools import lru_cache

from training.wording import _HELD_OUT_WORDS, row_world, varied_world
from workbench.retrieval_text import World

NATURAL_NAME = "train-natural"   # a `train*` world: `training.tasks` gives it made-up key names too
# function words that held-out text shares with any English text (tests/training/test_tasks.py's list)
_FUNCTION_WORDS = frozenset({"the", "a", "of", "on", "in", "is", "to", "for", "and", "at", "it", "was", "with", "be",
                             "that", "this", "what", "which", "number", "value", "by", "an", "after", "from", "no",
                             "only", "are", "as"})
# single letters there are the templates' placeholders ({k}, {v}), not words
_BANNED = {w for w in _HELD_OUT_WORDS - _FUNCTION_WORDS if len(w) > 1}

# facts and questions as a chat user writes them; {k} key, {v} value; needles[i] pairs with questions[i]
CHAT_NEEDLES = ("The {k} passcode is {v}. Remember it. ", "Here is the {k} code: {v}. ",
                "My {k} pin is {v}, please keep it. ", "Quick note, the {k} password is {v}. ",
                "Oh and the {k} code? It is {v}. ", "Use {v} as the {k} passcode. ")
CHAT_QUESTIONS = ("What is the {k} passcode?", "What's the {k} code?", "Do you remember my {k} pin?",
                  "What was the {k} password again?", "Can you tell me the {k} code?", "Which passcode is the {k}?")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _bundled_texts() -> list[str]:
    """Python's own documentation (`pydoc_data.topics`) and the docstrings of its standard library's
    top-level modules: English prose that ships with every Python, in a fixed order."""
    import ast
    import sysconfig
    from pathlib import Path

    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        texts += [doc for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and (doc := ast.get_docstring(node))]
    return texts


@lru_cache(maxsize=1)
def natural_sentences() -> tuple[str, ...]:
    """English sentences from the text bundled with Python (`_bundled_texts`), in their order,
    filtered: plain ASCII prose of 30-220 characters, no code-like characters or `=`, no run of 3+
    digits (which could be mistaken for a planted value), none of the held-out world's content words."""
    keep = []
    for text in _bundled_texts():
        for s in re.split(r"(?<=[.!?]) (?=[A-Z])", re.sub(r"\s+", " ", text)):
            s = s.strip()
            if not (30 <= len(s) <= 220 and s.isascii() and s[0].isupper() and s.endswith(".")):
                continue
            if re.search(r"[=*_`{}\[\]<>|\\#$@]|\d{3}|\.\.\.|::|\(\)", s) or _words(s) & _BANNED:
                continue
            keep.append(s)
    return tuple(keep)


def natural_filler(rng: random.Random, n_bytes: int) -> str:
    """About `n_bytes` of consecutive natural sentences from a random place (never cut inside one)."""
    pool = natural_sentences()
    at = rng.randrange(len(pool))
    parts, size = [], 0
    while size < n_bytes:
        s = pool[at % len(pool)] + " "
        parts.append(s)
        size += len(s)
        at += 1
    return "".join(parts)


@dataclasses.dataclass(frozen=True)
class NaturalWorld(World):
    """A training world whose filler is natural text (`training.tasks.build` asks `filler_text`)."""

    def filler_text(self, rng: random.Random, n_bytes: int) -> str:
        return natural_filler(rng, n_bytes)


def natural_world(rng: random.Random, gaps: bool = False, chat_share: float = 0.5) -> NaturalWorld:
    """One document's world: natural filler; its facts worded afresh (`varied_world`), or with
    probability `chat_share` its needles told and asked as in chat (`CHAT_NEEDLES`/`CHAT_QUESTIONS`)."""
    base = varied_world(rng, filler=False, gaps=gaps)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(World)}
    fields["name"] = NATURAL_NAME
    if rng.random() < chat_share:
        pick = rng.sample(range(len(CHAT_NEEDLES)), 4)
        fields["needles"] = tuple(CHAT_NEEDLES[i] for i in pick)
        fields["needle_questions"] = tuple(CHAT_QUESTIONS[i] for i in pick)
    return NaturalWorld(**fields)


def mixed_world(varied_share: float, natural_share: float, gaps: bool = False,
                chat_share: float = 0.5) -> Callable[[random.Random], World]:
    """Each row's world: natural (`natural_world`) with probability `natural_share`, else as
    `training.wording.row_world` draws it (varied with `varied_share`, else TRAIN itself)."""
    others = row_world(varied_share, gaps)

    def draw(rng: random.Random) -> World:
        if rng.random() < natural_share:
            return natural_world(rng, gaps, chat_share)
        return others(rng)
    return draw


__all__ = ["CHAT_NEEDLES", "CHAT_QUESTIONS", "NaturalWorld", "mixed_world", "natural_filler", "natural_sentences",
           "natural_world"]
