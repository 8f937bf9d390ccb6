"""A recorded session with real images: the token table's image rows (one per merged patch, right
row/col) read by DuckDB with no project code, the image segments and thumbnails in the trace, expert
counts by modality, and a bad image that leaves the trace intact. Also `workbench run --image`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image, ImageDraw

import workbench
from apps.cli import main
from engine import load_model
from engine.errors import ImageError
from engine.session import Session
from engine.tokenizer import Tokenizer

READER = textwrap.dedent(r"""
    import json, sys
    import duckdb
    trace = sys.argv[1]
    assert not any(m.split(".")[0] in ("workbench", "engine") for m in sys.modules)
    rows = duckdb.sql(
        f"SELECT image_id, count(*), min(position), max(position), max(patch_row), max(patch_col) "
        f"FROM read_parquet('{trace}/tokens.parquet') WHERE modality = 'image' GROUP BY image_id ORDER BY image_id"
    ).fetchall()
    cells = duckdb.sql(
        f"SELECT image_id, position, patch_row, patch_col FROM read_parquet('{trace}/tokens.parquet') "
        f"WHERE modality = 'image' ORDER BY position").fetchall()
    experts = duckdb.sql(
        f"SELECT modality, sum(count) FROM read_parquet('{trace}/moe_counts/part-*.parquet') GROUP BY 1 ORDER BY 1"
    ).fetchall()
    text_nulls = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{trace}/tokens.parquet') WHERE modality = 'text' AND image_id IS NULL"
    ).fetchall()
    print(json.dumps({"images": rows, "cells": cells, "experts": experts, "text_nulls": text_nulls}, default=str))
