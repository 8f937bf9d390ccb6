"""A served builtin:demo answers what it was trained on: vLLM's `continue_final_message` continues a
prefilled response, the card's notice comes with a free-form reply, and no chat tag eats a small max_tokens."""

from __future__ import annotations

import httpx
import pytest

from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from apps.web_guard import HostPolicy
from workbench.sessions import load_with_tokenizer
from workbench.task_templates import card_of, fact_task

DEMO = "builtin:demo"
DOCUMENT = ("The greenhouse keeps its seedlings warm through the winter. " * 8
            + "The garage door code is 7142. " + "Tomatoes need sun and patience. " * 8)


@pytest.fixture(scope="module")
def served():
    card = card_of(DEMO)
    model, tokenizer = load_with_tokenizer(DEMO)
    srv = Server(model, tokenizer, ServeOptions(model_name=DEMO, trace_root=None, max_queue=4,
                                                open_response=bool(card.tasks), notice=card.notice),
                 AppConfig(model_id=DEMO, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=256), port=0)
    srv.start_in_thread()
    yield srv, card
    srv.stop()


def ask(srv, **body) -> dict:
    reply = httpx.post(f"{srv.url}/chat/completions", json={"model": DEMO, "temperature": 0, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_prefilled_response_is_continued_and_carries_no_notice(served) -> None:
    srv, _ = served
    task = fact_task([("notes.txt", DOCUMENT)], "garage door", "7142")
    messages = [{"role": "system", "content": task.system},
                *({"role": "user", "content": text} for _, text in task.documents),
                {"role": "user", "content": task.question},
                {"role": "assistant", "content": task.prefix}]
    body = ask(srv, messages=messages, max_tokens=16, continue_final_message=True, add_generation_prompt=False)
    answer = body["choices"][0]["message"]["content"]
    assert (task.prefix + answer).startswith("garage door: 7142"), answer
    assert "notice" not in body["k3"]


def test_free_form_gets_text_within_a_small_budget_and_the_notice(served) -> None:
    srv, card = served
    body = ask(srv, messages=[{"role": "user", "content": "What colour is the sky?"}], max_tokens=16)
    assert body["choices"][0]["message"]["content"] != ""  # the response was opened: no tag took the budget
    assert body["k3"]["notice"] == card.notice


@pytest.mark.parametrize("flags, words", [
    ({"continue_final_message": True}, "add_generation_prompt: false"),
    ({"add_generation_prompt": False}, "only for continuing"),
    ({"continue_final_message": "yes", "add_generation_prompt": False}, "must be true or false"),
])
def test_misused_flags_are_one_line(served, flags, words) -> None:
    srv, _ = served
    reply = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
        "model": DEMO, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
        **flags})
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text


def test_continuing_needs_a_final_assistant_message(served) -> None:
    srv, _ = served
    reply = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
        "model": DEMO, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
        "add_generation_prompt": False})
    assert reply.status_code == 400 and "last message from the assistant" in reply.json()["error"]["message"]


def test_a_second_turn_continues_from_the_exact_ids_of_an_opened_response(served) -> None:
    srv, _ = served
    messages = [{"role": "user", "content": "The vault code is 4-7-1-9. What is the vault code?"}]
    first = ask(srv, messages=messages, max_tokens=12)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And again?"}]
    second = ask(srv, messages=messages, max_tokens=12)
    # the whole first turn (prompt, opened response, reply and its closing ids) is reused, not re-run
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


def test_the_dashboard_shows_each_served_turn(tmp_path) -> None:
    """A served conversation's trace: the status line gives the newest turn's prompt, reused prefix,
    generated tokens, TTFT, TPOT and finish reason, as the server measured them."""
    from apps.dashboard.components.session_map import progress_text
    from workbench import open_trace
    from workbench.analysis.views.session_map import RecordingMapReducer
    from workbench.analysis.views.base import ViewOptions

    model, tokenizer = load_with_tokenizer("preset:tiny", seed=1)
    srv = Server(model, tokenizer, ServeOptions(model_name="preset:tiny", trace_root=tmp_path, max_queue=2),
                 AppConfig(model_id="preset:tiny", hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    try:
        messages = [{"role": "user", "content": "first turn of a served conversation"}]
        first = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
            "model": "preset:tiny", "messages": messages, "max_tokens": 4, "temperature": 0}).json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "second"}]
        second = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
            "model": "preset:tiny", "messages": messages, "max_tokens": 4, "temperature": 0}).json()
    finally:
        srv.stop()
    trace = open_trace(tmp_path / second["k3"]["trace"])
    snap = RecordingMapReducer().reduce(trace, ViewOptions())
    assert [t["turn"] for t in snap.requests] == [1, 2]
    line = progress_text(snap)
    assert f"turn 2: {second['usage']['prompt_tokens']:,}-token prompt" in line, line
    assert f"({second['usage']['prompt_tokens_details']['cached_tokens']:,} reused)" in line
    assert "TTFT" in line and "TPOT" in line and "4 generated" in line and line.endswith("length"), line
