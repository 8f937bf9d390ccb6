"""Issue 42 item 6: `workbench import vllm|sglang` bounds what parsing a capture costs (arrays and
objects, values, nesting, digits; the `.npy` header's size, brackets and digits) before parsing it,
and refuses with one line naming the file: no raw tokenize.TokenError, ValueError or RecursionError."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from apps.cli import main
from engine.errors import InputError
from engine.presets import get_preset
from tests.hardening.conftest import bounded
from workbench.captures import json_cost
from workbench.captures.arrays import encode_npy, npy_array
from workbench.captures.records import parse_records

CONFIG = get_preset("tiny")


def _refused(tmp_path, text: str, words: str, engine: str = "vllm", named: bool = True) -> str:
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(InputError, match=words) as info:
        parse_records(engine, path, CONFIG)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400 and (str(path) in message or not named)
    return message


def test_many_empty_arrays_are_refused_before_they_are_built(tmp_path, monkeypatch):
    monkeypatch.setattr(json_cost, "MAX_PARSED_BYTES", 1 << 20)
    text = "[" + ",".join(["[]"] * 30_000) + "]"  # 90 KB of text: 30,000 lists, 3.4 MB by the estimate
    with bounded(seconds=5, rss_mib=50):
        _refused(tmp_path, text, r"parsing it would build about 3,360,072 bytes of objects \(30,001 arrays")
    _refused(tmp_path, "\n".join("[]" for _ in range(30_000)), "arrays and objects")  # JSON Lines
    _refused(tmp_path, json.dumps({"choices": [{"token_ids": [1] * 30_000}]}), "30,000 values")


def test_the_45_mib_file_of_empty_arrays_stays_within_memory(tmp_path, capsys):
    path = tmp_path / "empties.json"
    path.write_text("[" + ",".join(["[]"] * (45 * (1 << 20) // 3)) + "]")
    with bounded(seconds=60, rss_mib=400):  # the parse alone took 3.1 GB
        assert main(["import", "vllm", str(path), "--model", "preset:tiny", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parsing it would build about" in err and not (tmp_path / "t").exists()


@pytest.mark.parametrize("text, words", [
    ('{"prompt_token_ids": [1' + "0" * 5000 + "]}", "holds a number of 5,001 digits"),
    ('{"prompt_token_ids": [-' + "9" * 30 + "]}", "holds a number of 30 digits"),
    ('{"choices": [{"index": 1e' + "9" * 400 + "}]}", "holds a number of 400 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested 100,000 levels deep"),
    ('{"a":' * 5000 + "1" + "}" * 5000, "nested 5,000 levels deep"),
    ("[" * 100_000, "nested 100,000 levels deep"),  # unbalanced
])
def test_numbers_and_nesting_past_the_limits_are_one_line(tmp_path, text, words):
    _refused(tmp_path, text, words)


def test_strings_do_not_count_as_structure(tmp_path):
    text = json.dumps({"id": "[" * 10_000 + "9" * 100, "choices": [{"token_ids": [1, 2]}],
                       "prompt_token_ids": [1, 2]})
    records = parse_records("vllm", _write(tmp_path, text), CONFIG)
    assert len(records) == 1 and list(records[0].output) == [1, 2]


def _write(tmp_path, text):
    path = tmp_path / "ok.json"
    path.write_text(text)
    return path


def test_a_long_string_token_id_is_shown_short(tmp_path):
    message = _refused(tmp_path, json.dumps({"prompt_token_ids": ["x" * 100_000], "choices": [{"token_ids": []}]}),
                       "record 1.prompt_token_ids.0.: token id 'xxx", named=False)
    assert len(message) < 300


def _npy(header: bytes, data: bytes = b"") -> str:
    """A version 1.0 .npy payload with `header` (padded as NumPy pads it) and `data`, base64."""
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data).decode()


@pytest.mark.parametrize("header, words", [
    (b"{" * 60_000, "header of 60,0.. bytes, more than the 4,096"),
    (b"{" * 4000, "holds 4,000 brackets"),
    (b"(" * 3000, "holds 3,000 brackets"),
    (b"{'descr': '<i4', 'fortran_order': False, 'shape': (((((1,),),),),)}", "holds 6 brackets"),
    (b"{'descr': '<i4', 'fortran_order': False, 'shape': (1" + b"0" * 4000 + b", 4, 2)}", "4,001 digits"),
    (b"{'descr': '<i4', 'fortran_order': False, 'shape': (10, 4, 2), 'x': '''}", "unreadable .npy header"),
    (b"{'descr': '<i4', 'fortran_order': False, 'shape': (-3, 4, 2)}", "negative row count"),
    (b"\xff\xfe{'descr'", "unreadable .npy header"),
])
def test_npy_headers_past_the_limits_are_one_line(header, words):
    with pytest.raises(InputError, match=words) as info:
        npy_array(_npy(header), 100, (4,), 2, 15, "expert ids", "record 1: prompt_routed_experts")
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_an_honest_npy_header_still_reads():
    rows = np.arange(3 * 4 * 2, dtype=np.int32).reshape(3, 4, 2) % 16
    array = npy_array(encode_npy(rows), 100, (4,), 2, 15, "expert ids", "here")
    assert np.array_equal(array.read(0, 3), rows)


def test_a_conversation_longer_than_the_models_context_is_refused_before_it_is_converted(tmp_path):
    n = CONFIG.max_position_embeddings + 1
    message = _refused(tmp_path, json.dumps({"prompt_token_ids": [1] * n, "choices": [{"token_ids": [1]}]}),
                       f"record 1.prompt_token_ids: {n:,} token ids, more than the model's context of", named=False)
    assert "65,536" in message or f"{CONFIG.max_position_embeddings:,}" in message
    half = CONFIG.max_position_embeddings // 2 + 1
    _refused(tmp_path, json.dumps({"input_ids": [1] * half, "output_ids": [1] * half, "meta_info": {}}),
             f"{half:,} prompt and {half:,} output tokens, more than the model's context", engine="sglang", named=False)
