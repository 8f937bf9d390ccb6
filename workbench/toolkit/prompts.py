"""Clean and corrupted prompts for patching: the same find-the-fact question with the fact's value changed."""

from __future__ import annotations

from typing import Any

from engine.errors import InputError
from engine.session import Session
from workbench.task_templates import fact_task
from workbench.text import haystack


def fact_prompts(model: Any, tokenizer: Any, n_tokens: int, *, key: str = "greenhouse alarm",
                 clean: str = "3-8-2-5", corrupted: str = "7-1-4-6", depth: float = 0.5,
                 seed: int = 0) -> tuple[list[int], list[int], list[int]]:
    """(clean prompt ids, corrupted prompt ids, clean answer ids): a filler document of about `n_tokens`
    tokens holding the fact once (no restatement) at `depth`, the trained question and the response
    opened with its prefilled start; the answer is the clean value. InputError when the two values do
    not tokenize to the same length."""
    if tokenizer is None:
        raise InputError("fact prompts need a model with tokenizer files")
    doc = haystack(n_tokens, tokenizer, seed=seed)
    prompts = []
    for value in (clean, corrupted):
        task = fact_task([("report.txt", doc)], key, value, depth=depth, restate=False)
        scratch = Session(model, tokenizer)
        scratch.append(task.system, role="system", name="system")
        for name, text in task.documents:
            scratch.append(text, name=name)
        scratch.append(task.question, role="user", name="question")
        opened = tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(task.prefix)
        scratch.append(ids=opened, name="answer prefix")
        prompts.append(list(scratch.tokens))
    if len(prompts[0]) != len(prompts[1]):
        raise InputError(f"the values {clean!r} and {corrupted!r} tokenize to different lengths: pick values of "
                         "the same shape")
    return prompts[0], prompts[1], tokenizer.encode(clean)


__all__ = ["fact_prompts"]
