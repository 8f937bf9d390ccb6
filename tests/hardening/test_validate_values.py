"""Issue 11 item 7: checkpoint values checked in bounded memory (NaN/inf floats, E8M0 0xFF scales)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.presets import get_preset
from engine.weights.safetensors_io import CheckpointFiles
from engine.weights.validate_values import check_values


def _ckpt(tmp_path, tensors):
    d = tmp_path / "ck"
    d.mkdir(exist_ok=True)
    save_file(tensors, d / "model.safetensors")
    return CheckpointFiles.open(d)


def test_clean_tensors_pass(tmp_path):
    files = _ckpt(tmp_path, {"w": torch.randn(64, 8), "b": torch.zeros(()), "e": torch.zeros(0, 4),
                             "x.weight_scale": torch.full((4, 2), 127, dtype=torch.uint8),
                             "x.weight_packed": torch.full((4, 16), 0xFF, dtype=torch.uint8),
                             "ids": torch.arange(5)})
    assert check_values(files) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_and_inf_are_found_with_bounded_chunks(tmp_path, dtype):
    w = torch.randn(1000, 16).to(dtype)
    w[700, 3] = float("nan")
    w[900, 0] = float("inf")
    files = _ckpt(tmp_path, {"model.w": w})
    seen = []
    files.bytes_read = 0
    problems = check_values(files, chunk_bytes=1024, progress=seen.append)
    assert [str(p) for p in problems] == [f"{files.tensors['model.w'].file}: tensor model.w: 2 NaN/inf value(s), "
                                          "first at [700, 3]"]
    assert seen == ["model.w"] and files.bytes_read == w.numel() * w.element_size()


def test_e8m0_nan_scale_byte(tmp_path):
    s = torch.full((8, 4), 120, dtype=torch.uint8)
    s[5, 2] = 0xFF
    files = _ckpt(tmp_path, {"a.weight_scale": s})
    (p,) = check_values(files, chunk_bytes=4)
    assert p.bad == 1 and p.first == (5, 2) and "E8M0 scale byte 0xFF (NaN)" in str(p)


def test_the_config_table_decides_which_bytes_are_scales(checkpoint_dir):
    config = get_preset("tiny", "k3.1")
    files = CheckpointFiles.open(checkpoint_dir("tiny", "k3.1"))
    assert check_values(files, config) == []
