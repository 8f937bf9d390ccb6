"""Checkpoint I/O: the writer's real layout, lazy loading, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import load_model
from engine.errors import CheckpointError, ConfigError
from engine.weights.safetensors_io import INDEX_FILE


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def shard_holding(ckpt, name: str):
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    return ckpt / weight_map[name]


@pytest.mark.parametrize("variant", ["k3.1", "k3", "kimi-linear"])
def test_written_checkpoint_loads_bit_exact_like_the_preset(checkpoint_dir, variant):
    ckpt = checkpoint_dir("tiny", variant, seed=3, dtype=torch.bfloat16, shards=3)
    assert len(list(ckpt.glob("model-*-of-00003.safetensors"))) == 3
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == ("kimi_linear" if variant == "kimi-linear" else "kimi_k3")
    ids = torch.randint(0, 512, (1, 33), generator=torch.Generator().manual_seed(0))
    from_disk = load_model(ckpt)(ids)
    in_memory = load_model(f"preset:tiny:{variant}", seed=3)(ids)
    assert torch.equal(from_disk, in_memory)


def test_real_layout_names_and_mxfp4_pairs(checkpoint_dir):
    ckpt = checkpoint_dir("tiny", "k3.1", seed=0)
    names = set(json.loads((ckpt / INDEX_FILE).read_text())["weight_map"])
    prefix = "language_model.model.layers.1."
    for name in ("self_attn.q_conv1d.weight", "self_attn.A_log", "self_attn.g_proj.weight",
                 "block_sparse_moe.experts.7.w2.weight_packed", "block_sparse_moe.experts.7.w2.weight_scale",
                 "block_sparse_moe.routed_expert_norm.weight", "self_attention_res_proj.weight"):
        assert prefix + name in names
    assert "language_model.model.layers.2.self_attn.indexer.wq_b.weight" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names
    packed = prefix + "block_sparse_moe.experts.0.w1.weight_packed"
    assert shard_holding(ckpt, packed) == shard_holding(ckpt, packed.replace("packed", "scale"))
    with safe_open(str(shard_holding(ckpt, packed)), "pt") as f:
        assert f.get_tensor(packed).dtype == torch.uint8


def test_experts_stay_packed_in_memory():
    model = load_model("preset:tiny")
    experts = model.model.layers[1].block_sparse_moe.experts
    assert experts.w1_packed.dtype == torch.uint8 and experts.w1_scale.dtype == torch.uint8
    assert not any("w1" == n.split(".")[-1] for n, _ in model.named_parameters())


def test_partial_expert_load_reads_only_held_experts(checkpoint_dir):
    ckpt = checkpoint_dir("tiny", "k3.1", seed=0)
    full = load_model(ckpt)
    half = load_model(ckpt, expert_ids=[1, 3, 5])
    a = full.model.layers[2].block_sparse_moe.experts
    b = half.model.layers[2].block_sparse_moe.experts
    assert b.w2_packed.shape[0] == 3
    assert torch.equal(b.w2_packed[1], a.w2_packed[3])


def test_truncated_shard_is_named(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor \S+ needs bytes"):
        load_model(ckpt)


def test_missing_shard_is_named(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard file is missing .* e\.g\. language_model\."):
        load_model(ckpt)


def rewrite_tensor(ckpt, name, fn):
    shard = shard_holding(ckpt, name)
    tensors = load_file(str(shard))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(shard))
    return shard


def test_wrong_shape_and_dtype_are_named(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    shape_name = "language_model.model.layers.0.self_attn.q_proj.weight"
    dtype_name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    rewrite_tensor(ckpt, shape_name, lambda t: t[:-1])
    rewrite_tensor(ckpt, dtype_name, lambda t: t.float())
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt)
    msg = str(info.value)
    assert f"tensor {shape_name} has shape [31, 64] but config.json implies [32, 64]" in msg
    assert f"tensor {dtype_name} has dtype F32; MXFP4 scale tensors are U8" in msg


def test_missing_and_unexpected_tensors_are_listed(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    name = "language_model.model.norm.weight"
    shard = shard_holding(ckpt, name)
    tensors = load_file(str(shard))
    tensors["language_model.model.extra.weight"] = tensors.pop(name)
    save_file(tensors, str(shard))
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"]["language_model.model.extra.weight"] = index["weight_map"].pop(name)
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt)
    assert f"missing tensor {name}" in str(info.value)
    assert "unexpected tensor language_model.model.extra.weight" in str(info.value)


def test_nan_e8m0_scale_is_rejected(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    name = "language_model.model.layers.3.block_sparse_moe.experts.2.w3.weight_scale"

    def poison(t):
        t = t.clone()
        t[4, 0] = 0xFF
        return t

    shard = rewrite_tensor(ckpt, name, poison)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor {name}: E8M0 scale byte 0xFF \(NaN\) at \[4, 0\]"):
        load_model(ckpt)


def test_unknown_architecture_and_contradicting_config(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="unknown architecture: model_type='llama'"):
        load_model(ckpt)
    cfg["text_config"]["num_attention_heads"] = 4  # the tensors were written for 2 heads
    cfg["text_config"]["num_key_value_heads"] = 4
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"q_b_proj.weight has shape \[48, 32\] but config.json implies \[96, 32\]"):
        load_model(ckpt)


def test_corrupt_header_and_not_a_checkpoint(checkpoint_dir, tmp_path):
    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    raw = shard.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    shard.write_bytes(raw[:8] + b"{" * header_len + raw[8 + header_len:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt safetensors header"):
        load_model(ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(empty)


def test_cli_reports_errors_in_one_line(checkpoint_dir, tmp_path, capsys):
    from apps.cli import main

    ckpt = copy_checkpoint(checkpoint_dir("tiny", "k3.1"), tmp_path / "ck")
    sorted(ckpt.glob("model-*.safetensors"))[0].unlink()
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    code = main(["logits", "--model", str(ckpt), "--input-ids", str(ids), "--out", str(tmp_path / "o.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
    ids.write_text('[[1, "x"]]')
    assert main(["logits", "--model", "preset:tiny", "--input-ids", str(ids), "--out", str(tmp_path / "o")]) == 2
