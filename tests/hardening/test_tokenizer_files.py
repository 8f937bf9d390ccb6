"""Issue 11 items 11, 12 (tokenizer files): binary or incomplete tiktoken.model, bad tokenizer_config.json,
a missing tiktoken.model beside its tokenizer_config.json: one CheckpointError naming the file."""

from __future__ import annotations

import base64
import json
import os

import pytest

from engine.errors import CheckpointError
from engine.tokenizer import Tokenizer, write_byte_level_tokenizer


@pytest.fixture()
def tok_dir(tmp_path):
    write_byte_level_tokenizer(tmp_path)
    return tmp_path


def _lines(d):
    return (d / "tiktoken.model").read_text().splitlines()


def test_the_written_tokenizer_loads_and_round_trips(tok_dir):
    tok = Tokenizer.load(tok_dir)
    assert tok.decode(tok.encode("héllo <|open|>")) == "héllo <|open|>"


def test_a_binary_tiktoken_model(tok_dir):
    (tok_dir / "tiktoken.model").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match=r"tiktoken.model: not a tiktoken.model text file"):
        Tokenizer.load(tok_dir)


def test_one_byte_without_a_rank_is_refused_at_load_not_a_panic_on_encode(tok_dir):
    # drop the byte "A" and renumber, so ranks stay dense: tiktoken would panic encoding "A"
    kept = [line.split()[0] for line in _lines(tok_dir) if base64.b64decode(line.split()[0]) != b"A"]
    kept.append(base64.b64encode(b"AB").decode())
    (tok_dir / "tiktoken.model").write_text("\n".join(f"{t} {i}" for i, t in enumerate(kept)) + "\n")
    with pytest.raises(CheckpointError, match=r"1 single byte\(s\) have no rank \(e.g. 0x41\)"):
        Tokenizer.load(tok_dir)


@pytest.mark.parametrize("line, words", [
    ("QQ== -1", "expected `base64-token rank`"),
    ("QQ== 1e3", "expected `base64-token rank`"),
    ("!!! 3", "expected `base64-token rank`"),
    (" 3", "expected `base64-token rank`"),
    ("QUI= 99999999999999999999", "ranks must be 0..256 without gaps"),
])
def test_malformed_rank_lines(tok_dir, line, words):
    (tok_dir / "tiktoken.model").write_text("\n".join(_lines(tok_dir) + [line]) + "\n")
    with pytest.raises(CheckpointError, match=words):
        Tokenizer.load(tok_dir)


def test_a_token_listed_twice(tok_dir):
    lines = _lines(tok_dir)
    (tok_dir / "tiktoken.model").write_text("\n".join(lines + [f"{lines[0].split()[0]} 256"]) + "\n")
    with pytest.raises(CheckpointError, match="listed twice"):
        Tokenizer.load(tok_dir)


@pytest.mark.parametrize("decoder, words", [
    ([1, 2], "added_tokens_decoder must be an object"),
    ({"300": "[BOS]"}, "needs a decimal id and a string content"),
    ({"x": {"content": "[BOS]"}}, "needs a decimal id"),
    ({"300": {"content": 5}}, "string content"),
    ({str(2 ** 40): {"content": "[BOS]"}}, "beyond the vocabulary"),
    ({"512": {"content": "[BOS]"}}, r"ids \[512\] are beyond the vocabulary \(the 256 special ids are 256..511\)"),
    ({"300": {"content": "a"}, "301": {"content": "a"}}, None),
])
def test_bad_added_tokens_decoder(tok_dir, decoder, words):
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    if words is None:
        Tokenizer.load(tok_dir)  # a repeated content keeps the last id (as tiktoken would)
        return
    with pytest.raises(CheckpointError, match=words) as info:
        Tokenizer.load(tok_dir)
    assert "tokenizer_config.json" in str(info.value)


def test_tokenizer_config_not_json_or_not_utf8(tok_dir):
    (tok_dir / "tokenizer_config.json").write_bytes(b"\xff{")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: cannot read"):
        Tokenizer.load(tok_dir)


def test_missing_tiktoken_model_beside_its_config_is_refused(tok_dir):
    (tok_dir / "tiktoken.model").unlink()
    with pytest.raises(CheckpointError, match="tiktoken.model: tokenizer file is missing although"):
        Tokenizer.for_model(tok_dir, 512)
    (tok_dir / "tokenizer_config.json").unlink()
    assert Tokenizer.for_model(tok_dir, 512) is not None  # no tokenizer files at all: byte-level preset


def test_tokenizer_files_that_are_directories_or_fifos(tok_dir):
    (tok_dir / "tiktoken.model").unlink()
    (tok_dir / "tiktoken.model").mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not a regular file"):
        Tokenizer.load(tok_dir)
    if hasattr(os, "mkfifo"):
        (tok_dir / "tiktoken.model").rmdir()
        os.mkfifo(tok_dir / "tiktoken.model")
        with pytest.raises(CheckpointError, match="is a FIFO"):
            Tokenizer.load(tok_dir)
