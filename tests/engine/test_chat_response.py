"""ResponseReader: the response text of a chat answer, without its tags, ending where the format says."""

from __future__ import annotations

import pytest

from engine.session.chat_response import ResponseReader
from engine.errors import InputError
from engine.tokenizer import Message, Tokenizer

TOK = Tokenizer.byte_level()


def answer_ids(body: str, *, then: str = "") -> list[int]:
    """What a K3 model generates after the generation prompt: close think, open response, `body`,
    close response and the message, end of message; `then` is text it would run on with."""
    return (TOK.response_prefix(body) + TOK.section_tag("response", opening=False)
            + TOK.message_frame("assistant")[1] + TOK.encode(then))


def read(reader: ResponseReader, ids: list[int]) -> tuple[str, int]:
    """(text shown, ids consumed before `done`)."""
    out = []
    for n, token in enumerate(ids, 1):
        out.append(reader.feed(token))
        if reader.done:
            return "".join(out), n
    return "".join(out) + reader.finish(), len(ids)


def chat_context() -> list[int]:
    return TOK.chat_prompt([Message("user", "What is the code?")])


def test_response_text_only_and_stop_at_its_close() -> None:
    ids = answer_ids("blue door: 4471.", then="more text")
    text, used = read(ResponseReader.after(TOK, chat_context()), ids)
    assert text == "blue door: 4471."
    assert ids[used - 1] == TOK.close_id  # stopped at the close that ends the response, not the end of message


def test_thinking_is_not_shown() -> None:
    ids = TOK.encode("let me see") + answer_ids("42")
    assert read(ResponseReader.after(TOK, chat_context()), ids)[0] == "42"


def test_prefilled_response_continues_in_the_response() -> None:
    context = chat_context() + TOK.response_prefix("key: ")
    reader = ResponseReader.after(TOK, context)
    assert reader.showing and read(reader, TOK.encode("4-7-1-9") + [TOK.close_id])[0] == "4-7-1-9"


def test_plain_continuation_shows_text_and_stops_at_end_of_message() -> None:
    reader = ResponseReader.after(TOK, TOK.encode("Once upon a time"))
    text, used = read(reader, TOK.encode(" there was") + [TOK.end_of_msg_id] + TOK.encode("x"))
    assert text == " there was" and reader.done


@pytest.mark.parametrize("stops, expected", [(["\n\n"], "first line"), (["line", "zzz"], "first "),
                                             (["absent"], "first line\n\nsecond")])
def test_stop_strings_end_the_answer_and_are_not_shown(stops, expected) -> None:
    reader = ResponseReader.after(TOK, chat_context(), stop_strings=stops)
    assert read(reader, answer_ids("first line\n\nsecond"))[0] == expected


def test_multibyte_text_split_across_tokens_is_whole() -> None:
    text, _ = read(ResponseReader.after(TOK, chat_context()), answer_ids("caf\u00e9 \u2713"))
    assert text == "caf\u00e9 \u2713"


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(InputError, match="stop strings"):
        ResponseReader(TOK, stop_strings=[""])
