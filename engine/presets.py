"""Named model configurations and variant conversion.

- `k3.1-pro`: the full Kimi K3.1 Pro (spec section 1). Used on the meta device for parameter
  counts, memory plans and single-layer slices at true dimensions.
- `demo`: the same architecture sized so a 128K-token session runs on 2 CPU cores; DSA top-k is
  256 so sparsity shows at demo lengths.
- `tiny`: the smallest config that still exercises every layer kind (tests, notebooks).
- The K3.1 presets carry a vision tower: true size for `k3.1-pro` (0.45 B), two small blocks for
  `demo` (width 128, 64 x 64 position table) and `tiny` (width 32, 16 x 16 table, so ordinary test
  images exercise the table resize). `tiny-tp` and the kimi-linear variant have none.
- `tiny-tp`: `tiny` with 8 KDA and 8 MLA heads, 16 experts and a 512-token vocabulary, so it
  splits over 1, 2, 4 or 8 ranks (tensor/expert-parallel tests).

`make_variant(config, "k3" | "kimi-linear")` derives the K3 (no indexer) and plain Kimi-Linear
layouts from any preset, so every test size exists in all three on-disk formats.
"""

from __future__ import annotations

from engine.config import DSAConfig, ModelConfig, Variant, VisionConfig
from engine.errors import ConfigError

# special tokens sit right after the base vocabulary; offsets are those of the real tokenizer
SPECIAL_OFFSETS = {"bos": 0, "eos": 1, "end_of_msg": 2, "open": 3, "close": 4, "sep": 5,
                   "media_begin": 18, "media_content": 19, "media_end": 20, "media_pad": 21}
NUM_SPECIAL_TOKENS = 256


def _full_attn_layers(n_layers: int, every: int) -> list[int]:
    """1-indexed [every, 2*every, ..., n_layers]: the K3 layer pattern (4, 8, ..., 92, 93)."""
    layers = list(range(every, n_layers + 1, every))
    if n_layers not in layers:
        layers.append(n_layers)
    return layers


def _k3_family(*, vocab_base: int, hidden: int, n_layers: int, full_attn_every: int, heads: int,
               q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int, kda_heads: int, kda_dim: int,
               idx_heads: int, idx_dim: int, topk: int, experts: int, top_k: int, shared: int,
               moe_inter: int, latent: int, dense_inter: int, attn_res: int, max_pos: int,
               expert_format: str, vision: VisionConfig | None) -> ModelConfig:
    full = [i - 1 for i in _full_attn_layers(n_layers, full_attn_every)]
    kda = [i for i in range(n_layers) if i not in full]
    special = vocab_base
    return ModelConfig(
        variant="k3.1", vocab_size=vocab_base + NUM_SPECIAL_TOKENS, hidden_size=hidden,
        num_hidden_layers=n_layers, kda_layers=tuple(kda), mla_layers=tuple(full),
        num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v_dim, mla_use_output_gate=True,
        kda_num_heads=kda_heads, kda_head_dim=kda_dim, conv_kernel_size=4, kda_full_rank_gate=True,
        kda_gate_lower_bound=-5.0,
        dsa=DSAConfig(n_heads=idx_heads, head_dim=idx_dim, topk=topk, layers=tuple(full)),
        first_k_dense_replace=1, intermediate_size=dense_inter, num_experts=experts,
        num_experts_per_token=top_k, num_shared_experts=shared, moe_intermediate_size=moe_inter,
        routed_expert_hidden_size=latent, latent_moe_use_norm=True, routed_scaling_factor=1.0,
        moe_renormalize=True, num_expert_group=1, topk_group=1, hidden_act="situ", situ_beta=4.0,
        situ_linear_beta=25.0, attn_res_block_size=attn_res, rms_norm_eps=1e-5,
        max_position_embeddings=max_pos, bos_token_id=special + SPECIAL_OFFSETS["bos"],
        eos_token_id=special + SPECIAL_OFFSETS["end_of_msg"], pad_token_id=0,
        media_placeholder_token_id=special + SPECIAL_OFFSETS["media_pad"], expert_format=expert_format,
        weight_prefix="language_model.", vision=vision,
    )


