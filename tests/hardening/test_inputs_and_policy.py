"""Issue 11 item 11: token-id files (`logits --input-ids`) and policy files with wrong types or sizes."""

from __future__ import annotations

import json
import os

import pytest

from engine.errors import InputError
from engine.io.inputs import read_id_lists
from workbench.recorders.policy import load_policy


@pytest.mark.parametrize("content, words", [
    ([[1, 2 ** 70]], r"entry \[0\]\[1\] = 1.181e\+21 is not a token id"),
    ([[1, -1]], r"entry \[0\]\[1\] = -1 is not a token id"),
    ([[1, "x"]], r"entry \[0\]\[1\] = 'x' is not an integer token id"),
    ([[1, True]], "is not an integer token id"),
    ([[1, 2.0]], "is not an integer token id"),
    ([[]], "entry 0 is not a non-empty list"),
    ([], "expected a non-empty JSON list"),
    ({"ids": [1]}, "expected a non-empty JSON list"),
])
def test_bad_token_id_files(tmp_path, content, words):
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(content))
    with pytest.raises(InputError, match=words) as info:
        read_id_lists(f)
    assert str(f) in str(info.value)


def test_token_id_file_that_is_missing_a_directory_or_binary(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_id_lists(tmp_path / "nope.json")
    with pytest.raises(InputError, match="is a directory"):
        read_id_lists(tmp_path)
    (tmp_path / "b.json").write_bytes(b"\xff\x00")
    with pytest.raises(InputError, match="not valid JSON"):
        read_id_lists(tmp_path / "b.json")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(InputError, match="is a FIFO"):
            read_id_lists(tmp_path / "fifo")


def test_the_cli_reads_ids_through_the_checked_reader(tmp_path):
    from engine.io.inputs import read_sequences as cli_reader  # what `workbench logits` calls
    f = tmp_path / "ids.json"
    f.write_text(json.dumps([[1, 2 ** 70]]))
    with pytest.raises(InputError, match="is not a token id"):
        cli_reader(f)


@pytest.mark.parametrize("fields, words", [
    ({"dsa_bin_tokens": "256"}, "`dsa_bin_tokens` must be an integer, got '256'"),
    ({"dsa_bin_tokens": 2 ** 40}, "`dsa_bin_tokens` must be an integer"),
    ({"dsa_bin_tokens": 0}, "`dsa_bin_tokens` must be >= 1"),
    ({"dsa_scores": "yes"}, "`dsa_scores` must be true or false"),
    ({"kda_extras": 1}, "`kda_extras` must be true or false"),
    ({"flush_seconds": "1"}, "`flush_seconds` must be a finite number"),
    ({"flush_seconds": float("inf")}, "`flush_seconds` must be a finite number"),
    ({"mark_positions": 5}, "`mark_positions` must be a list"),
    ({"mark_positions": [1, "x"]}, "`mark_positions` must be a list of positions"),
    ({"mark_positions": [-1]}, "`mark_positions` must be a list of positions"),
    ({"mark_segments": [1]}, "`mark_segments` must be a list of segment names"),
    ({"mark_segments": "doc"}, "`mark_segments` must be a list"),
    ({"nope": 1}, "unknown policy fields"),
])
def test_policy_files_with_wrong_types(tmp_path, fields, words):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(fields))
    with pytest.raises(InputError, match=words) as info:
        load_policy(str(f))
    assert "\n" not in str(info.value)
    if "unknown" not in words:
        assert str(f) in str(info.value)
    with pytest.raises(InputError, match=words):
        load_policy(fields)


def test_a_good_policy_file_and_a_non_utf8_one(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"dsa_bin_tokens": 64, "mark_positions": [3], "flush_seconds": 2}))
    p = load_policy(str(f))
    assert p.dsa_bin_tokens == 64 and p.mark_positions == (3,) and p.name == "mine"
    f.write_bytes(b"\xff{")
    with pytest.raises(InputError, match="not UTF-8 JSON"):
        load_policy(str(f))


def test_prompt_files(tmp_path):
    from engine.io.inputs import read_prompt_file
    f = tmp_path / "p.txt"
    f.write_text("héllo")
    assert read_prompt_file(f) == "héllo"
    with pytest.raises(InputError, match="is a directory, not a regular file"):
        read_prompt_file(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        read_prompt_file(tmp_path / "nope")
    f.write_bytes(b"ab\xff")
    with pytest.raises(InputError, match=r"not UTF-8 text \(byte 2\)"):
        read_prompt_file(f)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(InputError, match="is a FIFO"):
            read_prompt_file(tmp_path / "fifo")
