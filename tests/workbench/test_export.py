"""`workbench export`: every format round-trips the rows, --layers/--tables filter, bad traces and
existing outputs give one-line errors (exit 2), and an existing export is only replaced on request."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from apps.cli import main
from workbench.trace import TraceError, open_trace
from workbench.trace.export import export_trace, parse_layers
from k3testing.synthetic import Dims, Policy, write_synthetic_trace


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "trace"
    return write_synthetic_trace(path, 8192, Dims.demo(), Policy(prefill_chunk=2048, decode_tokens=128,
                                                                 kda_extras=True), seed=5)


def test_parse_layers():
    assert parse_layers("0,3,5-7") == [0, 3, 5, 6, 7] and parse_layers("7, 7,2") == [2, 7]
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(TraceError, match="bad layer list"):
            parse_layers(bad)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl", "npz"])
def test_formats_round_trip(trace_path, tmp_path, fmt):
    t = open_trace(trace_path)
    layer = t.layers("dsa_topk")[0]
    out = tmp_path / fmt
    manifest = export_trace(trace_path, out, fmt, layers=[layer, 0])
    topk = t.table("dsa_topk", layers=[layer])
    norms = t.table("kda_norms", layers=[0])
    assert manifest["tables"]["dsa_topk"]["rows"] == topk.num_rows > 0
    assert manifest["tables"]["tokens"]["rows"] == 8192
    assert json.loads((out / "session.json").read_text()) == t.session
    first_sel = topk["selected"][0].as_py()
    if fmt == "parquet":
        back = pq.read_table(out / "dsa_topk.parquet")
        assert back.equals(topk) and pq.read_table(out / "kda_norms.parquet").equals(norms)
    elif fmt == "csv":
        back = pd.read_csv(out / "dsa_topk.csv")
        assert len(back) == topk.num_rows and json.loads(back["selected"][0]) == first_sel
        assert back["scores"].isna().all() and len(pd.read_csv(out / "tokens.csv")) == 8192
        assert json.loads(pd.read_csv(out / "kda_norms.csv")["norm"][0]) == pytest.approx(
            np.asarray(norms["norm"][0].as_py(), np.float32), rel=1e-3)
    elif fmt == "jsonl":
        rows = [json.loads(line) for line in (out / "dsa_topk.jsonl").read_text().splitlines()]
        assert len(rows) == topk.num_rows and rows[0]["selected"] == first_sel and rows[0]["scores"] is None
        tok = json.loads((out / "tokens.jsonl").read_text().splitlines()[0])
        assert set(tok) == set(t.tokens().columns) and tok["modality"] == "text" and tok["image_id"] is None
    else:
        with np.load(out / "dsa_topk.npz", allow_pickle=False) as z:
            off, val = z["selected.offsets"], z["selected.values"]
            assert len(off) == topk.num_rows + 1 and val[off[0]:off[1]].tolist() == first_sel
            assert not z["scores.valid"].any() and (z["layer"] == layer).all()
        with np.load(out / "tokens.npz", allow_pickle=False) as z:
            image = z["image_id.valid"]
            assert z["modality"][image].tolist() == ["image"] * int(image.sum()) and (z["image_id"][~image] == -1).all()
            assert z["piece"].dtype.kind == "U"


def test_tables_filter_and_unknown_table(trace_path, tmp_path):
    manifest = export_trace(trace_path, tmp_path / "o", "parquet", tables=["dsa_sink", "tokens"])
    assert sorted(manifest["tables"]) == ["dsa_sink", "tokens"]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["dsa_sink.parquet", "export.json", "session.json",
                                                                   "tokens.parquet"]
    with pytest.raises(TraceError, match="unknown table"):
        export_trace(trace_path, tmp_path / "p", "parquet", tables=["dsa"])
    with pytest.raises(TraceError, match="unknown export format"):
        export_trace(trace_path, tmp_path / "p", "xlsx")


def test_never_overwrites_unless_asked(trace_path, tmp_path):
    out = tmp_path / "o"
    export_trace(trace_path, out, "csv", tables=["dsa_sink", "moe_rank_load"])
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(TraceError, match="not empty; pass --overwrite"):
        export_trace(trace_path, out, "csv", tables=["dsa_sink"])
    before = (out / "dsa_sink.csv").read_bytes()
    export_trace(trace_path, out, "csv", tables=["dsa_sink"], layers=[3], overwrite=True)
    # replaced what the previous export wrote, removed its stale file, left the user's file alone
    assert (out / "mine.txt").read_text() == "keep me" and not (out / "moe_rank_load.csv").exists()
    assert (out / "dsa_sink.csv").read_bytes() != before
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "a.txt").write_text("x")
    with pytest.raises(TraceError, match="not empty"):
        export_trace(trace_path, unrelated, "csv")
    with pytest.raises(TraceError, match="inside the trace"):
        export_trace(trace_path, trace_path / "export", "csv")


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["export", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_exports_and_reports_bad_traces_in_one_line(trace_path, tmp_path, capsys):
    code, out, err = _run(capsys, trace_path, "--format", "jsonl", "--out", tmp_path / "ok", "--layers", "0,3-4",
                          "--tables", "kda_norms,dsa_sink")
    assert code == 0 and "exported 2 tables" in out and err == ""
    assert json.loads((tmp_path / "ok" / "export.json").read_text())["layers"] == [0, 3, 4]
    code, _, err = _run(capsys, trace_path, "--format", "jsonl", "--out", tmp_path / "ok")
    assert code == 2 and err.count("\n") == 1 and "--overwrite" in err

    bad = tmp_path / "bad"
    shutil.copytree(trace_path, bad)
    session = json.loads((bad / "session.json").read_text())
    (tmp_path / "empty").mkdir()
    cases = {"missing": (tmp_path / "nope", "does not exist"), "not a trace": (tmp_path / "empty", "no session.json"),
             "an export": (tmp_path / "ok", "is an export written by `workbench export`, not a trace")}
    for label, (path, words) in cases.items():
        code, _, err = _run(capsys, path, "--format", "csv", "--out", tmp_path / label.replace(" ", "_"))
        assert code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1, label
    part = sorted((bad / "dsa_topk").glob("part-*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:100])
    code, _, err = _run(capsys, bad, "--format", "csv", "--out", tmp_path / "c1")
    assert code == 2 and str(part) in err and err.count("\n") == 1
    assert not (tmp_path / "c1").exists() and not list(tmp_path.glob(".c1.export-*"))
    session["schema_version"] = 9
    (bad / "session.json").write_text(json.dumps(session))
    code, _, err = _run(capsys, bad, "--format", "csv", "--out", tmp_path / "c2")
    assert code == 2 and "schema version 9" in err and "version 1" in err


def test_an_image_trace_exports_with_its_thumbnails(tmp_path):
    """The export copies the thumbnails session.json names (images/), so it opens with its pictures;
    --overwrite replaces them with the new export's and keeps the user's own files."""
    from tests.apps.conftest import record_image_session
    from workbench.trace.thumbnail_files import read_thumbnail

    trace = record_image_session(tmp_path / "trace", new_tokens=2)
    out = tmp_path / "out"
    manifest = export_trace(trace, out, "parquet", tables=["tokens"])
    assert "images" in manifest["files"]
    meta = json.loads((out / "session.json").read_text())
    segs = [s for s in meta["segments"] if s["kind"] == "image"]
    assert segs and sorted(p.name for p in (out / "images").iterdir()) == [f"{s['id']}.png" for s in segs]
    for seg in segs:
        assert read_thumbnail(out, seg).tobytes() == read_thumbnail(trace, seg).tobytes()
    (out / "notes.txt").write_text("mine")
    (out / "images" / "stale.png").write_bytes(b"old")  # inside the export's own directory: replaced
    export_trace(trace, out, "csv", tables=["tokens"], overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "images").iterdir()) == [f"{s['id']}.png" for s in segs]
    assert not list(tmp_path.glob(".*"))  # no temporary left behind
    # a thumbnail the segment names but the trace lacks: the strict export refuses, the old one is kept
    broken = tmp_path / "broken"
    shutil.copytree(trace, broken)
    (broken / segs[0]["thumbnail"]).unlink()
    with pytest.raises(TraceError, match="file missing.*previous export there is kept"):
        export_trace(broken, out, "csv", tables=["tokens"], overwrite=True)
    assert read_thumbnail(out, segs[0]) is not None
