"""Per-sequence state as named tensors: `to_tensors()` / `from_tensors()` round trips, copies, checks."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.cache import KDAState, MLACache, ModelState
from engine.errors import InputError
from engine.presets import get_preset
from engine.session import Session


def _filled(config, length: int) -> ModelState:
    state = ModelState.empty(config, 1, capacity=4)
    torch.manual_seed(42)
    for layer in state.layers:
        if isinstance(layer, KDAState):
            layer.recurrent.normal_()
            layer.conv.normal_()
        else:
            layer.reserve(length)
            for t in layer.to_tensors(layer.capacity).values():
                t.normal_()
    state.length = length
    return state


def test_model_state_round_trip_copies_and_keeps_only_consumed_rows() -> None:
    config = get_preset("tiny")
    state = _filled(config, 7)
    tensors = state.to_tensors()
    mla = next(i for i in range(config.num_hidden_layers) if not config.is_kda_layer(i))
    assert tensors[f"layers.{mla}.latent"].shape[1] == 7  # rows [0, length) only
    again = ModelState.from_tensors(tensors, config, 7)
    assert again.length == 7
    for key, t in again.to_tensors().items():
        assert torch.equal(t, tensors[key]), key
        assert t.data_ptr() != tensors[key].data_ptr(), f"{key} shares storage with its source"


def test_from_tensors_names_the_missing_or_misshapen_tensor() -> None:
    config = get_preset("tiny")
    tensors = _filled(config, 5).to_tensors()
    kda = next(i for i in range(config.num_hidden_layers) if config.is_kda_layer(i))
    broken = {k: v for k, v in tensors.items() if k != f"layers.{kda}.conv"}
    with pytest.raises(InputError, match=f"missing tensor layers.{kda}.conv"):
        ModelState.from_tensors(broken, config, 5)
    with pytest.raises(InputError, match="has shape"):
        KDAState.from_tensors({"recurrent": torch.zeros(1), "conv": torch.zeros(1)}, config, 1)
    mla = next(i for i in range(config.num_hidden_layers) if not config.is_kda_layer(i))
    with pytest.raises(InputError, match=f"tensor layers.{mla}.latent has shape"):
        MLACache.from_tensors(tensors, config, mla, 1, 6, prefix=f"layers.{mla}.")  # 5 rows saved, 6 claimed


def test_fork_shares_no_state_and_continues_identically() -> None:
    model = load_model("preset:tiny", seed=1)
    s = Session(model, prefill_chunk=5)
    s.append(ids=list(range(3, 20)))
    s.prefill()
    fork = s.fork()
    assert fork.state_dict()["prefix_sha256"] == s.state_dict()["prefix_sha256"]
    for key, t in fork.state.to_tensors().items():
        assert t.data_ptr() != s.state.to_tensors()[key].data_ptr(), key
    a = [t.id for t in s.generate(6, temperature=0.8, seed=3)]
    b = [t.id for t in fork.generate(6, temperature=0.8, seed=3)]
    assert a == b
