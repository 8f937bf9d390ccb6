"""Issue 31 item 9: inputs that raised a raw traceback or were wrongly accepted now get one clear error.

Each case names the input; library cases expect the engine's own error type, command-line cases one
`error: ...` line and exit status 2. A deep or damaged dashboard summary counts as absent.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from apps.cli import main
from engine import get_preset, load_model
from engine.config_io import config_to_hf, parse_config
from engine.errors import ConfigError, InputError
from engine.io.files import MAX_JSON_DEPTH, parse_json
from engine.session import Session
from engine.tokenizer import Tokenizer
from engine.weights.random_init import MAX_SEED, RandomSource
from engine.weights.write import write_checkpoint
from workbench.questions import checked_span
from workbench.trace.export import parse_layers
from workbench.trace.files import PART_RE
from k3testing.synthetic import Dims, Policy, write_synthetic_trace

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clear-errors")
    write_checkpoint(get_preset("tiny"), root / "ckpt", seed=0)
    write_synthetic_trace(root / "trace", 1024, Dims.demo(), Policy(prefill_chunk=512, decode_tokens=8))
    return root


@pytest.fixture(scope="module")
def model(base):
    return load_model(str(base / "ckpt"))


@pytest.fixture(scope="module")
def tokenizer(base, model):
    return Tokenizer.for_model(str(base / "ckpt"), model.config.vocab_size)


@pytest.fixture(scope="module")
def snapshot(base, model, tokenizer) -> Path:
    session = Session(model, tokenizer, progress=False)
    session.append("hello there", name="doc")
    list(session.generate(2, temperature=0))
    session.save(base / "snap")
    return base / "snap"


def one_error_line(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and all(w in lines[0] for w in words), lines[0]
    return lines[0]


# ---- deep JSON ---------------------------------------------------------------------------------
def test_parse_json_bounds_depth_and_reads_brackets_in_strings() -> None:
    with pytest.raises(InputError, match="nested deeper"):
        parse_json(DEEP, "deep.json", InputError)
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(nested, "ok.json", InputError) is not None
    text = json.dumps({"a": "[[[{{{" * 50 + '\\"]]', "b": [1, {"c": []}]})
    assert parse_json(text.encode(), "strings.json", InputError)["b"] == [1, {"c": []}]
    with pytest.raises(InputError, match="not valid JSON"):
        parse_json(b"\xff{}", "bytes.json", InputError)


@pytest.mark.parametrize("command", [["summarize"], ["questions"], ["export", "--format", "csv", "--out", "{out}"]])
def test_deep_session_json_is_one_line(base, tmp_path, capsys, command: list[str]) -> None:
    trace = tmp_path / "trace"
    shutil.copytree(base / "trace", trace)
    session = json.loads((trace / "session.json").read_text())
    (trace / "session.json").write_text(json.dumps(session)[:-1] + ', "deep": ' + DEEP + "}")
    argv = [command[0], str(trace)] + [a.replace("{out}", str(tmp_path / "out")) for a in command[1:]]
    one_error_line(capsys, argv, "session.json", "nested deeper")


def test_deep_summary_counts_as_absent(base, tmp_path, monkeypatch) -> None:
    from workbench.trace import summary_cache

    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    key = summary_cache.Key("ab" * 20, base / "trace")
    folder = tmp_path / "cache" / key.digest[:2]
    folder.mkdir(parents=True)
    (folder / f"{key.digest}.kda_health.json").write_text(DEEP)
    assert summary_cache.load_json(key, "kda_health") is None


# ---- snapshots -----------------------------------------------------------------------------------
def _damaged(snapshot: Path, tmp_path: Path, meta=None, tensors=None) -> Path:
    out = tmp_path / "snap"
    shutil.copytree(snapshot, out)
    if meta is not None:
        data = json.loads((out / "snapshot.json").read_text())
        meta(data)
        (out / "snapshot.json").write_text(json.dumps(data))
    if tensors is not None:
        state = load_file(str(out / "state.safetensors"))
        tensors(state)
        save_file(state, str(out / "state.safetensors"))
    return out


def _overlapping(meta: dict) -> None:
    first = meta["segments"][0]
    meta["segments"] += [dict(first, id=len(meta["segments"]) + i, start=0, end=0) for i in range(3)]


def _renumbered(meta: dict) -> None:
    meta["segments"][0]["id"] = 7


@pytest.mark.parametrize("case, meta, tensors, words", [
    ("step 2**70", lambda m: m.__setitem__("step", 2 ** 70), None, "invalid step"),
    ("extra tensor", None, lambda t: t.__setitem__("bogus.extra", torch.zeros(3)), "bogus.extra"),
    ("overlapping zero-length segments", _overlapping, None, "starts before segment"),
    ("segment ids out of order", _renumbered, None, "id must be 0"),
    ("deep snapshot.json", lambda m: m.__setitem__("deep", json.loads("[" * 80 + "]" * 80)), None, "nested deeper"),
])
def test_bad_snapshot_is_refused(snapshot, tmp_path, model, tokenizer, case, meta, tensors, words) -> None:
    path = _damaged(snapshot, tmp_path, meta, tensors)
    with pytest.raises(InputError, match=words.replace("*", r"\*")):
        Session.load(path, model, tokenizer)


# ---- public API types --------------------------------------------------------------------------
def test_wrong_types_at_the_session_api_are_input_errors(model, tokenizer) -> None:
    session = Session(model, tokenizer, progress=False)
    with pytest.raises(InputError, match="text= must be a str"):
        session.append(b"hi")
    with pytest.raises(InputError, match="integer token ids"):
        session.append(ids=[1, 2.5])
    with pytest.raises(InputError, match="integer token ids"):
        session.append(ids="hello")
    with pytest.raises(InputError, match="outside the vocabulary"):
        session.append(ids=[10 ** 30])
    with pytest.raises(InputError, match="role= must be a str"):
        session.append_message(3, "hi")
    with pytest.raises(InputError, match="prefill_chunk"):
        Session(model, tokenizer, prefill_chunk=2.5)
    assert session.append(ids=torch.tensor([1, 2, 3])).end == 3  # tensors and numpy ids still work
    assert not session.segments[:-1]


def test_empty_input_ids_are_an_input_error(model) -> None:
    with pytest.raises(InputError, match="no tokens"):
        model(torch.zeros(1, 0, dtype=torch.long))


def test_weights_seed_must_fit_the_generator(capsys) -> None:
    with pytest.raises(InputError, match="weights seed"):
        RandomSource(get_preset("tiny"), seed=10 ** 23)
    RandomSource(get_preset("tiny"), seed=MAX_SEED)._gen("x")  # the largest accepted seed works
    one_error_line(capsys, ["run", "--model", "preset:tiny", "--prompt", "x", "--weights-seed", str(10 ** 23)],
                   "weights seed")


# ---- config values -----------------------------------------------------------------------------
def _config(change) -> dict:
    raw = config_to_hf(get_preset("tiny"))
    change(raw)
    return raw


@pytest.mark.parametrize("case, change, words", [
    ("vision rope_theta inf", lambda r: r["vision_config"].__setitem__("rope_theta", math.inf), "rope_theta"),
    ("vision rope_theta 1e-300", lambda r: r["vision_config"].__setitem__("rope_theta", 1e-300), "rope_theta"),
    ("group_size 7", lambda r: r["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
     .__setitem__("group_size", 7), "group_size"),
    # an id beyond the vocabulary loads (tests/engine/test_special_token_ids.py); one no tokenizer can name does not
    ("bos past any 32-bit id", lambda r: r["text_config"].__setitem__("bos_token_id", 1 << 40), "bos_token_id"),
    ("eos not an integer", lambda r: r["text_config"].__setitem__("eos_token_id", 1.5), "eos_token_id"),
])
def test_config_values_out_of_range_are_refused(case, change, words) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_config(_config(change))


# ---- command line ------------------------------------------------------------------------------
def test_needle_span_past_int32_is_one_line(base, capsys) -> None:
    one_error_line(capsys, ["questions", str(base / "trace"), "--needle", f"0:{10 ** 20}"], "START < END")
    with pytest.raises(InputError, match="needle"):
        checked_span(["0", 5], "needle", inclusive=False)


def test_image_path_with_a_newline_prints_one_line(base, capsys) -> None:
    line = one_error_line(capsys, ["run", "--model", str(base / "ckpt"), "--prompt", "x", "--max-new-tokens", "1",
                                   "--image", str(base / "no\nerror: such")])
    assert "\\n" in line


def test_fifo_in_place_of_tokens_parquet_fails_the_export(base, tmp_path, capsys) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    trace = tmp_path / "trace"
    shutil.copytree(base / "trace", trace)
    (trace / "tokens.parquet").unlink()
    os.mkfifo(trace / "tokens.parquet")
    one_error_line(capsys, ["export", str(trace), "--format", "csv", "--out", str(tmp_path / "out")],
                   "tokens.parquet", "FIFO")


def test_full_width_digits_are_not_part_numbers_or_layers() -> None:
    assert PART_RE.match("part-000001.parquet") and not PART_RE.match("part-\uff10\uff10\uff10\uff10\uff10\uff11.parquet")
    with pytest.raises(Exception, match="layer"):
        parse_layers("\uff13")


def test_unknown_flag_prints_the_subcommands_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", "x", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: workbench run") and "--bogus" in err


def test_show_is_one_idea_in_demo_and_dashboard() -> None:
    from apps.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo"]).show and not parser.parse_args(["demo", "--no-show"]).show
    assert not parser.parse_args(["demo", "--no-browser"]).show  # the older spelling still works
    assert not parser.parse_args(["dashboard"]).show and parser.parse_args(["dashboard", "--show"]).show


def test_upload_over_the_limit_gets_a_message_not_a_silent_drop(tmp_path) -> None:
    from apps.dashboard.session_runner import SessionRunner
    from apps.dashboard.follower import DashboardState

    runner = SessionRunner(state=DashboardState(None), runs_dir=str(tmp_path / "runs"))
    assert runner.dropper.max_file_size.endswith("MB") and int(runner.dropper.max_file_size[:-2]) << 20 >= 50 << 20
    runner.dropper._process_event(SimpleNamespace(event_name="upload_event", data={
        "name": "big.txt", "chunk": 1, "total_chunks": 50, "data": b"x" * (1 << 20), "type": "text/plain"}))
    assert runner.message.startswith("error: big.txt") and "upload limit" in runner.message


def test_deep_json_in_markers_and_table_metadata_reads_as_absent(tmp_path) -> None:
    import pyarrow as pa

    from engine.weights.write import MARKER_FILE, is_written_checkpoint
    from workbench.recorded_settings import SETTINGS_KEY, settings_of

    (tmp_path / MARKER_FILE).write_text(DEEP)
    assert not is_written_checkpoint(tmp_path)
    table = pa.table({"x": [1]}).replace_schema_metadata({SETTINGS_KEY.encode(): DEEP.encode()})
    assert settings_of(table) == {}


@pytest.mark.parametrize("argv, words", [(["--tokens", str(10 ** 11)], "--tokens must be in"),
                                         (["--new-tokens", "0"], "--new-tokens must be at least 1")])
def test_demo_sizes_are_bounded_before_anything_is_built(capsys, argv: list[str], words: str) -> None:
    one_error_line(capsys, ["demo", "--headless", *argv], words)


def test_cached_kda_health_with_unusable_rows_counts_as_absent() -> None:
    from workbench.analysis.views.kda_health_view import _from_json

    good_row = {"kind": "saturates", "rank": 1, "layer": 0, "head": 1, "position": 9, "half_life": None,
                "segment_name": "doc"}
    cached = {"ranked": [good_row], "layers": 1, "heads": 2, "measured": [], "last_position": 9, "note": ""}
    assert _from_json(cached) is not None
    for bad in ({"layer": "0"}, {"kind": "other"}, {"half_life": "long"}, {"rank": True}):
        assert _from_json({**cached, "ranked": [{**good_row, **bad}]}) is None, bad


def test_wrong_types_at_other_public_entry_points(model, tokenizer) -> None:
    import workbench

    with pytest.raises(InputError, match="model path"):
        load_model(None)
    with pytest.raises(workbench.TraceError, match="trace path"):
        workbench.open_trace(5)
    session = Session(model, tokenizer, progress=False)
    session.append("hi")
    before = session.sampling
    with pytest.raises(InputError, match="params= must be a SamplingParams"):
        list(session.generate(params="greedy"))
    with pytest.raises(InputError, match="unknown sampling parameter"):
        list(session.generate(1, temprature=0))
    assert session.sampling is before  # a refused call leaves the sampler as it was
    with pytest.raises(InputError, match="path= must be"):
        session.save(None)
    with pytest.raises(InputError, match="path= must be"):
        Session.load(123, model, tokenizer)


def test_deep_json_in_the_newer_readers_is_one_error(tmp_path) -> None:
    """Intervention specs (text and file) and a trace's session.json seen by the import and lock checks:
    100k-deep nesting is a clear error (or "not ours"), never a RecursionError."""
    from engine.errors import InputError
    from engine.interventions import parse_interventions
    from workbench.captures.importer import _is_imported_trace
    from workbench.interventions import load_intervention_spec

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InputError, match="nested deeper"):
        parse_interventions(deep)
    spec = tmp_path / "spec.json"
    spec.write_text(deep)
    with pytest.raises(InputError, match="nested deeper"):
        load_intervention_spec(spec)
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "session.json").write_text("{\"a\":" * 100_000 + "1" + "}" * 100_000)
    assert _is_imported_trace(trace) is False
