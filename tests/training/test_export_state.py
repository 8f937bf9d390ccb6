"""The training program's export (MXFP4 experts, real layout, loads with engine.load_model, same
function) and its resumable state (safetensors + JSON, atomic pointer)."""

from __future__ import annotations

import json

import torch

from engine import load_model
from engine.ops.mxfp4 import reference as mxfp4
from training import state as state_io
from training.model_setup import export, trainable_model, trained_demo_config


def test_export_loads_and_computes_the_trained_function(tmp_path) -> None:
    torch.manual_seed(0)
    config = trained_demo_config()
    model = trainable_model(config, seed=3)
    with torch.no_grad():  # what the checkpoint stores: bf16 floats, MXFP4 experts
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(mxfp4.dequantize(*mxfp4.quantize(p)))
            elif not name.endswith(("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")):
                p.copy_(p.to(torch.bfloat16).float())
    out = export(model, config, tmp_path / "ckpt")
    loaded = load_model(out)
    assert loaded.config.expert_format == "mxfp4" and loaded.config.dsa.topk == 64
    assert (out / "tiktoken.model").exists()
    ids = torch.randint(0, 256, (1, 96))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=1e-4, atol=1e-4)


def test_state_roundtrip_and_pointer(tmp_path) -> None:
    config = trained_demo_config()
    model = trainable_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (1, 32))).sum().backward()
    opt.step()
    d = state_io.save(tmp_path, 5, model, {"main": opt}, {"seed": 0})
    state_io.save(tmp_path, 10, model, {"main": opt}, {"seed": 0})
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 10
    assert not d.exists() or len(list(tmp_path.glob("step-*"))) <= 2
    other = trainable_model(config, seed=1)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    info = state_io.load(state_io.latest(tmp_path), other, {"main": opt2})
    assert info["step"] == 10
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    p = next(iter(model.parameters()))
    q = next(iter(other.parameters()))
    assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
