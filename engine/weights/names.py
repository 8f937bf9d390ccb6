"""The checkpoint's tensor names and shapes, derived from the config alone (spec section 7).

`checkpoint_tensors(config)` lists every tensor a checkpoint of that config holds, in the real
naming (text tensors carry `config.weight_prefix`), and where each one lands in our model:
`target` is the parameter path in `engine.model.KimiForCausalLM` and `expert` the slot of a
stacked expert tensor. The loader, the validator (`workbench inspect`) and the random checkpoint
writer all read this one table, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from engine.config import ModelConfig

Kind = Literal["float", "packed", "scale"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint.

    Attributes:
        name: full name in the safetensors files.
        shape: expected shape (for `A_log`, any shape holding at least `kda_num_heads` values).
        kind: `float` (any float dtype), `packed` / `scale` (uint8 MXFP4 parts).
        target: parameter path in our model (vision tensors land in `model.vision`, a `VisionModel`
            whose keys are the checkpoint names: target `vision.` + name).
        expert: slot in a stacked `[E, ...]` expert parameter, else None.
        init: how the random writer fills it (`linear`, `norm`, `a_log`, `dt_bias`, `bias`, `embed`,
            `conv`, `router`, `router_bias`, `res_proj`, `mxfp4`).
        optional: may be absent from a checkpoint (then it takes its neutral value: zeros).
    """

    name: str
    shape: tuple[int, ...]
    kind: Kind
    target: str | None
    expert: int | None = None
    init: str = "linear"
    optional: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def a_log_shape(config: ModelConfig) -> tuple[int, ...]:
    """How the variant stores A_log: K3 pads to a multiple of 128 entries, Kimi-Linear uses [1, 1, H, 1]."""
    h = config.kda_num_heads
    if config.variant == "kimi-linear":
        return (1, 1, h, 1)
    return (-(-h // 128) * 128,)


# transformers' save_pretrained writes the dense layer's MLP under `block_sparse_moe.`
DENSE_MLP_ALIAS = ("mlp.", "block_sparse_moe.")


def _layer_tensors(c: ModelConfig, layer: int) -> Iterator[TensorSpec]:
    p = f"model.layers.{layer}."
    h = c.hidden_size

    def lin(name: str, out_f: int, in_f: int, init: str = "linear") -> TensorSpec:
        return TensorSpec(p + name + ".weight", (out_f, in_f), "float", p + name + ".weight", init=init)

    def vec(name: str, n: int, init: str = "norm") -> TensorSpec:
        full = p + name if name.endswith(("A_log", "dt_bias", "e_score_correction_bias")) else p + name + ".weight"
        return TensorSpec(full, (n,), "float", full, init=init)

    yield vec("input_layernorm", h)
    yield vec("post_attention_layernorm", h)
    if c.attn_res_block_size is not None:
        yield vec("self_attention_res_norm", h)
        yield lin("self_attention_res_proj", 1, h, init="res_proj")
        yield vec("mlp_res_norm", h)
        yield lin("mlp_res_proj", 1, h, init="res_proj")

    a = "self_attn."
    if c.is_kda_layer(layer):
        d, hd, nh = c.kda_dim, c.kda_head_dim, c.kda_num_heads
        for x in "qkv":
            yield lin(f"{a}{x}_proj", d, h)
            yield TensorSpec(f"{p}{a}{x}_conv1d.weight", (d, 1, c.conv_kernel_size), "float",
                             f"{p}{a}{x}_conv1d.weight", init="conv")
        yield lin(a + "f_a_proj", hd, h)
        yield lin(a + "f_b_proj", d, hd)
        yield vec(a + "dt_bias", d, init="dt_bias")
        yield TensorSpec(f"{p}{a}A_log", a_log_shape(c), "float", f"{p}{a}A_log", init="a_log")
        yield lin(a + "b_proj", nh, h)
        if c.kda_full_rank_gate:
            yield lin(a + "g_proj", d, h)
        else:
            yield lin(a + "g_a_proj", hd, h)
            yield lin(a + "g_b_proj", d, hd)
        yield vec(a + "o_norm", hd)
        yield lin(a + "o_proj", h, d)
    else:
        nh = c.num_attention_heads
        if c.q_lora_rank is None:
            yield lin(a + "q_proj", nh * c.qk_head_dim, h)
        else:
            yield lin(a + "q_a_proj", c.q_lora_rank, h)
            yield vec(a + "q_a_layernorm", c.q_lora_rank)
            yield lin(a + "q_b_proj", nh * c.qk_head_dim, c.q_lora_rank)
        yield lin(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, h)
        yield vec(a + "kv_a_layernorm", c.kv_lora_rank)
        yield lin(a + "kv_b_proj", nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        yield lin(a + "o_proj", h, nh * c.v_head_dim)
        if c.mla_use_output_gate:
            yield lin(a + "g_proj", nh * c.v_head_dim, h)
        if c.is_dsa_layer(layer):
            dsa = c.dsa
            assert dsa is not None and c.q_lora_rank is not None
            i = a + "indexer."
            yield lin(i + "wq_b", dsa.n_heads * dsa.head_dim, c.q_lora_rank)
            yield lin(i + "wk", dsa.head_dim, h)
            yield vec(i + "k_norm", dsa.head_dim)
            yield TensorSpec(f"{p}{i}k_norm.bias", (dsa.head_dim,), "float", f"{p}{i}k_norm.bias", init="bias",
                             optional=True)
            yield lin(i + "weights_proj", dsa.n_heads, h)

    if not c.is_moe_layer(layer):
        m = "mlp."
        yield lin(m + "gate_proj", c.intermediate_size, h)
        yield lin(m + "up_proj", c.intermediate_size, h)
        yield lin(m + "down_proj", h, c.intermediate_size)
        return

    m = "block_sparse_moe."
    yield lin(m + "gate", c.num_experts, h, init="router")
    yield vec(m + "gate.e_score_correction_bias", c.num_experts, init="router_bias")
    if c.num_shared_experts:
        s = c.shared_intermediate_size
        yield lin(m + "shared_experts.gate_proj", s, h)
        yield lin(m + "shared_experts.up_proj", s, h)
        yield lin(m + "shared_experts.down_proj", h, s)
    if c.routed_expert_hidden_size is not None:
        r = c.routed_expert_hidden_size
        yield lin(m + "routed_expert_down_proj", r, h)
        if c.latent_moe_use_norm:
            yield vec(m + "routed_expert_norm", r)
        yield lin(m + "routed_expert_up_proj", h, r)
    yield from _expert_tensors(c, p + m)


def _expert_tensors(c: ModelConfig, p: str) -> Iterator[TensorSpec]:
    f, r = c.moe_intermediate_size, c.expert_in_dim
    shapes = {"w1": (f, r), "w3": (f, r), "w2": (r, f)}
    for e in range(c.num_experts):
        for w, (out_f, in_f) in shapes.items():
            src = f"{p}experts.{e}.{w}."
            dst = f"{p}experts.{w}"
            if c.expert_format == "mxfp4":
                yield TensorSpec(src + "weight_packed", (out_f, in_f // 2), "packed", dst + "_packed", e, "mxfp4")
                yield TensorSpec(src + "weight_scale", (out_f, in_f // 32), "scale", dst + "_scale", e, "mxfp4")
            else:
                yield TensorSpec(src + "weight", (out_f, in_f), "float", dst, e)


VISION_PREFIXES = ("vision_tower.", "mm_projector.")
VISION_TARGET = "vision."  # the model's VisionModel attribute


def is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def _vision_tensors(c: ModelConfig) -> Iterator[TensorSpec]:
    for spec in _vision_specs(c):
        yield TensorSpec(spec.name, spec.shape, spec.kind, VISION_TARGET + spec.name, init=spec.init)


def _vision_specs(c: ModelConfig) -> Iterator[TensorSpec]:
    v = c.vision
    assert v is not None
    h, ps = v.hidden_size, v.patch_size
    merged = h * v.merge_kernel[0] * v.merge_kernel[1]
    yield TensorSpec("vision_tower.patch_embed.proj.weight", (h, 3, ps, ps), "float", None)
    yield TensorSpec("vision_tower.patch_embed.pos_emb.weight", (v.pos_emb_height, v.pos_emb_width, h), "float", None)
    for i in range(v.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        yield TensorSpec(b + "norm0.weight", (h,), "float", None, init="norm")
        yield TensorSpec(b + "norm1.weight", (h,), "float", None, init="norm")
        yield TensorSpec(b + "wqkv.weight", (3 * v.qkv_hidden_size, h), "float", None)
        yield TensorSpec(b + "wo.weight", (h, v.qkv_hidden_size), "float", None)
        yield TensorSpec(b + "mlp.fc0.weight", (v.intermediate_size, h), "float", None)
        yield TensorSpec(b + "mlp.fc1.weight", (h, v.intermediate_size), "float", None)
    yield TensorSpec("vision_tower.encoder.final_layernorm.weight", (h,), "float", None, init="norm")
    yield TensorSpec("mm_projector.proj.0.weight", (merged, merged), "float", None)
    yield TensorSpec("mm_projector.proj.2.weight", (v.text_hidden_size, merged), "float", None)
    yield TensorSpec("mm_projector.post_norm.weight", (v.text_hidden_size,), "float", None, init="norm")


def checkpoint_tensors(config: ModelConfig, *, include_vision: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of a checkpoint of `config`, text tensors with `config.weight_prefix`."""
    c, pre = config, config.weight_prefix
    text = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), "float",
                       "model.embed_tokens.weight", init="embed")]
    for layer in range(c.num_hidden_layers):
        text.extend(_layer_tensors(c, layer))
    text.append(TensorSpec("model.norm.weight", (c.hidden_size,), "float", "model.norm.weight", init="norm"))
    if c.attn_res_block_size is not None:
        text.append(TensorSpec("model.output_attn_res_norm.weight", (c.hidden_size,), "float",
                               "model.output_attn_res_norm.weight", init="norm"))
        text.append(TensorSpec("model.output_attn_res_proj.weight", (1, c.hidden_size), "float",
                               "model.output_attn_res_proj.weight", init="res_proj"))
    text.append(TensorSpec("lm_head.weight", (c.vocab_size, c.hidden_size), "float", "lm_head.weight"))
    for spec in text:
        yield TensorSpec(pre + spec.name, spec.shape, spec.kind, spec.target, spec.expert, spec.init, spec.optional)
    if include_vision and c.vision is not None:
        yield from _vision_tensors(c)


def layer_tensors(config: ModelConfig, layer: int) -> list[TensorSpec]:
    """Tensors of one decoder layer (without the weight prefix): used for per-layer counts."""
    return list(_layer_tensors(config, layer))
