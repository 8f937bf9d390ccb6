"""Issue 42 item 2: two end users of `workbench serve` never share a conversation or a trace.

The attack: a client sends another client's history plus a turn of its own. Keyed by the token
prefix alone, it was served from, and recorded into, the other's conversation (its text in their
trace); and a continuation with `"seed": -1` (accepted over HTTP, refused by the engine only after
the cache lookup) closed the other's trace as `failed`. Now a conversation belongs to the API key
and the `user` field it started with, and every field is checked in the engine's own ranges before
any cache or trace changes.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from apps.web_guard import HostPolicy
from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from workbench.sessions import load_with_tokenizer

MODEL = "preset:tiny"
SECRET = "Alice's account number is 55-1234."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model, tokenizer = load_with_tokenizer(MODEL, seed=1)
    root = tmp_path_factory.mktemp("owners")
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=root, max_queue=4),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20), port=0)
    srv.start_in_thread()
    srv.trace_root = root
    yield srv
    srv.stop()


def client(server: Server, key: str = "loopback-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def session_json(server: Server, conversation: str) -> dict:
    return json.loads((server.trace_root / conversation / "session.json").read_text())


def first_turn(server: Server, user: str | None, key: str = "loopback-key") -> tuple[list[dict], str]:
    messages = [{"role": "user", "content": SECRET}]
    extra = {"user": user} if user is not None else {}
    reply = client(server, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                        **extra)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return messages, reply.model_extra["k3"]["conversation"]


def continue_as(server: Server, history: list[dict], text: str, user: str | None, key: str = "loopback-key"):
    extra = {"user": user} if user is not None else {}
    return client(server, key).chat.completions.create(
        model=MODEL, messages=history + [{"role": "user", "content": text}], max_tokens=2, temperature=0, **extra)


@pytest.mark.parametrize("alice, mallory", [
    ((None, "key-of-alice"), (None, "key-of-mallory")),         # told apart by the API key
    (("alice", "same-key"), ("mallory", "same-key")),           # by OpenAI's user field
    (("alice", "same-key"), (None, "same-key")),                # a request without one is nobody's continuation
], ids=["api-key", "user-field", "no-user"])
def test_another_users_history_is_never_their_conversation(server, alice, mallory) -> None:
    history, theirs = first_turn(server, *alice)
    reply = continue_as(server, history, "Mallory was here.", *mallory)
    k3 = reply.model_extra["k3"]
    assert k3["conversation"] != theirs and reply.usage.prompt_tokens_details.cached_tokens == 0
    assert [r["turn"] for r in session_json(server, theirs)["requests"]] == [1]  # nothing of Mallory's
    mine = session_json(server, k3["conversation"])
    assert mine["status"] == "recording" and len(mine["requests"]) == 1
    # the owner continues their own conversation, as before
    again = continue_as(server, history, "Alice again.", *alice)
    assert again.model_extra["k3"]["conversation"] == theirs and again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("seed", 2 ** 64), ("seed", 1.5), ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5),
    ("max_tokens", 0), ("user", 7), ("user", "u" * 300), ("stop", [""]), ("n", 3), ("stream", "yes"),
    ("presence_penalty", 1.0), ("frequency_penalty", "x"), ("logit_bias", {"5": 100}),
    ("response_format", {"type": "json_object"}),
])
def test_a_refused_continuation_leaves_the_conversation_and_its_trace_alone(server, field, value) -> None:
    history, theirs = first_turn(server, "alice")
    body = {"model": MODEL, "messages": history + [{"role": "user", "content": "x"}], "user": "alice", field: value}
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] or error["param"] == field, error
    assert "\n" not in error["message"]
    state = session_json(server, theirs)
    assert state["status"] == "recording" and [q["turn"] for q in state["requests"]] == [1]
    again = continue_as(server, history, "still mine?", "alice")
    assert again.model_extra["k3"]["conversation"] == theirs and again.usage.prompt_tokens_details.cached_tokens > 0


def test_the_largest_seed_the_engine_takes_is_accepted(server) -> None:
    reply = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "seed"}],
                                                   max_tokens=1, seed=2 ** 64 - 1)
    assert reply.usage.completion_tokens == 1
