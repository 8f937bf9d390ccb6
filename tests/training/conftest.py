"""Fixtures the training tests share."""

from __future__ import annotations

import pytest

from training import state as state_io
from training.model_setup import trainable_model, trained_demo_config


@pytest.fixture()
def base(tmp_path):
    """A 'finished' base run: the text model's weights saved as `training.demo_model` saves them (what
    `training.extend` and `training.lengthen` start from)."""
    model = trainable_model(trained_demo_config(64), 0)
    d = tmp_path / "base"
    state_io.save(d, 3, model, {}, {"seed": 0, "scale": 1.0, "topk": 64, "commit": "test"})
    return d
