"""The find-fact prompts the benchmarks ask the trained demo model, built in one place so their rows compare.

- `demo_prompt(model, tokenizer, tokens, style, depth=None)`: `workbench demo`'s context (the system
  turn and documents in the trained wording, the passcode's sentence where the demo plants it, ~40%
  into the second document, or at `depth` of the context's characters, at a sentence end), not
  prefilled; the needle's token span, the key, and `ask`, the continuation that asks for it (the
  trained question, then the answer prefix `key: `). bench_interventions and bench_attribution.
- `fact_prompt(tokenizer, tokens, depth, seed)`: one filler document holding one fact (`fact_task`, no
  restatement) at `depth`, for methods that take the prompt as text (bench_contextcite: ContextCite).
- `sweep(lengths, depths)`: the (length, depth) rows of a comma-separated sweep.

Run as `python benchmarks/NAME.py`, so this directory is on sys.path (`from prompts import ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from apps.cli.demo_cmd import PASSCODE, build_documents, wording
from engine.session import Session
from workbench.retrieval_text import answer_prefix
from workbench.task_templates import TaskPrompt, fact_task
from workbench.text import haystack

# bench_contextcite's fact (not the demo's passcode: a key and value the filler never holds)
FACT_KEY, FACT_VALUE = "greenhouse alarm", "3-8-2-5"


@dataclass
class DemoPrompt:
    """The demo's context in a session (not prefilled) and how to ask for the passcode after it.

    Attributes:
        session (Session): the system turn and the documents, appended, not prefilled.
        needle (tuple[int, int]): the passcode sentence's token span [start, end).
        key (str): what the question asks for ("hidden cellar").
        target (str): the expected answer, the demo's passcode.
        ask (Callable[[Session], None]): appends the question and the answer prefix to a branch.
    """

    session: Session
    needle: tuple[int, int]
    key: str
    target: str
    ask: Callable[[Session], None]


def _replant(docs: list[tuple[str, str]], needle_doc: int, needle: str, depth: float,
             ) -> tuple[list[tuple[str, str]], int, int]:
    """`docs` with the needle moved from its document to `depth` (0..1) of all their characters, at the
    next sentence end; (documents, the needle's document, its character offset there)."""
    docs = [(name, text.replace(needle, "", 1) if i == needle_doc else text) for i, (name, text) in enumerate(docs)]
    total = sum(len(text) for _, text in docs)
    want, doc, offset = depth * total, len(docs) - 1, 0
    for i, (_, text) in enumerate(docs):
        if want <= len(text):
            doc, offset = i, int(want)
            break
        want -= len(text)
    name, text = docs[doc]
    cut = text.find(". ", offset)
    at = cut + 2 if cut >= 0 else len(text)
    docs[doc] = (name, text[:at] + needle + text[at:])
    return docs, doc, at


def demo_prompt(model: Any, tokenizer: Any, tokens: int, style: Any, depth: float | None = None) -> DemoPrompt:
    """The demo's context of about `tokens` tokens, the needle where the demo puts it (`depth` None) or at
    `depth` of the context; `style`: the model's answer style (`workbench.retrieval_text.answer_style_of`)."""
    words = wording("train")
    docs, needle_doc, needle_at = build_documents(tokens, lambda t: len(tokenizer.encode(t)), words=words)
    if depth is not None:
        docs, needle_doc, needle_at = _replant(docs, needle_doc, words.needle, depth)
    session = Session(model, tokenizer, prefill_chunk=2048, progress=False)
    session.append(words.system, role="system", name="system")
    needle = (0, 0)
    for i, (name, text) in enumerate(docs):
        seg = session.append(text, name=name)
        if i == needle_doc:
            start = seg.start + len(tokenizer.encode(text[:needle_at]))
            needle = (start, start + len(tokenizer.encode(words.needle)))

    def ask(branch: Session) -> None:
        branch.append(words.question, role="user", name="question")
        branch.append(ids=tokenizer.chat_prompt([], add_generation_prompt=True)
                      + tokenizer.response_prefix(answer_prefix(style, words.key)), name="answer prefix", kind="turn",
                      role="assistant")

    return DemoPrompt(session, needle, words.key, PASSCODE, ask)


def fact_prompt(tokenizer: Any, tokens: int, depth: float, seed: int) -> TaskPrompt:
    """A filler document of about `tokens` tokens holding FACT_KEY's value once at `depth` (no restatement),
    with the trained system line, question and response prefix."""
    return fact_task([("report.txt", haystack(tokens, tokenizer, seed=seed))], FACT_KEY, FACT_VALUE, depth=depth,
                     restate=False)


def sweep(lengths: str, depths: str) -> list[tuple[int, float]]:
    """The (length, depth) rows of comma-separated `lengths` and `depths`, every length at every depth."""
    return [(int(n), float(d)) for n in lengths.split(",") if n for d in depths.split(",") if d]


__all__ = ["DemoPrompt", "FACT_KEY", "FACT_VALUE", "demo_prompt", "fact_prompt", "sweep"]
