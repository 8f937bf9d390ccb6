"""A templated question (`workbench.task_templates.TaskPrompt`) asked in two steps, for drive mode.

`workbench.task_templates.ask` appends the context and generates the answer in one call. Drive mode
must keep its what-if branch points (`what_if.keep_branch_points`) after the context is in and before
the assistant turn opens, so it asks in the same layout in two steps: `append_context` (the system
line, the documents, the question; a picture question's pictures in the question's user message),
then `answer` (the assistant turn opened with the prefilled response start, generated up to the
response's `<|close|>`). Only the sampling differs from `ask`: the runner's temperature is used (the
model card's default is greedy), so what the page says it runs is what runs.
"""

from __future__ import annotations

from typing import Any, Sequence

from engine.errors import InputError


def append_context(session: Any, task: Any, images: Sequence[tuple[str, bytes]] = ()) -> None:
    """Append the system line, the task's documents and its question (with `images`, (name, bytes), in
    the question's message for a picture question). InputError for a picture question without a picture
    or a model without tokenizer files, before anything is appended."""
    if session.tokenizer is None:
        raise InputError("a templated question needs a model with tokenizer files")
    if task.task == "picture" and not images:
        raise InputError("a picture question needs a picture: upload one or press 'Use a sample picture'")
    session.append(task.system, role="system", name="system")
    for name, text in task.documents:
        session.append(text, name=name)
    if task.task == "picture":
        session.append_message("user", task.question, images=[p for _, p in images],
                               image_names=[n for n, _ in images], name="question")
    else:
        session.append(task.question, role="user", name="question")


def answer(session: Any, task: Any, max_new_tokens: int, temperature: float) -> Any:
    """Open the assistant turn with the task's prefilled response start and generate up to the response's
    end; returns a `workbench.task_templates.TaskAnswer` (its value judged against `task.expected`)."""
    from workbench.retrieval_text import response_value
    from workbench.task_templates import TaskAnswer

    tokenizer = session.tokenizer
    session.append(ids=tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(task.prefix),
                   name="answer prefix", kind="turn", role="assistant")
    pieces: list[str] = []
    first = len(session.tokens)
    for i, token in enumerate(session.generate(max_new_tokens=max_new_tokens, temperature=temperature,
                                               add_generation_prompt=False, stop_ids=(tokenizer.close_id,))):
        if i == 0:
            first = token.position
        pieces.append(token.text)
    generated = "".join(pieces)
    closed = "<|close|>" in generated
    text = task.prefix + generated.split("<|close|>", 1)[0]
    value = response_value(text, task.style) or None
    correct = None if task.expected is None else bool(closed and value == task.expected)
    return TaskAnswer(text, value, correct, len(pieces), first, closed)
