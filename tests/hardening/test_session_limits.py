"""Issue 42 item 7: the writer never writes a session.json the reader refuses (the reader's own checks
and size limit, one set of numbers in code), a refused update changes nothing, and
docs/reliability.md states the numbers the code uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from engine.session.segments import MAX_SEGMENT_NAME, MAX_SEGMENTS
from workbench.trace import TraceError, TraceWriter, open_trace
from workbench.trace import part_checks
from workbench.trace.bounds import MAX_SESSION_BYTES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
_SEGMENT = {"id": 0, "kind": "document", "name": "notes", "start": 0, "end": 4}


def _writer(path, **session):
    return TraceWriter.create(path, {"model": {"layers": 8}, "segments": [_SEGMENT], **session}, fsync=False)


def test_a_segment_name_past_the_limit_is_refused_and_nothing_is_lost(tmp_path):
    w = _writer(tmp_path / "t")
    w.append("dsa_key_counts", layer=3, step=0, rank=0, key_bin=np.arange(4), count=np.ones(4, np.int64))
    w.flush()
    before = (tmp_path / "t" / "session.json").read_bytes()
    big = {"id": 1, "kind": "turn", "name": "x" * (17 << 20), "start": 4, "end": 6}
    with pytest.raises(TraceError, match=r"segments\[1\].name has 17,825,792 characters; at most 4,096") as info:
        w.add_segment(big)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    # names within their limit, but so many that session.json would pass the reader's size limit
    many = [_SEGMENT] + [{"id": i, "kind": "turn", "name": "n" * MAX_SEGMENT_NAME, "start": 4, "end": 4}
                         for i in range(1, 4200)]
    with pytest.raises(TraceError, match=r"would take 17,.* bytes, more than the 16,7.* a reader accepts "
                                         r"\(field `segments` takes") as info:
        w.update_session(segments=many)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400 and "not written" in str(info.value)
    assert (tmp_path / "t" / "session.json").read_bytes() == before
    assert len(w.session["segments"]) == 1  # the refused segments are not kept for the next write either
    w.add_segment({**big, "name": "answer"})
    w.close()
    t = open_trace(tmp_path / "t")
    assert t.status == "complete" and list(t.segments()["name"]) == ["notes", "answer"]
    assert t.dsa_heatmap(bins=4).sum() == 4


@pytest.mark.parametrize("segment, words", [
    ({**_SEGMENT, "start": 1.0}, r"segments\[0\].start"),
    ({**_SEGMENT, "end": 2 ** 40}, r"segments\[0\].end"),
    ({**_SEGMENT, "id": 2 ** 40}, r"segments\[0\].id"),
    ({**_SEGMENT, "id": "zero"}, r"segments\[0\].id"),
])
def test_segments_the_reader_refuses_are_refused_when_written(tmp_path, segment, words):
    w = _writer(tmp_path / "t")
    with pytest.raises(TraceError, match=words):
        w.update_session(segments=[segment])
    w.close()
    assert open_trace(tmp_path / "t").segments()["start"].tolist() == [0]


@pytest.mark.parametrize("fields, words", [
    ({"policy": {"dsa_bin_tokens": 0}}, "policy.dsa_bin_tokens"),
    ({"model": {"num_experts": 10 ** 6}}, "model.num_experts"),
    ({"task": {"note": "y" * (17 << 20)}}, "field `task` takes"),
])
def test_other_fields_the_reader_refuses_are_refused_when_written(tmp_path, fields, words):
    w = _writer(tmp_path / "t")
    with pytest.raises(TraceError, match=words):
        w.update_session(**fields)
    w.close()
    assert open_trace(tmp_path / "t").status == "complete"


def test_a_refused_new_trace_leaves_the_old_one(tmp_path):
    w = _writer(tmp_path / "t")
    w.close()
    before = (tmp_path / "t" / "session.json").read_bytes()
    with pytest.raises(TraceError, match="name has 17,825,792 characters"):
        TraceWriter.create(tmp_path / "t", {"segments": [{**_SEGMENT, "name": "z" * (17 << 20)}]}, overwrite=True,
                           fsync=False)
    assert (tmp_path / "t" / "session.json").read_bytes() == before


def test_a_session_just_under_the_limit_is_written_and_read(tmp_path):
    w = _writer(tmp_path / "t")
    w.update_session(task={"note": "y" * (MAX_SESSION_BYTES - 8192)})
    w.append("dsa_key_counts", layer=3, step=0, rank=0, key_bin=np.arange(4), count=np.ones(4, np.int64))
    w.close()
    assert (tmp_path / "t" / "session.json").stat().st_size <= MAX_SESSION_BYTES
    assert open_trace(tmp_path / "t").status == "complete"


def test_one_set_of_numbers_in_code_and_docs():
    assert part_checks.MAX_SESSION_BYTES is MAX_SESSION_BYTES  # the reader reads through the writer's limit
    text = DOCS.read_text()
    row = next(line for line in text.splitlines() if "session.json` over" in line)
    assert f"over {MAX_SESSION_BYTES >> 20} MiB" in row and f"more than {MAX_SEGMENTS:,} segments" in row
    numbers = {m for m in re.findall(r"\d[\d,]*(?: MiB)?", row)}
    assert numbers == {f"{MAX_SESSION_BYTES >> 20} MiB", f"{MAX_SEGMENTS:,}", f"{MAX_SEGMENT_NAME:,}"}, numbers
    for stale in ("64 MiB or with more than 65,536", "65,536 segments"):
        assert stale not in text


def test_the_session_json_of_a_recording_round_trips(tmp_path):
    w = _writer(tmp_path / "t", task={"kind": "find-fact"})
    w.update_session(task={"answer": "7"})
    w.close()
    session = json.loads((tmp_path / "t" / "session.json").read_text())
    assert session["task"] == {"kind": "find-fact", "answer": "7"} and session["status"] == "complete"


def test_the_capture_limits_in_docs_are_the_codes():
    from workbench.captures import arrays, json_cost
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `workbench import` responses"))
    assert f"over {json_cost.MAX_PARSED_BYTES >> 30} GiB of Python objects" in row
    assert f"deeper than {json_cost.MAX_DEPTH} levels" in row and f"over {json_cost.MAX_DIGITS} digits" in row
    assert f"header over {arrays.MAX_NPY_HEADER:,} bytes" in row
    assert f"more than {arrays.MAX_HEADER_BRACKETS} brackets" in row
    assert f"a dimension of over {arrays.MAX_SHAPE_DIGITS} digits" in row


def test_the_engine_refuses_a_name_the_trace_would_refuse(tmp_path):
    """The 17 MB name reaches neither the session nor its trace: refused at `append`, before anything changes
    (it used to be taken by the session and then fail the recording's close)."""
    import workbench
    from engine import load_model
    from engine.errors import InputError
    from engine.session import Session
    from engine.tokenizer import Tokenizer

    session = Session(load_model("preset:tiny", seed=0), Tokenizer.byte_level(), prefill_chunk=64, progress=False)
    with workbench.record(session, trace=tmp_path / "t"):
        session.append("hello world", name="notes")
        with pytest.raises(InputError, match="a segment name of 17,825,792 characters; at most 4,096"):
            session.append("more", name="x" * (17 << 20))
        with pytest.raises(InputError, match="segment name of 5,000 characters"):
            session.append_message("user", "hi", name="y" * 5000)
        session.append(" and more", name="ok")
    t = open_trace(tmp_path / "t")
    assert t.status == "complete" and list(t.segments()["name"]) == ["notes", "ok"]
    assert len(session.segments) == 2


def test_thumbnails_the_reader_refuses_are_refused_when_written(tmp_path):
    import io
    from PIL import Image
    from workbench.trace.thumbnail_files import MAX_THUMBNAIL_BYTES, MAX_THUMBNAIL_SIDE
    w = _writer(tmp_path / "t")
    wide = io.BytesIO()
    Image.new("RGB", (MAX_THUMBNAIL_SIDE + 1, 1)).save(wide, "PNG")
    with pytest.raises(TraceError, match=f"a {MAX_THUMBNAIL_SIDE + 1}x1 thumbnail; a reader accepts sides"):
        w.write_image(1, wide.getvalue())
    with pytest.raises(TraceError, match=f"more than the {MAX_THUMBNAIL_BYTES:,} a reader accepts"):
        w.write_image(1, b"\x89PNG\r\n\x1a\n" + bytes(MAX_THUMBNAIL_BYTES))
    with pytest.raises(TraceError, match="must be PNG bytes"):
        w.write_image(1, b"GIF89a" + bytes(64))
    ok = io.BytesIO()
    Image.new("RGB", (64, 32)).save(ok, "PNG")
    assert w.write_image(1, ok.getvalue()) == "images/1.png"
    w.close()
    assert not (tmp_path / "t" / "images" / "2.png").exists()


def test_the_summary_limits_in_docs_are_the_codes():
    from workbench.trace import arrow_limits
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| dashboard summary (Arrow)"))
    assert f"more than {arrow_limits.MAX_FIELDS} fields" in row
    assert f"more than {arrow_limits.VALUES_PER_ROW_LIMIT} times the row limit" in row


def test_the_parquet_limits_in_docs_are_the_codes():
    from workbench.trace import parquet_pages
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| trace part (or `effects.parquet`)"))
    assert f"footer is over {parquet_pages.MAX_FOOTER_BYTES >> 20} MiB" in row
    assert f"more than {parquet_pages.MAX_FOOTER_ITEMS:,} entries" in row
