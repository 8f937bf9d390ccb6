"""The decode step reads the lm_head and the one-row output projections input-major
(`engine.decode.layouts`): same values, same names, re-laid again when a weight is replaced."""

from __future__ import annotations

import torch
from torch import nn

from engine import load_model
from engine.decode.layouts import InputMajorWeights
from tests.helpers import assert_close, decode_logits


def _input_major(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0])


def test_static_step_relays_weights_and_keeps_their_values():
    model = load_model("preset:tiny:kimi-linear", seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    eager = decode_logits(model, ids, 8, False)
    static = decode_logits(model, ids, 8, "static")
    assert_close(static, eager, "static decode over input-major weights")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "kv_b_proj"))
    assert _input_major(model.lm_head.weight) and _input_major(attn.o_proj.weight)
    assert attn.kv_b_proj.weight.is_contiguous()  # split per head by MLA: left as it is
    down = model.model.layers[0].mlp.down_proj.weight  # fewer outputs than inputs: slower input-major
    assert down.is_contiguous()


def test_a_replaced_weight_is_relaid_and_changes_the_guard_key():
    model = load_model("preset:tiny:kimi-linear", seed=2)
    layouts = InputMajorWeights(model)
    first = layouts.refresh()
    assert len(layouts) and _input_major(model.lm_head.weight)
    assert layouts.refresh() == first  # nothing moved: nothing re-laid
    # the old weight is kept alive: freed, its storage could be reused at the same address by the re-laid
    # copy, and a key of equal pointers would then be a correct key for an equal layout, not a test of it
    old = model.lm_head.weight
    model.lm_head.weight = nn.Parameter(old.detach().contiguous())
    second = layouts.refresh()
    assert second != first and _input_major(model.lm_head.weight)


def test_a_tied_weight_is_left_alone():
    model = load_model("preset:tiny:kimi-linear", seed=2)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one parameter read by two modules
    InputMajorWeights(model).refresh()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.is_contiguous()

