"""Transcripts in the OpenAI messages format become sessions (`Session.append_messages`, `workbench run --messages`)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from apps.cli import main
from engine import load_model
from engine.errors import ImageError, InputError
from engine.session import Session
from engine.tokenizer import Tokenizer
from engine.session.transcript import parse_messages, read_transcript


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = load_model("preset:tiny", seed=1)
    return model, Tokenizer.for_model("preset:tiny", model.config.vocab_size)


def png_bytes(colour=(255, 0, 0), size=(32, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


AGENT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "What is in"}, {"type": "text", "text": "this picture?"},
                                 {"type": "image_url", "image_url": {"url": data_url(png_bytes())}}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a red square"},
    {"role": "assistant", "content": "A red square."},
    {"role": "developer", "content": "Answer in one word next time."},
]


def test_a_transcript_becomes_one_segment_per_message_in_the_chat_format(tiny) -> None:
    model, tok = tiny
    replayed = Session(model, tok)
    segments = replayed.append_messages(AGENT)
    # the same conversation built message by message with the session's own chat calls
    by_hand = Session(model, tok)
    by_hand.append("You are terse.", role="system")
    by_hand.append_message("user", "What is in\nthis picture?", images=[png_bytes()])
    calls = json.dumps({"tool_calls": AGENT[2]["tool_calls"]}, ensure_ascii=False)
    by_hand.append(calls, role="assistant")
    by_hand.append("a red square", role="tool")
    by_hand.append("A red square.", role="assistant")
    by_hand.append("Answer in one word next time.", role="system")
    assert replayed.tokens == by_hand.tokens
    # six messages, one of them with an image: seven segments, each named after its message
    assert [(s.kind, s.role) for s in segments] == [("turn", "system"), ("image", "user"), ("turn", "user"),
                                                   ("turn", "assistant"), ("turn", "tool"), ("turn", "assistant"),
                                                   ("turn", "system")]
    assert segments[0].name == "message 0 (system)" and segments[-1].name == "message 5 (system)"
    assert segments[1].image is not None and segments[1].image["width"] == 32
    first = replayed.prefill(return_logits=True)
    second = by_hand.prefill(return_logits=True)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize("messages, expected", [
    ([], "non-empty list of messages"),
    ([{"role": "user", "content": "hi"}, "hello"], "message 1 must be an object"),
    ([{"role": "robot", "content": "hi"}], "message 0 field 'role'"),
    ([{"role": "user", "content": 7}], "message 0 field 'content'"),
    ([{"role": "user", "content": ""}], "message 0 field 'content': the message is empty"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "audio"}]}],
     "message 1 field 'content' part 0: unsupported part type 'audio'"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "part 0 \"text\" must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}],
     "remote image URLs are not fetched"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}],
     "not valid base64"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "/etc/passwd"}]}],
     "local image paths are not allowed"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": data_url(b"x")}]}],
     "images belong in user"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "only assistant messages call tools"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 3}}]}], "tool_calls' entry 0"),
    ([{"role": "user", "content": "hi", "weird": 1}], "message 0: unknown field(s) ['weird']"),
], ids=["empty", "not-object", "role", "content-type", "empty-text", "part-type", "text-type", "remote-url",
        "bad-base64", "local-path", "assistant-image", "tool-calls-role", "tool-call-shape", "unknown-field"])
def test_bad_transcripts_name_the_message_and_field(messages, expected: str) -> None:
    with pytest.raises(InputError) as info:
        parse_messages(messages)
    assert expected in str(info.value)


def test_nothing_is_appended_when_a_later_image_is_bad(tiny) -> None:
    model, tok = tiny
    session = Session(model, tok)
    bad = [{"role": "user", "content": "fine"},
           {"role": "user", "content": [{"type": "image_url", "image_url": data_url(b"not a picture")}]}]
    with pytest.raises(ImageError, match="message 1"):
        session.append_messages(bad)
    assert session.tokens == [] and session.segments == []


def test_local_images_stay_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "pic.png").write_bytes(png_bytes())
    ok = parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "pic.png"}]}],
                        image_root=tmp_path)
    assert ok[0].images == ((tmp_path / "pic.png").resolve(),)
    with pytest.raises(InputError, match="outside the image root"):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "../x.png"}]}],
                       image_root=tmp_path)


def test_workbench_run_replays_a_transcript(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    chat = tmp_path / "chat.json"
    (tmp_path / "pic.png").write_bytes(png_bytes((0, 0, 255)))
    chat.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "pic.png"}},
                                     {"type": "text", "text": "Colour?"}]}]}))
    trace = tmp_path / "trace"
    code = main(["run", "--model", "preset:tiny", "--messages", str(chat), "--max-new-tokens", "2",
                 "--temperature", "0", "--trace", str(trace)])
    assert code == 0
    session = json.loads((trace / "session.json").read_text())
    kinds = [(s["kind"], s.get("role"), s["name"]) for s in session["segments"]]
    assert kinds[:3] == [("turn", "system", "message 0 (system)"), ("image", "user", "pic.png"),
                         ("turn", "user", "message 1 (user)")]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "user", "content": {"x": 1}}]))
    capsys.readouterr()
    assert main(["run", "--model", "preset:tiny", "--messages", str(bad)]) == 2
    assert "message 1 field 'content'" in capsys.readouterr().err
    assert "not valid JSON" in str(pytest.raises(InputError, read_transcript, _write(tmp_path, "x.json", "{")).value)


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path
