"""The trained demo model's configuration, its trainable build and its export to the real layout.

The architecture is the `demo` preset's (K3.1: KDA + gated MLA with the DSA indexer, latent MoE with
SiTU experts, Block Attention Residuals, MXFP4 routed experts on disk), scaled down so it trains on
a 2-core CPU. Training runs the engine's own `KimiForCausalLM` with `expert_format="dense"`, whose
routed experts are ordinary parameters; `export` quantizes them to MXFP4 and writes the checkpoint
with `engine.weights.write.write_checkpoint`, so what users load is exactly what was evaluated.

With `trained_demo_config(vision=True)` the model carries a small MoonViT-V2 tower
(`trained_demo_vision_config`: 8-px patches, so a 64 x 64 picture is 8 x 8 patches = 16 language-model
tokens); it is trained, exported and loaded like every other tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine.config import ModelConfig, VisionConfig
from engine.model import KimiForCausalLM
from engine.presets import _k3_family
from engine.ops.mxfp4 import reference as mxfp4
from engine.builtin import model_dir
from engine.weights.load import fill, load_model
from engine.weights.names import TensorSpec
from engine.weights.random_init import RandomSource, storage_dtype
from engine.weights.write import write_checkpoint


def trained_demo_vision_config(text_hidden: int = 128) -> VisionConfig:
    """The trained demo's tower: width 64, 2 blocks of 2 heads (head dim 32), 8-px patches and an
    8 x 8 position table, so the 64 x 64 training pictures (`training.image_tasks`) use the table
    as is and take 4 x 4 = 16 merged tokens; larger images read the table resized, as usual.
    `text_hidden`: the language model's width, which the projector maps to."""
    return VisionConfig(patch_size=8, hidden_size=64, num_layers=2, num_heads=2, qkv_hidden_size=64,
                        intermediate_size=128, pos_emb_height=8, pos_emb_width=8, text_hidden_size=text_hidden)


def trained_demo_config(topk: int = 64, vision: bool = False) -> ModelConfig:
    """6 layers (4 KDA + 2 gated DSA/MLA at layers 3 and 6, 1-indexed), hidden 128, 16 latent
    experts (top-2) + 1 shared, AttnRes blocks of 2, byte-level vocabulary, MXFP4 experts; with
    `vision`, the `trained_demo_vision_config` tower."""
    return _k3_family(vocab_base=256, hidden=128, n_layers=6, full_attn_every=3, heads=4, q_lora=64, kv_lora=64,
                      nope=32, rope=16, v_dim=32, kda_heads=2, kda_dim=64, idx_heads=2, idx_dim=32, topk=topk,
                      experts=16, top_k=2, shared=1, moe_inter=64, latent=64, dense_inter=256, attn_res=2,
                      max_pos=1048576, expert_format="mxfp4",
                      vision=trained_demo_vision_config() if vision else None)


def gpu_demo_config(topk: int = 64, vision: bool = False) -> ModelConfig:
    """The larger demo that `training.gpu_run` trains in ten minutes on one GPU: 9 layers in the same
    K3.1 pattern (KDA, KDA, gated DSA/MLA: DSA at layers 3, 6 and 9, 1-indexed), hidden 256, 32
    latent experts (top-4) + 1 shared, AttnRes blocks of 3, byte-level vocabulary, MXFP4 experts;
    with `vision`, the demo's tower projecting to width 256. Every expert matrix dimension is a
    multiple of 32 (MXFP4 blocks) and of 8 (16-byte rows for the grouped GEMM in bf16)."""
    return _k3_family(vocab_base=256, hidden=256, n_layers=9, full_attn_every=3, heads=4, q_lora=128, kv_lora=128,
                      nope=48, rope=16, v_dim=64, kda_heads=4, kda_dim=64, idx_heads=4, idx_dim=32, topk=topk,
                      experts=32, top_k=4, shared=1, moe_inter=128, latent=128, dense_inter=512, attn_res=3,
                      max_pos=1048576, expert_format="mxfp4",
                      vision=trained_demo_vision_config(256) if vision else None)


DEMO_SIZES = {"demo": trained_demo_config, "gpu": gpu_demo_config}


