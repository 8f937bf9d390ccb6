"""Issue 42 items 10 and 12: refusals that came too late or as a raw traceback.

- a run refused for its prompt (past the context limit, a bad intervention) leaves no trace directory:
  the prompt is laid out and the interventions resolved before the trace is created (item 12);
- `workbench.effects` / `workbench.attribution` arguments out of range are one InputError line (item 10);
- `export --format vllm|sglang --model M` with a model other than the trace's is one line (item 10).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench
from apps.cli import main
from engine import load_model
from engine.errors import InputError
from engine.session import Session


def one_error_line(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines
    return lines[0]


# ---- item 12: nothing is created for a refused run -----------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--chat"], ["--system", "be brief"]])
def test_a_prompt_past_the_context_limit_leaves_no_trace(tmp_path, capsys, extra) -> None:
    prompt = tmp_path / "long.txt"
    prompt.write_text("a" * 70_000)  # the tiny preset reads 65,536 tokens; its tokenizer one per byte here
    trace = tmp_path / "trace"
    one_error_line(capsys, ["run", "--model", "preset:tiny", "--prompt-file", str(prompt), "--trace", str(trace),
                            "--max-new-tokens", "1", *extra], "context would hold", "limit is 65536")
    assert not trace.exists()


def test_a_conversation_past_the_limit_leaves_no_trace(tmp_path, capsys) -> None:
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "b" * 40_000},
                                {"role": "assistant", "content": "c" * 40_000}]))
    trace = tmp_path / "trace"
    one_error_line(capsys, ["run", "--model", "preset:tiny", "--messages", str(chat), "--trace", str(trace)],
                   "limit is 65536")
    assert not trace.exists()


def test_an_unknown_segment_in_the_spec_leaves_no_trace(tmp_path, capsys) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"op": "dsa.hide", "segment": "nowhere"}]))
    trace = tmp_path / "trace"
    one_error_line(capsys, ["run", "--model", "preset:tiny", "--prompt", "hello", "--intervene", str(spec),
                            "--trace", str(trace)], "no segment named 'nowhere'")
    assert not trace.exists()


def test_a_run_that_fits_still_records_its_interventions(tmp_path, capsys) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"op": "dsa.hide", "segment": "prompt"}, {"op": "moe.ban", "experts": [0, 1]}]))
    trace = tmp_path / "trace"
    assert main(["run", "--model", "preset:tiny", "--prompt", "hello", "--intervene", str(spec), "--trace",
                 str(trace), "--max-new-tokens", "2", "--temperature", "0"]) == 0
    session = json.loads((trace / "session.json").read_text())
    assert session["status"] == "complete"
    assert [e["op"] for e in session["interventions"]] == ["dsa.hide", "moe.ban"]


# ---- item 10: the experiments' arguments ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny:k3.1", seed=1)


def context(model) -> Session:
    s = Session(model, progress=False)
    s.append(ids=list(range(10, 40)), name="doc")
    s.append(ids=list(range(50, 60)), name="other")
    return s


HIDE = [{"op": "dsa.hide", "segment": "doc"}]


@pytest.mark.parametrize("kwargs, words", [
    (dict(target=[1_000_000]), "target: token ids must be integers in [0, 512)"),
    (dict(target=[-1]), "target: token ids"),
    (dict(target=[2 ** 70]), "target: token ids"),
    (dict(target=[2.5]), "target: token ids"),
    (dict(target=[True]), "target: token ids"),
    (dict(target=5), "target must be text or a list of token ids"),
    (dict(continuation=7), "continuation must be text or a list of token ids"),
    (dict(continuation=[1, 2 ** 64]), "continuation: token ids"),
    (dict(seed=-1, temperature=1.0), "seed must be"),
    (dict(record_to="plain"), "record_to must be a pair"),
    (dict(role=5), "role must be a chat role name"),
    (dict(continuation="what is it?"), "needs a model with tokenizer files"),  # refused before the prefill
])
def test_effects_arguments_are_one_line(model, kwargs, words) -> None:
    options = {"continuation": [1, 2], "max_new_tokens": 1, **kwargs}
    s = context(model)
    with pytest.raises(InputError) as info:
        workbench.effects(s, HIDE, **options)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert s.length == 0  # nothing ran


@pytest.mark.parametrize("segments, kwargs, words", [
    (["doc"], dict(controls=2.5), "controls must be an integer in [1, 1000]"),
    (["doc"], dict(controls=10 ** 9), "controls must be"),
    (["doc"], dict(controls=True), "controls must be"),
    ([("needle", 1)], {}, "a (label, start, end) span"),
    ([("needle", 1.5, 3)], {}, "a (label, start, end) span"),
    ([("needle", False, True)], {}, "a (label, start, end) span"),
    ([("needle", 1, 2 ** 70)], {}, "is not inside the context's 40 tokens"),
    ("doc", {}, "segments must be a list"),
    ([5], {}, "a (label, start, end) span"),
    (["doc"], dict(seed=-1), "seed must be an integer in [0, 2**63)"),
    (["doc"], dict(seed=2.5), "seed must be"),
    (["doc"], dict(experts=0), "experts must be None or an integer in [1, 6]"),
    (["doc"], dict(experts=7), "experts must be"),
    (["doc"], dict(evidence=[(1,)]), "evidence: each span"),
    (["doc"], dict(evidence=[(1, 2 ** 70)]), "evidence: each span"),
    (["doc"], dict(target=[10 ** 6]), "target: token ids"),
    (["doc"], dict(target=None), "attribution needs a target"),
    (["doc"], dict(dsa="yes"), "dsa must be True or False"),
    (["doc"], dict(role=None), "role must be a chat role name"),
])
def test_attribution_arguments_are_one_line(model, segments, kwargs, words) -> None:
    options = {"continuation": [1, 2], "target": [3], **kwargs}
    s = context(model)
    with pytest.raises(InputError) as info:
        workbench.attribution(s, segments, **options)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert s.length == 0


# ---- item 10: export for another model ------------------------------------------------------------------

def test_export_for_a_model_other_than_the_traces_is_one_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace"
    assert main(["run", "--model", "preset:tiny", "--prompt", "hi", "--trace", str(trace), "--policy", "all",
                 "--max-new-tokens", "2", "--temperature", "0"]) == 0
    capsys.readouterr()
    for engine in ("sglang", "vllm"):
        one_error_line(capsys, ["export", str(trace), "--format", engine, "--model", "builtin:demo", "--out",
                                str(tmp_path / engine)], "num_experts is 8", "builtin:demo has 16")
        assert not (tmp_path / engine).exists()
    assert main(["export", str(trace), "--format", "sglang", "--model", "preset:tiny", "--out",
                 str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "responses.jsonl").exists()
