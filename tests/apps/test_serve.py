"""`workbench serve` driven by the real `openai` client on 127.0.0.1 (tiny preset: the whole module runs in seconds)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from PIL import Image
from starlette.testclient import TestClient

from apps.web_guard import HostPolicy
from apps.serve.app import AppConfig, create_app
from apps.serve.protocol import completion_body
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from engine.session import Session
from engine.session.answer import closing_ids
from engine.session.chat_response import ResponseReader
from workbench import open_trace
from workbench.sessions import load_with_tokenizer

MODEL = "preset:tiny"


@pytest.fixture(scope="module")
def tiny():
    return load_with_tokenizer(MODEL, seed=1)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("serve")
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=root, max_queue=4),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    srv.trace_root = root
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused-on-loopback", max_retries=0, timeout=60)


def data_url(colour=(255, 0, 0)) -> str:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def requests_of(server, conversation: str) -> list[dict]:
    return json.loads((server.trace_root / conversation / "session.json").read_text()).get("requests", [])


def test_models_and_a_completion_with_usage_recorded_as_a_trace(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 10
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    conversation = reply.model_extra["k3"]["conversation"]
    (entry,) = requests_of(server, conversation)
    assert entry["id"] == reply.id and entry["turn"] == 1 and entry["completion_tokens"] == 6
    trace = open_trace(server.trace_root / conversation)  # recorded while it ran: the tokens are there
    assert len(trace.tokens()) >= reply.usage.prompt_tokens


def test_streaming_gives_the_same_text_as_a_single_response(client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Stream this"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"


def test_an_image_message(server, client) -> None:
    reply = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url()}},
                                     {"type": "text", "text": "What colour?"}]}])
    segments = json.loads((server.trace_root / reply.model_extra["k3"]["trace"] / "session.json").read_text())["segments"]
    image = next(s for s in segments if s["kind"] == "image")
    assert image["image"]["width"] == 32 and image["role"] == "user"
    assert reply.usage.prompt_tokens > image["image"]["token_end"] - image["image"]["token_start"]


def test_a_different_picture_of_the_same_size_is_never_reused(client) -> None:
    def picture(colour) -> dict:
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(colour)}},
                                            {"type": "text", "text": "Colour?"}]}

    first = client.chat.completions.create(model=MODEL, messages=[picture((255, 0, 0))], max_tokens=3, temperature=0)
    follow_up = [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Sure?"}]
    # identical token ids (the media ids depend on the size only), another picture: a cold prefill
    swapped = client.chat.completions.create(model=MODEL, messages=[picture((0, 0, 255))] + follow_up, max_tokens=1)
    assert swapped.usage.prompt_tokens_details.cached_tokens == 0
    same = client.chat.completions.create(model=MODEL, messages=[picture((255, 0, 0))] + follow_up, max_tokens=1)
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_three_turns_reuse_the_prefix_and_match_a_cold_prefill(server, client, tiny) -> None:
    model, tokenizer = tiny
    messages = [{"role": "user", "content": "Turn one: remember the number 4719."}]
    ttft, cached, conversation = [], [], None
    for turn in range(3):
        started = time.perf_counter()
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        text, first = "", None
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
                first = first or time.perf_counter() - started
            if delta is not None and delta.content:
                text += delta.content
            if chunk.usage is not None:
                cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
        ttft.append(first)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Turn {turn + 2}?"}]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    # the conversation's state continued over three requests equals a cold prefill of all its tokens
    conv = next(c for c in server.worker.cache._items.values() if c.turns == 3)
    warm = conv.session
    cold = Session(model, tokenizer)
    cold.append(ids=warm.tokens[:warm.length], name="all")
    started = time.perf_counter()
    cold.prefill()
    cold_s = time.perf_counter() - started
    torch.testing.assert_close(warm.last_logits, cold.last_logits, rtol=1e-4, atol=1e-4)
    turns = [entry["turn"] for entry in requests_of(server, conv.id)]
    assert turns == [1, 2, 3]
    print(f"\nTTFT per turn (client side, s): {[round(t, 4) for t in ttft]}; cached tokens {cached}; "
          f"cold prefill of the {warm.length} tokens: {cold_s:.4f} s")


def test_two_clients_at_once(server) -> None:
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
        stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"client {i}"}],
                                           max_tokens=20, temperature=0, stream=True)
        results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1]
    # each got the answer it gets alone (the model serves one request at a time, never mixing them)
    alone = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "client 1"}], max_tokens=20, temperature=0)
    assert results[1] == alone.choices[0].message.content


def test_a_client_that_disconnects_stops_its_generation(server, client) -> None:
    before = set(p.name for p in server.trace_root.iterdir())
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long answer"}],
                                            max_tokens=4000, temperature=1.0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    entry = None
    while time.monotonic() < deadline and entry is None:
        new = set(p.name for p in server.trace_root.iterdir()) - before
        found = [requests_of(server, n) for n in new if (server.trace_root / n / "session.json").exists()]
        entry = next((r[-1] for r in found if r and "finish_reason" in r[-1]), None)
        time.sleep(0.05)
    assert entry is not None and entry["finish_reason"] == "cancelled"
    assert entry["completion_tokens"] < 4000
    # and the server goes on serving
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}],
                                          max_tokens=1).usage.completion_tokens == 1


@pytest.mark.parametrize("body, status, expected", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({"model": MODEL}).encode(), 400, "messages is required"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "message 0 field 'role'"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}).encode(), 400, "message 0"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), 400, "only n=1"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [""]}).encode(), 400, "stop"),
    (b"x" * (2 << 20), 413, "larger than"),
], ids=["not-json", "not-object", "no-messages", "bad-role", "bad-image", "bad-temperature", "max-tokens-0", "n-2",
        "empty-stop", "too-large"])
def test_malformed_bodies_get_a_clear_400(server, body: bytes, status: int, expected: str) -> None:
    r = httpx.post(f"{server.url}/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert expected in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/models").status_code == 200  # still serving


def test_the_openai_client_sees_a_bad_request_error(client) -> None:
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])


def test_a_full_queue_answers_429(tiny) -> None:
    model, tokenizer = tiny
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=None, max_queue=0),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1")), port=0)
    srv.start_in_thread()
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        long = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "busy"}],
                                         max_tokens=4000, stream=True)
        next(iter(long))  # the model is now busy with it
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "me too"}], max_tokens=1)
        long.close()
    finally:
        srv.stop()


DEMO = "builtin:demo"  # a trained K3 model: its answers carry the chat format's think/response tags
SCAFFOLD = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response")


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory):
    from engine.builtin import ROOT

    if not (ROOT / "demo" / "config.json").exists():
        pytest.skip("builtin:demo not installed (train it: training/README.md)")
    model, tokenizer = load_with_tokenizer(DEMO)
    srv = Server(model, tokenizer, ServeOptions(model_name=DEMO, trace_root=None, max_queue=4),
                 AppConfig(model_id=DEMO, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=256), port=0)
    srv.start_in_thread()
    yield srv, model, tokenizer
    srv.stop()


def test_a_k3_answer_reaches_the_client_without_its_chat_scaffold(demo_server) -> None:
    srv, model, tokenizer = demo_server
    c = openai.OpenAI(base_url=srv.url, api_key="unused-on-loopback", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "The vault code is 4-7-1-9.\nWhat is the vault code?"}]
    whole = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=24, temperature=0)
    content = whole.choices[0].message.content
    assert content and not any(tag in content for tag in SCAFFOLD), content
    # the demo closes its (empty) think section at once: no reasoning to report
    assert whole.choices[0].message.model_extra.get("reasoning_content") is None
    chunks = list(c.chat.completions.create(model=DEMO, messages=messages, max_tokens=24, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == content
    if ":" in content:  # a stop string ends the reply inside the response (the stop string not sent)
        cut = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=24, temperature=0, stop=[":"])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == content[:content.index(":")]
    # three turns, each sending back the stripped reply: the server continues from its exact ids
    cached = []
    for turn in range(3):
        reply = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=8, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"Turn {turn + 2}: the code again?"}]
    assert cached[1] > 0 and cached[2] > cached[1], cached
    conv = next(cv for cv in srv.worker.cache._items.values() if cv.turns == 3)
    warm = conv.session
    assert warm.tokens.count(tokenizer.end_of_msg_id) >= 5  # every earlier reply was closed as a whole message
    cold = Session(model, tokenizer)
    cold.append(ids=warm.tokens[:warm.length], name="all")
    cold.prefill()
    torch.testing.assert_close(warm.last_logits, cold.last_logits, rtol=1e-4, atol=1e-4)


def test_thinking_goes_to_reasoning_content_and_the_response_ends_the_reply(tiny) -> None:
    model, tokenizer = tiny
    reader = ResponseReader.after(tokenizer, tokenizer.chat_prompt([]))
    ids = (tokenizer.encode("pondering 4719") + tokenizer.section_tag("think", False)
           + tokenizer.section_tag("response", True) + tokenizer.encode("It is 4719.") + [tokenizer.close_id])
    shown = "".join(reader.feed(i) for i in ids) + reader.finish()
    assert shown == "It is 4719." and reader.take_thinking(final=True) == "pondering 4719" and reader.done
    # what the server remembers for the reply: the response tag finished, then the message closed
    closing = closing_ids(tokenizer, ids, reader)
    assert closing == tokenizer.encode("response") + [tokenizer.sep_id] + tokenizer.message_frame("assistant")[1]
    body = completion_body("id", MODEL, shown, "stop", {}, {}, reasoning="pondering 4719")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is 4719.",
                                             "reasoning_content": "pondering 4719"}


class _IdleWorker:
    """Stands in for the engine worker in guard tests (no request reaches it)."""

    class options:
        max_queue = 0

    def submit(self, job) -> bool:
        raise AssertionError("the guard must refuse before any request reaches the model")


def test_host_origin_and_api_key_are_checked_before_anything_runs() -> None:
    config = AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("0.0.0.0"), api_key="k" * 32)
    with TestClient(create_app(_IdleWorker(), config), base_url="http://127.0.0.1:8000") as tc:
        body = {"messages": [{"role": "user", "content": "x"}]}
        assert tc.post("/v1/chat/completions", json=body).status_code == 401
        wrong = tc.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer " + "k" * 31 + "j"})
        assert wrong.status_code == 401 and "k" * 31 not in wrong.text
        ok = {"Authorization": "Bearer " + "k" * 32}
        assert tc.get("/v1/models", headers=ok).status_code == 200
        rebound = tc.get("/v1/models", headers={**ok, "Host": "evil.example.com:8000"})
        assert rebound.status_code == 403 and "does not answer to the name" in rebound.json()["error"]["message"]
        page = tc.get("/v1/models", headers={**ok, "Origin": "http://evil.example.com"})
        assert page.status_code == 403
        assert tc.get("/v1/nothing", headers=ok).json()["error"]["message"].startswith("GET /v1/nothing")


def test_serve_refuses_other_hosts_without_an_api_key(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    from apps.cli import main

    monkeypatch.delenv("K3WB_API_KEY", raising=False)
    assert main(["serve", "--model", MODEL, "--host", "0.0.0.0", "--no-record"]) == 2
    assert "set an API key" in capsys.readouterr().err
    monkeypatch.setenv("K3WB_API_KEY", "short")
    assert main(["serve", "--model", MODEL, "--host", "0.0.0.0", "--no-record"]) == 2
    err = capsys.readouterr().err
    assert "at least 16" in err and "short" not in err  # the key itself is never echoed