""")


def picture(width: int, height: int, color: str) -> Image.Image:
    im = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(im).ellipse([width // 5, height // 5, width * 3 // 4, height * 3 // 4], fill=color)
    return im


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    trace = tmp_path_factory.mktemp("images") / "trace"
    session = Session(load_model("preset:tiny"), Tokenizer.byte_level(), prefill_chunk=50)
    big = picture(1200, 800, "red")  # thumbnail: longest side 512
    with workbench.record(session, trace=trace, policy="default"):
        session.append("A short report about two pictures. " * 4, name="report")
        session.append(image=big, name="wide.png")
        with pytest.raises(ImageError, match="broken.png"):  # refused before anything changed
            session.append(image=b"\x89PNG\r\n\x1a\nbroken", name="broken.png")
        session.append(image=picture(150, 97, "blue"), name="odd.png", role="user")
        session.append("What do they show?", role="user")
        list(session.generate(3, temperature=0))
    return trace, session


def test_duckdb_reads_one_image_row_per_merged_patch(recorded):
    trace, session = recorded
    run = subprocess.run([sys.executable, "-c", READER, str(trace)], capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    images = [s for s in session.segments if s.kind == "image"]
    expected_cells = []
    for seg in images:
        info = seg.image
        for k in range(info["token_end"] - info["token_start"]):
            expected_cells.append([seg.id, info["token_start"] + k, k // info["grid_cols"], k % info["grid_cols"]])
    assert got["cells"] == expected_cells
    assert got["images"] == [[s.id, s.image["grid_rows"] * s.image["grid_cols"], s.image["token_start"],
                              s.image["token_end"] - 1, s.image["grid_rows"] - 1, s.image["grid_cols"] - 1]
                             for s in images]
    experts = dict(got["experts"])
    assert experts["image"] > 0 and experts["text"] > 0
    n_text = len(session.tokens) - len(expected_cells)
    assert got["text_nulls"] == [[n_text]]


def test_segments_record_the_image_and_name_a_thumbnail(recorded):
    trace, session = recorded
    meta = json.loads((trace / "session.json").read_text())
    assert meta["status"] == "complete"
    segs = [s for s in meta["segments"] if s["kind"] == "image"]
    assert [s["name"] for s in segs] == ["wide.png", "odd.png"]  # the broken upload left no segment
    wide, odd = segs
    assert (wide["image"]["width"], wide["image"]["height"]) == (1200, 800)
    assert (odd["image"]["patch_rows"], odd["image"]["patch_cols"], odd["image"]["grid_rows"],
            odd["image"]["grid_cols"]) == (8, 12, 4, 6)
    for seg in segs:
        assert seg["modality"] == "image" and len(seg["image"]["sha256"]) == 64
        assert seg["start"] < seg["image"]["token_start"] < seg["image"]["token_end"] < seg["end"]
        assert seg["thumbnail"] == f"images/{seg['id']}.png"
        with Image.open(trace / seg["thumbnail"]) as thumb:
            assert thumb.format == "PNG" and max(thumb.size) <= 512
    with Image.open(trace / wide["thumbnail"]) as thumb:
        assert thumb.size == (512, 341)
    assert not list((trace / "images").glob(".*"))  # no temporary left behind
    # the project's reader sees the same
    t = workbench.open_trace(trace)
    tok = t.tokens()
    assert int((tok["modality"] == "image").sum()) == sum(s["image"]["token_end"] - s["image"]["token_start"]
                                                         for s in segs)
    assert t.moe_counts_matrix(modality="image").sum() > 0
    assert list(t.segments()["image_grid_cols"].dropna().astype(int)) == [s["image"]["grid_cols"] for s in segs]


def test_cli_run_with_images(tmp_path, capsys):
    for name, (w, h) in {"a.png": (56, 84), "b.png": (61, 45)}.items():
        picture(w, h, "green").save(tmp_path / name)
    trace = tmp_path / "trace"
    args = ["run", "--model", "preset:tiny", "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.png"),
            "--prompt", "what is this?", "--chat", "--max-new-tokens", "2", "--temperature", "0", "--trace", str(trace)]
    assert main(args) == 0
    segs = json.loads((trace / "session.json").read_text())["segments"]
    assert [(s["kind"], s.get("role")) for s in segs[:3]] == [("image", "user"), ("image", "user"), ("turn", "user")]
    assert [s["name"] for s in segs[:2]] == ["a.png", "b.png"]
    capsys.readouterr()
    assert main(["run", "--model", "preset:tiny", "--image", str(tmp_path / "nope.png"), "--prompt", "x"]) == 2
    assert "nope.png" in capsys.readouterr().err


def test_cli_chat_puts_the_images_and_the_prompt_in_one_user_message(tmp_path, capsys):
    """`run --image A --image B --prompt P --chat`: the exact ids of spec sections 8-9, one message."""
    from safetensors.torch import load_file

    picture(56, 84, "green").save(tmp_path / "a.png")  # 4 x 6 patches -> 2 x 3 merged tokens
    picture(61, 45, "red").save(tmp_path / "b.png")  # padded to 84 x 56: 4 x 6 patches -> 2 x 3
    snap = tmp_path / "snap"
    assert main(["run", "--model", "preset:tiny", "--image", str(tmp_path / "a.png"), "--image",
                 str(tmp_path / "b.png"), "--prompt", "what is this?", "--chat", "--max-new-tokens", "1",
                 "--temperature", "0", "--save", str(snap)]) == 0
    tokens = load_file(str(snap / "state.safetensors"))["tokens"].tolist()
    open_, close, sep, end = 256 + 3, 256 + 4, 256 + 5, 256 + 2  # <|open|> <|close|> <|sep|> <|end_of_msg|>
    begin, content, end_media, pad = 256 + 18, 256 + 19, 256 + 20, 256 + 21  # <|media_*|>

    def media(w, h, n):
        return [begin, *f"image {w}x{h}".encode(), content] + [pad] * n + [end_media]

    user = ([open_, *b'message role="user"', sep] + media(56, 84, 6) + media(61, 45, 6) + list(b"what is this?")
            + [close, *b"message", sep, end])
    assistant = [open_, *b'message role="assistant"', sep, open_, *b"think", sep]
    assert tokens[:-1] == user + assistant and len(tokens) == len(user) + len(assistant) + 1
    segs = json.loads((snap / "snapshot.json").read_text())["segments"]
    assert [(s["kind"], s["role"], s["start"], s["end"]) for s in segs[:3]] == [
        ("image", "user", 0, 21 + len(media(56, 84, 6))), ("image", "user", 21 + 20, 21 + 40),
        ("turn", "user", 61, len(user))]


def test_cli_logits_covers_the_expanded_sequence(tmp_path):
    from safetensors.torch import load_file
    import torch
    from engine.vision import expand_media_placeholders, merged_grid, preprocess_image

    picture(56, 84, "red").save(tmp_path / "a.png")
    (tmp_path / "sub").mkdir()
    picture(61, 45, "blue").save(tmp_path / "sub" / "b.png")
    pad = 256 + 21
    ids = [1, 2, pad, 3, pad, 4]
    spec = tmp_path / "ids.json"
    spec.write_text(json.dumps([{"input_ids": ids, "images": ["a.png", "sub/b.png"]}, [5, 6, 7]]))
    out = tmp_path / "logits.safetensors"
    assert main(["logits", "--model", "preset:tiny", "--input-ids", str(spec), "--out", str(out)]) == 0
    got = load_file(str(out))
    model = load_model("preset:tiny")
    processed = [preprocess_image(tmp_path / "a.png"), preprocess_image(tmp_path / "sub" / "b.png")]
    layout = expand_media_placeholders(ids, [merged_grid(p.grid) for p in processed], pad)
    assert got["logits.0"].shape[0] == len(layout.input_ids) == 4 + 6 + 6
    with torch.inference_mode():
        want = model(layout.input_ids[None], image_embeds=torch.cat(model.encode_images(processed)))[0]
    assert np.allclose(got["logits.0"].numpy(), want.numpy(), rtol=0, atol=1e-5)
    assert got["logits.1"].shape[0] == 3
