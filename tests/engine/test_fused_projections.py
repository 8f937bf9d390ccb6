"""Fused projections (engine.layers.fused): one matmul for the linears that read one input, with
the checkpoint's parameters as views of the stack (names, state_dict and in-place updates as before)."""

from __future__ import annotations

from collections import Counter

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine import load_model
from engine.decode.step import DecodeStep, decode_forward
from engine.layers.fused import FusedLinears, fused_groups
from engine.session import Session
from engine.weights.write import owned


def linears(n: int = 3, seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(16, 8 + 4 * i, bias=False) for i in range(n)]


def test_fused_equals_separate_and_shares_the_weights():
    lins = linears()
    fused = FusedLinears(*lins)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = [lin.weight @ x.unsqueeze(-1) for lin in lins]
        got = fused(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.squeeze(-1), rtol=1e-6, atol=1e-6)
    stack = fused.weight
    assert stack is not None and all(lin.weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
                                     for lin in lins)
    assert all(isinstance(lin.weight, nn.Parameter) for lin in lins)
    # an in-place update of one weight (load_state_dict copies in place) reaches the stack
    with torch.no_grad():
        lins[1].load_state_dict({"weight": torch.ones_like(lins[1].weight)})
        torch.testing.assert_close(fused(x)[1], x.sum(-1, keepdim=True).expand(2, 5, 12))
    assert fused.weight is stack


def test_moved_weights_are_restacked():
    lins = linears()
    fused = FusedLinears(*lins)
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        fused(x.float())
        for lin in lins:
            lin.double()  # each weight converted on its own: no longer views of the stack
        assert not fused.current()
        got = fused(x)
        assert fused.current() and fused.weight.dtype == torch.float64
        for g, lin in zip(got, lins):
            torch.testing.assert_close(g, x @ lin.weight.t())


def test_gradients_reach_every_weight():
    lins = linears()
    fused = FusedLinears(*lins)
    with torch.no_grad():
        fused(torch.randn(1, 16))  # weights are now views of the stack
    x = torch.randn(4, 16)
    sum(y.sum() for y in fused(x)).backward()
    for lin in lins:
        torch.testing.assert_close(lin.weight.grad, x.sum(0).expand_as(lin.weight))


def test_state_dict_names_unchanged_and_saved_apart(tmp_path):
    model = load_model("preset:tiny:k3.1", seed=1)
    names = list(model.state_dict())
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    assert list(model.state_dict()) == names
    assert fused_groups(model) and all(g.current() for g in fused_groups(model))
    state = {k: owned(v.detach()) for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "m.safetensors"))  # refuses tensors that share a storage
    back = load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


class _CountLinear(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket).split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


def test_decode_step_runs_few_matmuls_per_layer():
    """KDA and MLA layers: 3 projections each (input, second stage, output); latent MoE: 3 (router
    aside: input side fused, up, shared down); the dense layer 2; the head 1. The routed experts of one
    token add theirs: in eager CPU decode each selected expert's matrices are read in place (gate, up,
    down: `engine.ops.moe.grouped`), elsewhere they are batched matmuls, not linears."""
    model = load_model("preset:tiny:k3.1", seed=1)
    s = Session(model)
    s.append(ids=list(range(20)))
    s.prefill()
    DecodeStep.of(model).reserve(s.state, s.length + 1)
    counter = _CountLinear()
    with torch.inference_mode(), counter:
        decode_forward(model, torch.tensor([[3]]), s.state, torch.tensor(s.length))
    c = model.config
    moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    routed = 3 * c.num_experts_per_token * moe
    expected = 3 * c.num_hidden_layers + 3 * moe + 2 * (c.num_hidden_layers - moe) + 1 + routed
    assert counter.counts["linear"] <= expected, counter.counts["linear"]
