"""Issue 11 items 8, 11, 12 (checkpoint files): a malformed index, shards outside the checkpoint, shards
that are directories or FIFOs, malformed header entries: one CheckpointError naming the file."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import CheckpointError
from engine.weights.safetensors_io import INDEX_FILE, CheckpointFiles, read_header


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)}, d / "model-00001.safetensors")
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors",
                                                           "b": "model-00001.safetensors"}}))
    return d


def _index(d, weight_map):
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


def test_the_fixture_opens(ckpt):
    assert CheckpointFiles.open(ckpt).get("b").sum() == 4


@pytest.mark.parametrize("weight_map, words", [
    (["model-00001.safetensors"], "weight_map must be an object"),
    ({"a": 3}, r"weight_map\['a'\] must be a shard file name, got 3"),
    ({"a": ["x"]}, r"weight_map\['a'\] must be a shard file name"),
    ({"a": None}, r"weight_map\['a'\] must be a shard file name"),
    ({"a": ""}, r"weight_map\['a'\] must be a shard file name"),
    ({"a": "../../outside.safetensors"}, "points outside the checkpoint directory"),
    ({"a": "/etc/passwd"}, "points outside the checkpoint directory"),
    ({"a": "sub/../../x.safetensors"}, "points outside the checkpoint directory"),
])
def test_malformed_weight_maps(ckpt, weight_map, words):
    _index(ckpt, weight_map)
    with pytest.raises(CheckpointError, match=words) as info:
        CheckpointFiles.open(ckpt)
    assert INDEX_FILE in str(info.value) and "\n" not in str(info.value)


def test_an_index_that_is_not_json_or_has_no_weight_map(ckpt):
    (ckpt / INDEX_FILE).write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="corrupt index"):
        CheckpointFiles.open(ckpt)
    (ckpt / INDEX_FILE).write_text("[1]")
    with pytest.raises(CheckpointError, match="corrupt index"):
        CheckpointFiles.open(ckpt)


def test_an_explicit_symlink_inside_the_checkpoint_is_allowed(ckpt, tmp_path):
    # the Hugging Face cache: snapshots/<rev>/model.safetensors -> ../../blobs/<sha>
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(ckpt / "model-00001.safetensors", blobs / "abc")
    os.symlink(blobs / "abc", ckpt / "model-00001.safetensors")
    assert CheckpointFiles.open(ckpt).get("a").shape == (2, 3)


def test_a_directory_or_fifo_where_a_shard_is_expected(ckpt):
    shard = ckpt / "model-00001.safetensors"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not a regular file"):
        CheckpointFiles.open(ckpt)
    if hasattr(os, "mkfifo"):
        shard.rmdir()
        os.mkfifo(shard)
        with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
            CheckpointFiles.open(ckpt)
    (ckpt / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match="not a regular file"):
        CheckpointFiles.open(ckpt)  # found by the *.safetensors glob instead of the index


def _raw_shard(path, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]},
    {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": 5, "data_offsets": [0, 4]},
    "nonsense",
])
def test_malformed_header_entries(tmp_path, entry):
    shard = tmp_path / "x.safetensors"
    _raw_shard(shard, {"t": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"x.safetensors: tensor t: malformed header entry"):
        read_header(shard)


def test_a_header_of_huge_dimensions_is_refused_without_allocating(tmp_path):
    shard = tmp_path / "x.safetensors"
    _raw_shard(shard, {"t": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(CheckpointError, match="header says 4 bytes"):
        read_header(shard)


def test_a_tensor_name_with_a_newline_keeps_the_message_on_one_line(tmp_path):
    # found by test_fuzz_checkpoint (long profile)
    shard = tmp_path / "x.safetensors"
    _raw_shard(shard, {"a\nb": {"dtype": "F32", "shape": [], "data_offsets": []}})
    with pytest.raises(CheckpointError, match=r"tensor 'a\\nb': malformed") as info:
        read_header(shard)
    assert "\n" not in str(info.value)
