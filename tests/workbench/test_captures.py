"""Captures in: a session recorded with our engine, written out as vLLM / SGLang responses and imported
back, gives the same reductions (the trace's tables and the dashboard's views); bad captures get a clear
error and leave nothing behind."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import workbench
from apps.cli import main
from workbench.analysis.views import DSAMapReducer, ExpertsReducer, RecordingMapReducer, ViewOptions
from apps.dashboard.follower import TraceFollower
from engine.errors import InputError
from workbench.captures import export_responses, import_capture, importer
from workbench.captures.arrays import encode_flat, encode_npy
from workbench.recorders.policy import ALL

MODEL = "preset:tiny"
DELTA_TABLES = ("moe_counts", "moe_rank_load", "dsa_key_counts", "dsa_distance_hist", "dsa_segment_totals", "dsa_sink")
SUMS = {"count", "tokens", "queries", "sink_hits"}


def _record(path: Path, policy) -> None:
    from engine import load_model
    from engine.session import Session
    from engine.tokenizer import Tokenizer

    model = load_model(MODEL, seed=0)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=64, progress=False)
    with workbench.record(session, trace=path, policy=policy):
        session.append("The vault code is 4-7-1-9. " * 10, name="notes")
        list(session.generate(5, temperature=0, stop_ids=()))
        session.append(" What was the code?", name="question")  # a second turn continues the first
        list(session.generate(4, temperature=0, stop_ids=()))
    return model.config


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory):
    """The same two-turn session recorded with policy `all` (every route and selection) and `default`."""
    root = tmp_path_factory.mktemp("captures")
    config = _record(root / "all", ALL)
    _record(root / "default", "default")
    return root, config


def _save(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sums(trace, table: str):
    df = trace.df(table)
    keys = [c for c in df.columns if c not in SUMS | {"step", "position"}]
    return df.groupby(keys)[[c for c in df.columns if c in SUMS]].sum().sort_index()


def _rows(trace, table: str, column: str) -> dict:
    df = trace.df(table)
    return {(int(l), int(p)): list(v) for l, p, v in zip(df["layer"], df["position"], df[column])}


def _same(a, b, where: str = "", names: dict | None = None) -> None:
    """Dataclass trees equal field by field (arrays exactly, NaN equal to NaN); `names` translates b's
    segment names to a's (an import names segments after its requests)."""
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}", names)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]", names)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", names)
    else:
        assert a == (names or {}).get(b, b), where


@pytest.mark.parametrize("engine, layer_axis, dtype", [("vllm", "hidden", "int32"), ("sglang", "hidden", "int32"),
                                                       ("vllm", "family", "uint8"), ("sglang", "family", "uint16")])
def test_round_trip_gives_the_recorded_reductions(recorded, tmp_path, monkeypatch, engine, layer_axis, dtype) -> None:
    root, config = recorded
    if layer_axis == "family":  # rows decoded a few at a time: chunks that split base64 quanta give the same trace
        monkeypatch.setattr(importer, "CHUNK_BYTES", 100)
    responses = _save(export_responses(root / "all", config, engine, dtype=dtype, layer_axis=layer_axis),
                      tmp_path / "responses.jsonl")
    capture = import_capture(engine, responses, MODEL, tmp_path / "imported", policy="all")
    original, imported = workbench.open_trace(root / "all"), workbench.open_trace(tmp_path / "imported")
    assert imported.status == "complete" and capture["records"] == 2
    axis = {"hidden": "hidden_layers", "family": "moe_layers"}[layer_axis]
    moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    assert capture["layer_map"]["moe"] == {"axis": axis, "layers": moe,
                                           "entries": moe if layer_axis == "hidden" else list(range(len(moe)))}
    assert capture["positions_without_rows"]["moe"] == 0
    for column in ("token_id", "piece", "segment"):
        assert list(imported.tokens()[column]) == list(original.tokens()[column])
    assert [(s["start"], s["end"], s["kind"]) for s in imported.session["segments"]] == \
        [(s["start"], s["end"], "turn" if s["kind"] == "document" else s["kind"]) for s in original.session["segments"]]
    assert _rows(imported, "moe_routes", "experts") == _rows(original, "moe_routes", "experts")
    tables = DELTA_TABLES if engine == "sglang" else DELTA_TABLES[:2]
    for table in tables:
        assert _sums(imported, table).equals(_sums(original, table)), table
    options = ViewOptions(bins=64, position=int(original.tokens()["position"].iloc[-3]))
    views = {}
    for name, trace in (("original", original), ("imported", imported)):
        session = RecordingMapReducer().reduce(trace, options)
        views[name] = (ExpertsReducer().reduce(trace, options, session), DSAMapReducer().reduce(trace, options, session))
    experts, dsa = views["imported"]
    _same(dataclasses.replace(experts, routes=None), dataclasses.replace(views["original"][0], routes=None), "experts")
    assert [(r["layer"], r["experts"]) for r in experts.routes] == \
        [(r["layer"], r["experts"]) for r in views["original"][0].routes]
    assert all(np.isnan(r["entropy"]) for r in experts.routes)  # a capture holds no router weights: NaN, not 0
    assert {"kda", "dsa_dense_mass", "moe_routes.weights"} <= set(capture["absent"])
    if engine == "sglang":
        assert _rows(imported, "dsa_topk", "selected") == _rows(original, "dsa_topk", "selected")
        _same(dsa.heat, views["original"][1].heat, "dsa.heat")
        np.testing.assert_array_equal(dsa.heat_chance, views["original"][1].heat_chance)
        names = {o["name"]: i["name"] for o, i in zip(original.session["segments"], imported.session["segments"])}
        _same(dsa.reads, views["original"][1].reads, "dsa.reads", names)
    else:  # vLLM returns no indexer top-k: the trace says so instead of holding an empty DSA view
        assert "dsa" in capture["absent"] and not imported.layers("dsa_key_counts")


