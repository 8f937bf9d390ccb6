"""Config parsing for the three layouts, validation messages that name the field, and the census."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import config_to_hf, get_preset, parse_config
from engine.weights.census import census
from engine.errors import ConfigError
from engine.model import KimiForCausalLM


@pytest.mark.parametrize("preset", ["tiny", "demo", "k3.1-pro"])
@pytest.mark.parametrize("variant", ["k3.1", "k3", "kimi-linear"])
def test_round_trip_through_config_json(preset, variant):
    config = get_preset(preset, variant)
    assert parse_config(config_to_hf(config)) == config


def test_k31_layout_is_nested_and_one_indexed():
    hf = config_to_hf(get_preset("k3.1-pro"))
    assert hf["model_type"] == "kimi_k3" and hf["architectures"] == ["KimiK31ForConditionalGeneration"]
    text = hf["text_config"]
    assert text["model_type"] == "kimi_linear"
    full = text["linear_attn_config"]["full_attn_layers"]
    assert full[:3] == [4, 8, 12] and full[-2:] == [92, 93] and len(full) == 24
    assert len(text["linear_attn_config"]["kda_layers"]) == 69
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert config_to_hf(get_preset("k3.1-pro", "k3"))["architectures"] == ["KimiK3ForConditionalGeneration"]


def test_dsa_key_spellings_and_placement():
    hf = config_to_hf(get_preset("tiny"))
    dsa = hf["text_config"].pop("dsa_config")
    hf["dsa_config"] = {"n_heads": dsa["index_n_heads"], "head_dim": dsa["index_head_dim"], "topk": 16}
    parsed = parse_config(hf)
    assert parsed.dsa is not None and parsed.dsa.topk == 16
    assert parsed.dsa.layers == parsed.mla_layers  # absent list: every full-attention layer
    hf["dsa_config"]["indexer_layers"] = [3]
    assert parse_config(hf).dsa.layers == (2,)


def test_transformers_saved_kimi_linear_config():
    """What transformers' save_pretrained writes: layer_types, renamed MoE keys, model_max_length."""
    raw = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
        "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True, "num_expert_group": 1,
        "topk_group": 1, "routed_scaling_factor": 2.446, "hidden_act": "silu", "model_max_length": 4096,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    }
    c = parse_config(raw)
    assert c.variant == "kimi-linear" and c.kda_layers == (0, 1, 3) and c.mla_layers == (2,)
    assert c.max_position_embeddings == 4096 and c.q_lora_rank is None
    assert c.kda_gate_lower_bound is None and not c.kda_full_rank_gate and c.attn_res_block_size is None
    del raw["linear_attn_config"]["kda_layers"], raw["linear_attn_config"]["full_attn_layers"]
    assert parse_config(raw).mla_layers == (2,)  # from layer_types


def broken(mutate) -> dict:
    hf = copy.deepcopy(config_to_hf(get_preset("tiny")))
    mutate(hf["text_config"], hf)
    return hf


@pytest.mark.parametrize("mutate,message", [
    (lambda t, h: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5]),
     r"layers \[3\] \(1-indexed\) are listed as both KDA and full attention"),
    (lambda t, h: t["linear_attn_config"].update(kda_layers=[1, 2, 4]),
     r"layers \[5\] \(1-indexed\) are in neither list"),
    (lambda t, h: t["linear_attn_config"].update(full_attn_layers=[0, 3]), r"outside 1\.\.6"),
    (lambda t, h: t.update(hidden_act="gelu"), r"`hidden_act`: unknown activation 'gelu'"),
    (lambda t, h: t["dsa_config"].update(index_rope=True), r"indexer RoPE is not supported"),
    (lambda t, h: t["dsa_config"].update(dsa_layers=[1]), r"not full-attention layers"),
    (lambda t, h: t.update(num_experts_per_token=99), r"`num_experts_per_token`"),
    (lambda t, h: t.update(mla_use_nope=False), r"`mla_use_nope`"),
    (lambda t, h: t.update(moe_router_activation_func="softmax"), r"`moe_router_activation_func`"),
    (lambda t, h: t["quantization_config"].update(format="nvfp4-pack-quantized"), r"unsupported quantization"),
    (lambda t, h: t.pop("hidden_size"), r"`hidden_size` is missing"),
    (lambda t, h: t.update(vocab_size="big"), r"`vocab_size`: expected an integer"),
    (lambda t, h: h.update(model_type="gpt2"), r"unknown architecture"),
    (lambda t, h: t["linear_attn_config"].update(gate_lower_bound=2.0), r"must be negative"),
])
def test_validation_names_the_field(mutate, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(broken(mutate))


def test_k31_pro_census_matches_the_model_card():
    c = census(get_preset("k3.1-pro"))
    assert abs(c.total / 1e12 - 2.78) < 0.01
    assert abs(c.active / 1e9 - 104) < 1.0
    assert abs(c.vision / 1e9 - 0.45) < 0.01
    assert abs(c.total_bytes / 1e12 - 1.56) < 0.01  # published 1,561.22 GB


@pytest.mark.parametrize("preset", ["tiny", "k3.1-pro"])
def test_meta_model_has_the_census_parameter_count(preset):
    """Build at true dimensions on the meta device: parameters + packed experts match the table."""
    config = get_preset(preset)
    with torch.device("meta"):
        model = KimiForCausalLM(config)
    logical = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("_packed"):
            logical += t.numel() * 2
        elif not name.endswith("_scale"):
            logical += t.numel()
    counts = census(config)
    # the model owns its vision tower (replicated); the census counts it apart from the text total
    assert logical == counts.total + counts.vision
