"""Issue 42 item 1: what one request may cost `workbench serve` is bounded before it is spent.

The attacks (at full size: 60 MiB bodies, 64 pictures; their peak memory is in the issue's note)
are sent here small, against proportionally smaller limits set through the server's own config:
a body of many JSON values is refused on its bytes (never `json.loads`-ed), a message longer than
the context can hold is refused before it is tokenized, pictures by number and pixel area from
their headers before any is decoded, and the queue holds exactly `max_queue` waiting requests and
at most `max_pending_bytes` of bodies.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from apps.web_guard import HostPolicy
from apps.serve.app import AppConfig
from apps.serve.limits import RequestLimits, check_json_shape
from apps.serve.protocol import RequestError
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from workbench.sessions import load_with_tokenizer

MODEL = "preset:tiny"  # context 65,536 tokens, byte-level: a character is at least one token


@pytest.fixture(scope="module")
def tiny():
    return load_with_tokenizer(MODEL, seed=1)


def _server(tiny, **config) -> Server:
    model, tokenizer = tiny
    queue = config.pop("max_queue", 4)
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=None, max_queue=queue),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), **config), port=0)
    srv.start_in_thread()
    return srv


@pytest.fixture(scope="module")
def server(tiny):
    srv = _server(tiny, max_body_bytes=4 << 20, max_json_values=20_000, max_images=4, max_image_area=1_000_000)
    yield srv
    srv.stop()


def post(srv: Server, body: bytes | dict, timeout: float = 60) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}/chat/completions", content=raw, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def png(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, "PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def pictures(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "?"}]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}


def one_line_error(r: httpx.Response, status: int, words: str) -> str:
    assert r.status_code == status, r.text[:300]
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message, message
    return message


# ---- the JSON shape, on the bytes -----------------------------------------------------------------
LIMITS = RequestLimits(context_tokens=1000, max_values=100, max_depth=8)


@pytest.mark.parametrize("raw", [
    b'{"messages": [], "x": [' + b"{}," * 200 + b"{}]}",              # empty objects in an unknown field
    b"[" + b"[]," * 200 + b"[]]",                                     # empty lists
    b"[" + b"1.5," * 200 + b"0]",                                     # numbers
    b"[" + b'"",' * 200 + b'""]',                                     # empty strings
    b'{"x": [' + b'"a\\"",' * 200 + b'"b"]}',                        # strings holding escaped quotes
    b"[" * 9 + b"]" * 9,                                               # nested deeper than allowed
    b'{"a":' * 9 + b"1" + b"}" * 9,
    b"[{" * 4 + b"[]" + b"}]" * 4,                                     # alternating kinds: 9 levels
    b'"' * 1000,                                                       # not JSON, but as many quotes as strings
], ids=["objects", "lists", "numbers", "strings", "escaped-quotes", "deep-lists", "deep-objects", "alternating",
        "quotes"])
def test_json_shape_refuses_too_many_values_or_levels(raw: bytes) -> None:
    with pytest.raises(RequestError) as info:
        check_json_shape(raw, LIMITS)
    assert info.value.status == 413 and ("JSON values" in str(info.value) or "levels" in str(info.value))


@pytest.mark.parametrize("raw", [
    json.dumps({"messages": [{"role": "user", "content": "[[[[[[[[[[[[ {{{{{{{{{ ,,,,,,,,,,,, " * 50}]}).encode(),
    json.dumps({"m": ["a\\", "b\\\\\"", "c"], "n": [[[[[[[1]]]]]]]}).encode(),
    b"[" * 8 + b"]" * 8,                                               # exactly the depth allowed
    b"[{" * 4 + b"}]" * 4,
    b"{not json [[[[[[[[[[",                                           # unbalanced: json.loads names it
    b"",
], ids=["structure-in-text", "escapes", "depth-8", "alternating-8", "unbalanced", "empty"])
def test_json_shape_passes_text_and_leaves_bad_json_to_the_parser(raw: bytes) -> None:
    check_json_shape(raw, LIMITS)


def test_a_body_of_many_empty_objects_is_refused_unparsed(server) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": [' + b"{}," * 100_000 + b"{}]}"
    one_line_error(post(server, body), 413, "100,008 JSON values; at most 20,000")
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    one_line_error(post(server, deep), 413, "deeper than the 64 levels")
    assert post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status_code == 200


# ---- characters before tokens, pictures before pixels -------------------------------------------
def test_a_message_longer_than_the_context_is_refused_before_it_is_tokenized(server, monkeypatch) -> None:
    calls: list[int] = []
    tokenizer = server.worker.tokenizer
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(len(text)) or encode(text))
    started = time.perf_counter()
    r = post(server, {"messages": [{"role": "user", "content": "a" * 70_000}], "max_tokens": 1})
    one_line_error(r, 400, "70,000 characters")
    assert time.perf_counter() - started < 10 and not any(n >= 70_000 for n in calls), calls
    # split over messages, and with a picture: the sum counts
    half = {"role": "user", "content": "b" * 33_000}
    one_line_error(post(server, {"messages": [half, half], "max_tokens": 1}), 400, "66,000 characters")
    # thousands of one-letter messages: their chat frames alone pass the context
    many = [{"role": "user", "content": "q"}] * 4000
    calls.clear()
    one_line_error(post(server, {"messages": many, "max_tokens": 1}), 400, "would hold at least")
    assert len(calls) < 100, len(calls)  # refused before the messages were tokenized one by one


def test_pictures_are_counted_and_measured_from_their_headers(server, monkeypatch) -> None:
    decoded: list[str] = []
    from engine.session import transcript

    real = transcript.prepare_image
    monkeypatch.setattr(transcript, "prepare_image", lambda *a, **k: decoded.append("x") or real(*a, **k))
    small = png(32, 32)
    one_line_error(post(server, pictures(*[small] * 5)), 400, "5 images; at most 4")
    # a 16 KB PNG that declares 2048 x 2048 pixels: refused on its header, nothing decoded
    one_line_error(post(server, pictures(png(2048, 2048))), 400, "more than 1,000,000 pixels")
    one_line_error(post(server, pictures(png(800, 800), png(800, 800))), 400, "up to message 0 (user) image 1")
    assert decoded == []
    assert post(server, pictures(small, small)).status_code == 200 and decoded == ["x", "x"]


def test_pictures_and_text_together_against_the_context(tiny) -> None:
    srv = _server(tiny, max_image_area=100_000_000, max_image_patches=10 ** 6)
    try:
        # thousands of image tokens from the header + 64,000 characters: over 65,536 tokens, nothing decoded
        body = pictures(png(2048, 2048))
        body["messages"].append({"role": "user", "content": "c" * 64_000})
        one_line_error(post(srv, body), 400, "would hold at least")
    finally:
        srv.stop()


# ---- what waits -----------------------------------------------------------------------------------
def _busy(srv: Server) -> openai.Stream:
    c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
    long = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "busy"}], max_tokens=4000,
                                     stream=True)
    next(iter(long))  # the model is now running it
    return long


def _wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("max_queue", [0, 2])
def test_max_queue_lets_exactly_that_many_wait(tiny, max_queue: int) -> None:
    srv = _server(tiny, max_queue=max_queue)
    results: list[int] = []
    try:
        long = _busy(srv)
        small = {"messages": [{"role": "user", "content": "wait"}], "max_tokens": 1}
        waiting = [threading.Thread(target=lambda: results.append(post(srv, small).status_code))
                   for _ in range(max_queue)]
        for t in waiting:
            t.start()
        _wait_for(lambda: srv.worker._outstanding == max_queue + 1)
        one_line_error(post(srv, small), 429, "queue is full")
        long.close()
        for t in waiting:
            t.join(60)
        assert results == [200] * max_queue
    finally:
        srv.stop()


def test_bodies_held_together_stay_within_the_pending_budget(tiny) -> None:
    srv = _server(tiny, max_queue=8, max_body_bytes=200_000, max_pending_bytes=300_000)
    results: list[int] = []
    try:
        long = _busy(srv)
        # ~190 KB each, in a field the server ignores (the text itself must fit the context)
        big = {"messages": [{"role": "user", "content": "d"}], "max_tokens": 1, "metadata": "d" * 190_000}
        first = threading.Thread(target=lambda: results.append(post(srv, big).status_code))
        first.start()
        _wait_for(lambda: srv.worker._outstanding == 2)
        # the running request's small body, plus one big one waiting: a second big one would pass 300 KB
        message = one_line_error(post(srv, big), 429, "MiB of request bodies")
        assert "retry later" in message
        long.close()
        first.join(60)
        assert results == [200]
        _wait_for(lambda: srv.worker._outstanding == 0)
        assert post(srv, big).status_code == 200  # given back once done
    finally:
        srv.stop()


def test_a_failure_while_reading_a_request_is_one_line_and_the_server_goes_on(server, monkeypatch) -> None:
    from apps.serve import app

    def broken(request, limits) -> None:
        raise TypeError("a reader bug")

    monkeypatch.setattr(app, "check_request_cost", broken)
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(server, hi)
    assert r.status_code == 500 and r.json()["error"]["message"] == "the server could not read this request (TypeError)"
    monkeypatch.undo()
    assert post(server, hi).status_code == 200
