"""`engine.session.answer`: the one answer loop every front door calls, on the trained demo model."""

from __future__ import annotations

from engine import load_model
from engine.session import Session
from engine.session.answer import generate_answer, read_answer
from engine.session.chat_response import ResponseReader
from workbench.task_templates import answer_task, append_task, fact_task

DOCUMENT = ("The greenhouse keeps its seedlings warm through the winter. " * 6
            + "The garage door code is 7142. " + "Tomatoes need sun and patience. " * 6)


def fresh_session(demo) -> Session:
    model, tokenizer = demo
    return Session(model, tokenizer, progress=False)


def test_a_templated_answer_reads_the_same_as_the_task_template(demo) -> None:
    task = fact_task([("notes.txt", DOCUMENT)], "garage door", "7142")
    templated = fresh_session(demo)
    append_task(templated, task)
    want = answer_task(templated, task, max_new_tokens=24)

    session = fresh_session(demo)
    append_task(session, task)
    tokenizer = session.tokenizer
    session.append(ids=tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(task.prefix),
                   name="answer prefix", kind="turn", role="assistant")
    shown: list[str] = []
    got = generate_answer(session, max_new_tokens=24, temperature=0, add_generation_prompt=False,
                          on_text=shown.append)
    assert task.prefix + got.text == want.text and got.closed == want.closed
    assert "".join(shown) == got.text and got.responded and got.first_position == want.first_position
    # the closing ids leave the context a complete assistant message: nothing is open after them
    after = session.tokens + got.closing_ids
    assert after[-1] == tokenizer.end_of_msg_id
    assert ResponseReader.after(tokenizer, after).sections == []
    assert read_answer(tokenizer, session.tokens[:got.first_position], got.ids) == got.text


def test_budget_cancel_and_stop_strings(demo) -> None:
    session = fresh_session(demo)
    session.append("Tell me about the greenhouse.", role="user", name="q")
    short = generate_answer(session, max_new_tokens=3, temperature=0)
    assert short.finish_reason == "length" and short.generated == 3 and short.ttft_s is not None

    session = fresh_session(demo)
    session.append("Tell me about the greenhouse.", role="user", name="q")
    seen: list[int] = []
    cancelled = generate_answer(session, max_new_tokens=10, temperature=0, on_token=lambda t: seen.append(t.id),
                                keep_going=lambda t: len(seen) < 2)
    assert cancelled.finish_reason == "cancelled" and cancelled.ids == seen and len(seen) == 2
    assert cancelled.closing_ids == []


def test_a_model_without_a_tokenizer_answers_token_by_token() -> None:
    model = load_model("preset:tiny", seed=0)
    session = Session(model, None, progress=False)
    session.append(ids=[1, 2, 3, 4])
    answer = generate_answer(session, max_new_tokens=4, temperature=0, stop_ids=())
    assert answer.generated == 4 and answer.finish_reason == "length" and answer.closing_ids == []