def test_default_policy_keeps_the_rows_the_recorder_keeps(recorded, tmp_path) -> None:
    root, config = recorded
    responses = _save(export_responses(root / "all", config, "sglang"), tmp_path / "r.jsonl")
    import_capture("sglang", responses, MODEL, tmp_path / "imported")
    imported, original = workbench.open_trace(tmp_path / "imported"), workbench.open_trace(root / "default")
    for table, column in (("moe_routes", "experts"), ("dsa_topk", "selected")):
        assert _rows(imported, table, column) == _rows(original, table, column), table


def test_cli_import_and_overwrite(recorded, tmp_path, capsys) -> None:
    root, config = recorded
    assert main(["export", str(root / "all"), "--format", "vllm", "--model", MODEL, "--out", str(tmp_path / "x")]) == 0
    responses = tmp_path / "x" / "responses.jsonl"
    # a trace recorded with a sampling policy does not hold every route: said, nothing written
    assert main(["export", str(root / "default"), "--format", "sglang", "--model", MODEL, "--out",
                 str(tmp_path / "y")]) == 2
    assert "record with policy \"all\"" in capsys.readouterr().err and not (tmp_path / "y").exists()
    assert [json.loads(line) for line in responses.read_text().splitlines()] == \
        export_responses(root / "all", config, "vllm")
    out = tmp_path / "trace"
    assert main(["import", "vllm", str(responses), "--model", MODEL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "imported 2 vllm response(s)" in printed and "absent: dsa" in printed
    assert main(["import", "vllm", str(responses), "--model", MODEL, "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    (out / "notes.txt").write_text("mine")  # what the user put into the trace survives its replacement
    assert main(["import", "vllm", str(responses), "--model", MODEL, "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    # the dashboard says what the capture lacks instead of showing empty KDA and DSA views unexplained
    follower = TraceFollower(out)
    frame = follower.compute()
    follower.stop()
    assert frame.error is None and not frame.kda.heat.rows
    assert any("imported from vllm responses; not in the capture" in p and "KDA state" in p and "indexer top-k" in p
               for p in frame.problems)
    # a trace the command did not write is never replaced, --overwrite or not
    assert main(["import", "vllm", str(responses), "--model", MODEL, "--out", str(root / "all"), "--overwrite"]) == 2
    assert "not empty and is not a trace written by `workbench import`" in capsys.readouterr().err
    assert workbench.open_trace(root / "all").status == "complete"


def _vllm_record(config, prompt, output, routes):
    return {"id": "x", "prompt_token_ids": prompt, "prompt_routed_experts": None,
            "choices": [{"index": 0, "token_ids": output, "routed_experts": routes}]}


def _bad_cases(config):
    """(name, engine, records, model, expected message) of captures the importer must refuse."""
    k, hidden = config.num_experts_per_token, config.num_hidden_layers
    prompt, output = list(range(40, 60)), [70, 71, 72]
    rows = len(prompt) + len(output) - 1
    good = np.ones((rows, hidden, k), np.int32)
    npy = base64.b64decode(encode_npy(good))
    sgl = {"output_ids": output, "input_ids": prompt, "meta_info": {"routed_experts": encode_flat(good)}}
    over = np.zeros((rows, hidden, k), np.int32)
    over[7, 3, 1] = config.num_experts
    future = np.full((rows, hidden, config.dsa.topk), -1, np.int32)
    future[4, 2, 0] = 9
    return [
        ("shape", "vllm", [_vllm_record(config, prompt, output, encode_npy(np.ones((rows, hidden, k + 1))))], MODEL,
         "does not match the model config"),
        ("layers", "vllm", [_vllm_record(config, prompt, output, encode_npy(np.ones((rows, 3, k), np.int32)))], MODEL,
         "expected 6 or 5 layers"),
        ("sglang layers", "sglang", [{**sgl, "meta_info": {"routed_experts": encode_flat(good[:, :3])}}], MODEL,
         "is not a [22, 6, 2] or [22, 5, 2] array"),
        ("float dtype", "vllm", [_vllm_record(config, prompt, output, encode_npy(good, "float32"))], MODEL,
         "must be integers"),
        ("overflow", "vllm", [_vllm_record(config, prompt, output, encode_npy(np.ones((rows, 93, 16)), "uint8"))],
         "preset:k3.1-pro", "dtype uint8 cannot hold expert ids up to 895"),
        ("token id", "vllm", [_vllm_record(config, prompt, output + [config.vocab_size], None)], MODEL,
         "outside the vocabulary"),
        ("truncated base64", "sglang", [{**sgl, "meta_info": {"routed_experts": encode_flat(good)[:-3]}}], MODEL,
         "truncated base64"),
        ("truncated npy", "vllm", [_vllm_record(config, prompt, output,
                                                base64.b64encode(npy[:-8]).decode())], MODEL, "is truncated"),
        ("expert range", "sglang", [{**sgl, "meta_info": {"routed_experts": encode_flat(over)}}], MODEL,
         f"expert id {config.num_experts} at position 7 (layer 3) is outside"),
        ("future key", "sglang", [{**sgl, "meta_info": {"routed_experts": encode_flat(good),
                                                        "indexer_topk": encode_flat(future)}}], MODEL,
         "key position 9 selected by the query at position 4 (layer 2)"),
        ("not a conversation", "sglang", [sgl, {**sgl, "input_ids": [1] + prompt, "meta_info": {}}], MODEL,
         "record 2: its prompt does not continue"),
        ("no meta_info", "sglang", [{"output_ids": output}], MODEL, "no meta_info"),
    ]


def test_bad_captures_get_a_clear_error_and_leave_nothing(recorded, tmp_path) -> None:
    _, config = recorded
    for name, engine, records, model, message in _bad_cases(config):
        out = tmp_path / name.replace(" ", "-")
        with pytest.raises(InputError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            import_capture(engine, _save(records, tmp_path / f"{out.name}.jsonl"), model, out)
        assert not out.exists(), name
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")], name
    (tmp_path / "bad.json").write_text('{"choices": [')
    with pytest.raises(InputError, match="not valid JSON"):
        import_capture("vllm", tmp_path / "bad.json", MODEL, tmp_path / "never")


def test_failed_overwrite_keeps_the_previous_trace(recorded, tmp_path) -> None:
    root, config = recorded
    out = tmp_path / "trace"
    import_capture("sglang", _save(export_responses(root / "all", config, "sglang"), tmp_path / "r.jsonl"), MODEL, out)
    before = workbench.open_trace(out).df("moe_counts")
    name, engine, records, model, message = next(c for c in _bad_cases(config) if c[0] == "expert range")
    with pytest.raises(InputError, match="outside"):
        import_capture(engine, _save(records, tmp_path / "bad.jsonl"), model, out, overwrite=True)
    after = workbench.open_trace(out)
    assert after.status == "complete" and after.df("moe_counts").equals(before)


def test_prompt_ids_from_the_request_or_the_logprobs(recorded, tmp_path) -> None:
    """SGLang's /generate response does not repeat the prompt's ids: they come from the saved request or
    from `meta_info.input_token_logprobs` (with logprob_start_len 0); both give the same trace."""
    root, config = recorded
    exported = export_responses(root / "all", config, "sglang")
    wrapped = [{"request": {"input_ids": r.pop("input_ids")}, "response": r} for r in exported]
    ids = wrapped[1].pop("request")["input_ids"]
    wrapped[1] = wrapped[1]["response"]  # the second record: bare response, ids only in the logprobs
    wrapped[1]["meta_info"]["input_token_logprobs"] = [[None if n == 0 else -1.0, i, None] for n, i in enumerate(ids)]
    import_capture("sglang", _save(wrapped, tmp_path / "r.jsonl"), MODEL, tmp_path / "t", policy="all")
    imported, original = workbench.open_trace(tmp_path / "t"), workbench.open_trace(root / "all")
    assert list(imported.tokens()["token_id"]) == list(original.tokens()["token_id"])
    assert _sums(imported, "dsa_key_counts").equals(_sums(original, "dsa_key_counts"))
