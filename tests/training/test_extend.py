"""training.extend: continues a base text run with the vision tower, frozen first, resumable."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from training import extend
from training import state as state_io
from training.model_setup import trainable_model, trained_demo_config


def _tiny(scale: float) -> list[extend.Stage]:
    return [extend.Stage("frozen", 1, 256, 2, 224), extend.Stage("tower", 1, 256, 2, 224)]


def _weights(state_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(state_dir / f"step-{step:07d}" / "model.safetensors"))


def test_tower_frozen_then_trained_and_resumable(base, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(extend, "schedule", _tiny)
    state = tmp_path / "ext"
    args = ["--base", str(base), "--state", str(state), "--out", str(tmp_path / "out"), "--eval-every", "100",
            "--no-final"]
    assert extend.main(args + ["--stop-after", "1"]) == 0
    first = _weights(state, 1)
    start = trainable_model(trained_demo_config(64, vision=True), 0).state_dict()
    base_w = _weights(base, 3)
    tower = [k for k in first if k.startswith("vision.vision_tower.")]
    projector = [k for k in first if k.startswith("vision.mm_projector.")]
    assert tower and projector
    # step 1 ("frozen"): tower and projector are their seeded init, the language model has moved
    assert all(torch.equal(first[k], start[k]) for k in tower + projector)
    assert any(not torch.equal(first[k], base_w[k]) for k in base_w if not k.endswith("e_score_correction_bias"))

    assert extend.main(args) == 0  # resumes at step 1
    second = _weights(state, 2)
    assert any(not torch.equal(second[k], first[k]) for k in tower)
    assert any(not torch.equal(second[k], first[k]) for k in projector)
    rows = list(csv.DictReader(open(state / "loss.csv")))
    assert [r["phase"] for r in rows] == ["frozen", "tower"]
    info = json.loads((state / "step-0000002" / "state.json").read_text())
    assert info["base"]["base_step"] == 3 and info["topk"] == 64


def test_base_of_another_shape_is_refused(tmp_path) -> None:
    model = trainable_model(trained_demo_config(32, vision=True), 0)   # has a tower: not a text-only base
    d = tmp_path / "base"
    state_io.save(d, 1, model, {}, {"seed": 0, "scale": 1.0, "topk": 64})
    target = trainable_model(trained_demo_config(64, vision=True), 0)
    with pytest.raises(SystemExit, match="do not match the text model"):
        extend.load_base(d, target)