def trainable_model(config: ModelConfig, seed: int) -> KimiForCausalLM:
    """The engine's model with dense (trainable) experts, fp32, filled with the seeded random init."""
    dense = config.replace(expert_format="dense")
    with torch.device("meta"):
        model = KimiForCausalLM(dense)
    model.to_empty(device="cpu")
    fill(model, RandomSource(dense, seed, torch.float32), torch.float32)
    if model.vision is not None:
        _rescale_vision_init(model)
    model.train()
    return model


@torch.no_grad()
def _rescale_vision_init(model: KimiForCausalLM) -> None:
    """Start the tower where it can learn positions. The random init draws every matrix with std
    1/sqrt(last dim): for the patch convolution that is 1/sqrt(patch), so a patch's embedding has
    RMS ~4, while the position table (std 1/sqrt(width)) adds ~0.1 and the blocks' RMSNorm all but
    erases it. Rescale the convolution to its true fan-in (3 x patch x patch) and the table to 0.5."""
    embed = model.vision.vision_tower.patch_embed
    w = embed.proj.weight  # [D, 3, p, p]
    w.mul_(math.sqrt(w.shape[-1] / (w.shape[1] * w.shape[2] * w.shape[3])))
    table = embed.pos_emb.weight  # [H0, W0, D]
    table.mul_(0.5 * math.sqrt(table.shape[-1]))


@torch.no_grad()
def load_checkpoint_weights(model: KimiForCausalLM, reference: str | Path) -> dict:
    """A written checkpoint (a directory or `builtin:NAME`) into the trainable `model`: every text
    tensor as stored (bf16 floats widened), the MXFP4 experts dequantized to the dense trainable
    ones, the vision tower (if any) left out. Returns the checkpoint's `training.json` (or {}), so a
    continuation can start from the shipped model when no training state is left."""
    loaded = load_model(str(reference), dtype=torch.float32).state_dict()
    own = model.state_dict()
    missing = []
    for name, target in own.items():
        if name in loaded:
            source = loaded[name]
        elif name + "_packed" in loaded:
            source = mxfp4.dequantize(loaded[name + "_packed"], loaded[name + "_scale"])
        else:
            missing.append(name)
            continue
        if source.shape != target.shape:
            raise SystemExit(f"{reference}: {name} has shape {list(source.shape)}, the model expects {list(target.shape)}")
        target.copy_(source)
    if missing:
        raise SystemExit(f"{reference}: no tensor for {missing[:5]} ({len(missing)} in all)")
    info = Path(model_dir(reference)) / "training.json"
    return json.loads(info.read_text()) if info.exists() else {}


class TrainedSource:
    """Tensor source for `write_checkpoint`: the trained model's values, experts quantized to MXFP4."""

    def __init__(self, model: KimiForCausalLM, float_dtype: torch.dtype) -> None:
        # host copies: the checkpoint is written from the CPU whatever device trained the model
        self.state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        self.float_dtype = float_dtype
        self._mx: tuple[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def get(self, spec: TensorSpec) -> torch.Tensor:
        assert spec.target is not None
        if spec.kind in ("packed", "scale"):
            dense_name = spec.target.rsplit("_", 1)[0]      # ...experts.w1_packed -> ...experts.w1
            key = (dense_name, int(spec.expert))
            if self._mx is None or self._mx[0] != key:
                self._mx = (key, mxfp4.quantize(self.state[dense_name][spec.expert].float()))
            packed, scale = self._mx[1]
            return packed if spec.kind == "packed" else scale
        t = self.state[spec.target]
        if spec.expert is not None:
            t = t[spec.expert]
        if spec.init == "a_log" and tuple(t.shape) != spec.shape:  # stored padded to 128 entries
            padded = torch.zeros(spec.shape)
            padded.view(-1)[: t.numel()] = t.reshape(-1)
            t = padded
        return t.to(storage_dtype(spec, self.float_dtype)).contiguous()

    def get_slice(self, spec: TensorSpec, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.get(spec).narrow(dim, start, stop - start)


def export(model: KimiForCausalLM, config: ModelConfig, out_dir, *, float_dtype: torch.dtype = torch.bfloat16,
           overwrite: bool = True):
    """Write the trained model as a real K3.1 checkpoint (MXFP4 experts, bf16 floats, tokenizer)."""
    return write_checkpoint(config, out_dir, shards=1, float_dtype=float_dtype,
                            source=TrainedSource(model, float_dtype), overwrite=overwrite)
