"""Issue 31 item 14: `workbench run` prints the response text (not the chat scaffolding), stops where the
response ends, and takes `--raw`, `--stop` and `--system`; on the trained demo model (greedy)."""

from __future__ import annotations

import pytest

from apps.cli import main

PROMPT = "The code for the blue door is 4471. What is the code for the blue door?"
RUN = ["run", "--model", "builtin:demo", "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "60",
       "--compile", "off", "--system", "Answer briefly."]


def run(capsys, *extra: str) -> tuple[str, str]:
    assert main(RUN + list(extra)) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def generated(err: str) -> int:
    return int(err.split(" generated tokens")[0].rsplit("+ ", 1)[1])


def test_response_text_only_and_generation_stops_at_its_end(capsys) -> None:
    out, err = run(capsys)
    assert out == "blue door: 4471.\n"
    assert generated(err) < 60  # stopped at the response's close, not at the token budget


def test_raw_prints_every_token(capsys) -> None:
    out, _ = run(capsys, "--raw")
    assert out.startswith("<|close|>think<|sep|><|open|>response<|sep|>blue door: 4471.") and "<|close|>" in out[9:]


def test_stop_string_ends_the_answer_and_is_not_printed(capsys) -> None:
    out, err = run(capsys, "--stop", ":", "--stop", "never")
    assert out == "blue door\n" and generated(err) < 30


@pytest.mark.parametrize("flag, value", [("--stop", ""), ("--system", "")])
def test_empty_stop_or_system_is_one_line(capsys, flag: str, value: str) -> None:
    assert main(["run", "--model", "/nonexistent", "--prompt", "x", flag, value]) == 2
    assert capsys.readouterr().err.startswith(f"error: {flag}")


class ScriptedSession:
    """Generates fixed ids the way Session.generate does: the generation prompt is appended first."""

    def __init__(self, ids: list[int]) -> None:
        from engine.tokenizer import Message, Tokenizer

        from engine import get_preset

        self.tokenizer = Tokenizer.byte_level()
        self.config = get_preset("tiny")  # the answer loop reads the model's eos id from it
        self.tokens = self.tokenizer.chat_prompt([Message("user", "q")], add_generation_prompt=False)
        self.script = ids

    def generate(self, params=None, **overrides):
        from engine.session import GeneratedToken

        self.tokens += self.tokenizer.chat_prompt([], add_generation_prompt=True)
        for token in self.script:
            self.tokens.append(token)
            yield GeneratedToken(token, "", len(self.tokens) - 1, 0.0)


def test_thinking_before_the_response_is_not_printed() -> None:
    import io

    from apps.cli.run_cmd import stream_answer
    from workbench.sessions import RecordedSession

    tok = ScriptedSession([]).tokenizer
    session = ScriptedSession(tok.encode("let me think") + tok.response_prefix("42") + [tok.close_id] + tok.encode("x"))
    out = io.StringIO()
    stream_answer(RecordedSession(session, None), None, out, chat=True)
    assert out.getvalue() == "42\n" and session.tokens[-1] == tok.close_id  # nothing generated past the close


def test_dashboard_driven_session_stops_where_the_response_ends() -> None:
    from apps.dashboard.session_runner import generate_answer

    tok = ScriptedSession([]).tokenizer
    session = ScriptedSession(tok.encode("hmm") + tok.response_prefix("42") + [tok.close_id] + tok.encode("more"))
    generated, answer = generate_answer(session, 64, 0.0)
    assert answer == "42" and session.tokens[-1] == tok.close_id and generated == len(session.script) - 4
