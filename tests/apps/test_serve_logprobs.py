"""`logprobs` / `top_logprobs` from `workbench serve`, the OpenAI way: each generated token's log-probability
under the model (no temperature), and the most likely tokens; equal to the engine's own forward."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from apps.web_guard import HostPolicy
from engine.session.transcript import parse_messages, render_messages
from workbench.sessions import load_with_tokenizer

MODEL = "preset:tiny"
MESSAGES = [{"role": "user", "content": "log-probabilities of every token, please"}]


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_with_tokenizer(MODEL, seed=1)
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=None, max_queue=2),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    yield srv, model, tokenizer
    srv.stop()


def post(srv, **body) -> httpx.Response:
    return httpx.post(f"{srv.url}/chat/completions", timeout=60, json={"model": MODEL, "messages": MESSAGES, **body})


def test_logprobs_equal_a_forward_of_the_same_tokens(served) -> None:
    srv, model, tokenizer = served
    reply = post(srv, max_tokens=5, temperature=0.7, seed=3, logprobs=True, top_logprobs=3)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == reply.json()["usage"]["completion_tokens"] == 5
    prompt = render_messages(model, tokenizer, parse_messages(MESSAGES, image_root=None), add_generation_prompt=True).ids
    # the chosen ids, found back from their bytes (a byte-level vocabulary: one id per byte string)
    chosen = [next(i for i in range(model.config.vocab_size) if list(tokenizer.token_bytes(i)) == e["bytes"])
              for e in content]
    logits = model(torch.tensor([prompt + chosen]))[0, len(prompt) - 1:-1].float()
    want = torch.log_softmax(logits, -1)
    for step, entry in enumerate(content):
        assert entry["logprob"] == pytest.approx(float(want[step, chosen[step]]), abs=1e-4)
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["logprob"] == pytest.approx(float(want[step].max()), abs=1e-4)
        assert tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]


def test_streamed_logprobs_match_the_whole_reply(served) -> None:
    srv, _, _ = served
    whole = post(srv, max_tokens=4, temperature=0, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    streamed = []
    with httpx.stream("POST", f"{srv.url}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True,
            "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    if choice.get("logprobs"):
                        streamed += choice["logprobs"]["content"]
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-5)


@pytest.mark.parametrize("body, words", [({"top_logprobs": 2}, "needs logprobs: true"),
                                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in"),
                                         ({"logprobs": "yes"}, "logprobs must be true or false")])
def test_bad_logprob_fields_are_one_line(served, body, words) -> None:
    reply = post(served[0], **body)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text