def k31_pro() -> ModelConfig:
    return _k3_family(vocab_base=163584, hidden=7168, n_layers=93, full_attn_every=4, heads=96, q_lora=1536,
                      kv_lora=512, nope=128, rope=64, v_dim=128, kda_heads=96, kda_dim=128, idx_heads=32,
                      idx_dim=128, topk=2048, experts=896, top_k=16, shared=2, moe_inter=3072, latent=3584,
                      dense_inter=33792, attn_res=12, max_pos=1048576, expert_format="mxfp4",
                      vision=VisionConfig())


def demo() -> ModelConfig:
    return _k3_family(vocab_base=256, hidden=256, n_layers=12, full_attn_every=4, heads=4, q_lora=96,
                      kv_lora=64, nope=32, rope=16, v_dim=32, kda_heads=4, kda_dim=64, idx_heads=2, idx_dim=32,
                      topk=256, experts=64, top_k=4, shared=2, moe_inter=64, latent=128, dense_inter=512,
                      attn_res=4, max_pos=1048576, expert_format="mxfp4",
                      vision=VisionConfig(hidden_size=128, num_layers=2, num_heads=2, qkv_hidden_size=128,
                                          intermediate_size=256, text_hidden_size=256))


def tiny() -> ModelConfig:
    return _k3_family(vocab_base=256, hidden=64, n_layers=6, full_attn_every=3, heads=2, q_lora=32,
                      kv_lora=32, nope=16, rope=8, v_dim=16, kda_heads=2, kda_dim=16, idx_heads=2, idx_dim=16,
                      topk=16, experts=8, top_k=2, shared=1, moe_inter=32, latent=32, dense_inter=96,
                      attn_res=2, max_pos=65536, expert_format="mxfp4",
                      vision=VisionConfig(hidden_size=32, num_layers=2, num_heads=2, qkv_hidden_size=32,
                                          intermediate_size=64, pos_emb_height=16, pos_emb_width=16,
                                          text_hidden_size=64))


def tiny_tp() -> ModelConfig:
    """`tiny` with every split divisible by 8 (heads, vocabulary, widths, experts): parallel tests."""
    return _k3_family(vocab_base=256, hidden=64, n_layers=6, full_attn_every=3, heads=8, q_lora=32,
                      kv_lora=32, nope=8, rope=8, v_dim=8, kda_heads=8, kda_dim=8, idx_heads=2, idx_dim=16,
                      topk=16, experts=16, top_k=4, shared=1, moe_inter=32, latent=32, dense_inter=96,
                      attn_res=2, max_pos=65536, expert_format="mxfp4", vision=None)


PRESETS = {"k3.1-pro": k31_pro, "demo": demo, "tiny": tiny, "tiny-tp": tiny_tp}


def make_variant(config: ModelConfig, variant: Variant) -> ModelConfig:
    """Convert a K3.1 config into the K3 or plain Kimi-Linear layout of the same size."""
    if variant == "k3.1":
        if config.dsa is None:
            raise ConfigError("variant k3.1 needs a config with a DSA indexer")
        return config
    if variant == "k3":
        return config.replace(variant="k3", dsa=None)
    if variant == "kimi-linear":
        return config.replace(
            variant="kimi-linear", dsa=None, kda_full_rank_gate=False, kda_gate_lower_bound=None,
            hidden_act="silu", attn_res_block_size=None, routed_expert_hidden_size=None,
            latent_moe_use_norm=False, routed_scaling_factor=2.446, mla_use_output_gate=False,
            expert_format="dense", weight_prefix="", vision=None, media_placeholder_token_id=None,
        )
    raise ConfigError(f"unknown variant {variant!r}; choose k3.1, k3 or kimi-linear")


def get_preset(name: str, variant: Variant | None = None) -> ModelConfig:
    """`get_preset("demo")`, `get_preset("tiny", "k3")`, ..."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    config = PRESETS[name]()
    return config if variant is None else make_variant(config, variant)
