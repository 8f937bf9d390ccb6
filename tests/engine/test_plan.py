"""The per-GPU memory planner: exact against built models at small sizes, the K3.1 Pro verdicts."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.cache import KDAState, state_bytes
from engine.errors import ConfigError, InputError
from engine.parallel.mesh import ParallelContext
from engine.weights.plan import GiB, plan_memory
from engine.presets import get_preset
from apps.cli import main
from apps.cli.plan_cmd import parse_bytes, parse_tokens


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("world", [1, 4])
def test_weights_and_state_match_the_built_rank(world):
    config = get_preset("tiny-tp")
    plan = plan_memory(config, gpus=world, gpu_mem=GiB, context=300, batch=2, dtype=torch.bfloat16)
    model = load_model("preset:tiny-tp", dtype=torch.bfloat16, parallel=ParallelContext.layout(world - 1, world))
    assert plan.weight_bytes == _model_bytes(model)
    assert sum(plan.weights_by_dtype.values()) == plan.weight_bytes
    state = model.empty_state(2, dtype=torch.bfloat16, capacity=300)
    kda_layers = [s for s in state.layers if isinstance(s, KDAState)]
    kda = sum(t.numel() * t.element_size() for s in kda_layers for t in (s.recurrent, s.conv))
    items = {i.name: i.nbytes for i in plan.state}
    assert items["KDA state"] == kda
    cache = state_bytes(config, 2, 300, torch.bfloat16)
    assert items["MLA latent cache"] == cache["mla_latent"] and items["DSA indexer keys"] == cache["indexer_keys"]


def test_k31_pro_needs_more_than_8_h200_and_fits_8_gb300():
    config = get_preset("k3.1-pro")
    h200 = plan_memory(config, gpus=8, gpu_mem=141 * 10 ** 9, context=2 ** 20)
    assert not h200.fits and h200.weight_bytes > 141 * 10 ** 9  # the weights alone overflow
    for gb300 in (288 * 10 ** 9, 288 * GiB):
        assert plan_memory(config, gpus=8, gpu_mem=gb300, context=2 ** 20).fits
    names = {i.name for i in h200.activations}
    assert "DSA indexer scores + top-k" in names  # the buffer that OOMed others is budgeted


def test_bad_layouts_and_sizes_are_refused():
    with pytest.raises(ConfigError, match="not divisible by 7"):
        plan_memory(get_preset("k3.1-pro"), gpus=7, gpu_mem=GiB, context=1024)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        plan_memory(get_preset("tiny"), gpus=1, gpu_mem=GiB, context=10 ** 7)
    assert parse_bytes("288GiB") == 288 * 2 ** 30 and parse_bytes("141 GB") == 141 * 10 ** 9
    assert parse_tokens("1M") == 2 ** 20 and parse_tokens("128k") == 131072 and parse_tokens("500") == 500
    with pytest.raises(InputError):
        parse_bytes("lots")


def test_plan_command_verdicts(capsys):
    args = ["plan", "--preset", "k3.1-pro", "--gpus", "8", "--context", "1M"]
    assert main([*args, "--gpu-mem", "141GB"]) == 1
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT on 8 x 141 GB" in out and "short by" in out and "bfloat16" in out
    assert main([*args, "--gpu-mem", "288GiB"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS on 8 x 309 GB (288.0 GiB)" in out and "MLA latent cache" in out
