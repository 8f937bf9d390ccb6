"""Whole-model oracle: our engine against transformers' `KimiLinearForCausalLM` (Kimi-Linear layout).

Tiny random transformers models (several configs: low-rank query or plain `q_proj`, different
KDA/MLA layer patterns, grouped routing, several expert counts and top-k, odd sequence lengths) are
built, saved with `save_pretrained` and run by `tests/oracles/hf_kimi_linear.py` in one subprocess
(fla blocked there, see spec section 11; importing transformers is slow, so all cases share it).
Here the saved directories are loaded with `engine.load_model` and compared in fp32: logits and
every decoder layer's output (the residual stream before the final norm), relative error <= 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from tests.helpers import relative_error

ORACLE = Path(__file__).resolve().parents[1] / "oracles" / "hf_kimi_linear.py"
TOLERANCE = 1e-5

_COMMON = dict(vocab_size=101, hidden_size=44, intermediate_size=56, moe_intermediate_size=18,
               kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10,
               initializer_range=0.06, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _layers(n: int, full: list[int], head_dim: int, heads: int) -> dict:
    """linear_attn_config with 1-indexed lists (full attention at `full`, KDA elsewhere)."""
    return {"head_dim": head_dim, "num_heads": heads, "short_conv_kernel_size": 4,
            "full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full]}


CASES = [
    # low-rank query, MLA in the middle, one dense layer, flat routing
    {"name": "qlora-mla3of5-e8k2", "seed": 42, "seq_lens": [1, 37, 130],
     "config": {**_COMMON, "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 3,
                "q_lora_rank": 24, "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "linear_attn_config": _layers(5, [3], head_dim=16, heads=3)}},
    # direct q_proj, MLA first and last, two dense layers, grouped routing (4 groups, keep 2)
    {"name": "qproj-mla1+4-e12k3-grouped", "seed": 43, "seq_lens": [77],
     "config": {**_COMMON, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
                "q_lora_rank": None, "num_local_experts": 12, "num_experts_per_tok": 3, "n_shared_experts": 2,
                "n_group": 4, "topk_group": 2, "first_k_dense_replace": 2,
                "linear_attn_config": _layers(4, [1, 4], head_dim=12, heads=2)}},
    # KDA-heavy, many experts, top-4 out of one group of two
    {"name": "qlora-mla2of3-e16k4-grouped", "seed": 44, "seq_lens": [65],
     "config": {**_COMMON, "num_hidden_layers": 3, "num_attention_heads": 3, "num_key_value_heads": 3,
                "q_lora_rank": 16, "num_local_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
                "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                "linear_attn_config": _layers(3, [2], head_dim=20, heads=2)}},
]

PAIRS = [(case["name"], T) for case in CASES for T in case["seq_lens"]]


@pytest.fixture(scope="module")
def hf_references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the transformers oracle once for every case; returns the directory holding them."""
    out = tmp_path_factory.mktemp("hf-kimi-linear")
    cases_file = out / "cases.json"
    cases_file.write_text(json.dumps(CASES))
    proc = subprocess.run([sys.executable, str(ORACLE), str(cases_file), str(out)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"transformers oracle failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


@pytest.fixture(scope="module")
def engine_models(hf_references: Path) -> dict[str, torch.nn.Module]:
    return {case["name"]: load_model(hf_references / case["name"]) for case in CASES}


@pytest.mark.parametrize(("name", "T"), PAIRS, ids=[f"{n}-T{t}" for n, t in PAIRS])
def test_logits_and_layers_match_transformers(hf_references: Path, engine_models, name: str, T: int) -> None:
    refs = load_file(str(hf_references / name / "reference.safetensors"))
    model = engine_models[name]
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(refs[f"ids_T{T}"], layer_outputs=outputs)
    n_layers = model.config.num_hidden_layers
    assert len(outputs) == n_layers
    errors = {f"layer{i}": relative_error(outputs[i], refs[f"layer{i}_T{T}"]) for i in range(n_layers)}
    errors["logits"] = relative_error(logits, refs[f"logits_T{T}"])
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"relative errors above {TOLERANCE}: {bad} (all: {errors})"


def test_engine_reads_the_saved_config(engine_models) -> None:
    """The transformers-written config.json parses into the layout the case asked for."""
    for case in CASES:
        c = engine_models[case["name"]].config
        raw = case["config"]
        lin = raw["linear_attn_config"]
        assert c.variant == "kimi-linear"
        assert c.mla_layers == tuple(i - 1 for i in lin["full_attn_layers"])
        assert c.q_lora_rank == raw["q_lora_rank"]
        assert (c.num_expert_group, c.topk_group) == (raw["n_group"], raw["topk_group"])
        assert c.first_k_dense_replace == raw["first_k_dense_replace"]
        assert (c.num_experts, c.num_experts_per_token) == (raw["num_local_experts"], raw["num_experts_per_tok"])
