"""The model configuration: one frozen dataclass that every other module reads.

- `ModelConfig` holds the text model (K3.1, K3 or plain Kimi-Linear) with 0-indexed layer lists.
- `DSAConfig` holds the lightning indexer of K3.1's sparse-attention layers.
- `VisionConfig` holds the MoonViT-V2 tower and projector sizes (run by `engine.vision`).
- Layer kinds and derived sizes are properties, checked once in `__post_init__`.

Reading and writing `config.json` lives in `engine.config_io`; named presets in `engine.presets`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import ConfigError

Variant = Literal["k3.1", "k3", "kimi-linear"]
ExpertFormat = Literal["mxfp4", "dense"]


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention indexer on the full-attention layers (K3.1).

    Attributes:
        n_heads: indexer query heads (32 in K3.1 Pro).
        head_dim: indexer query/key width (128).
        topk: keys kept per query (2048); queries with fewer past keys keep them all.
        layers: 0-indexed layers that run the indexer (a subset of the MLA layers).
        k_norm_eps: eps of the indexer key LayerNorm (1e-6 as in DeepSeek V3.2).
    """

    n_heads: int
    head_dim: int
    topk: int
    layers: tuple[int, ...]
    k_norm_eps: float = 1e-6


# torch's default RMSNorm eps (`eps=None`): the three tower norms use it, not rms_norm_eps
FLOAT32_EPS = 1.1920928955078125e-07


# far above K3.1's 2048 keys per query and small enough that sizing by it cannot exhaust memory
MAX_DSA_TOPK = 1 << 16

# the config's special token ids; each may lie outside the vocabulary (see ModelConfig.special_token_problem)
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 tower and patch-merger projector sizes (spec section 8).

    Attributes:
        patch_size: side of one square patch in pixels (14).
        hidden_size: tower width (1024).
        num_layers / num_heads: tower blocks (27) and attention heads (12).
        qkv_hidden_size: width of each of q, k, v (12 heads x 128); `head_dim` = this / num_heads.
        intermediate_size: tower MLP width (4096).
        pos_emb_height / pos_emb_width: the learned position table (64 x 64), resized bilinearly
            to each image's patch grid.
        merge_kernel: patches merged into one language-model token (2 x 2).
        text_hidden_size: projector output width = the language model's hidden size.
        rope_theta: base of the 2-D rotary frequencies.
        tower_norm_eps: eps of norm0 / norm1 / final_layernorm (float32 machine epsilon).
        projector_norm_eps: eps of the projector's post-norm (the text model's rms_norm_eps).
    """

    patch_size: int = 14
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    qkv_hidden_size: int = 1536
    intermediate_size: int = 4096
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_kernel: tuple[int, int] = (2, 2)
    text_hidden_size: int = 7168
    rope_theta: float = 10000.0
    tower_norm_eps: float = FLOAT32_EPS
    projector_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field `vision_config.{fld}`: {msg}")

        for name in ("patch_size", "hidden_size", "num_layers", "num_heads", "qkv_hidden_size",
                     "intermediate_size", "pos_emb_height", "pos_emb_width", "text_hidden_size"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                 f"must be a positive integer, got {value!r}")
        need(self.qkv_hidden_size % self.num_heads == 0, "qkv_hidden_size",
             f"{self.qkv_hidden_size} is not divisible by num_heads={self.num_heads}")
        need(self.head_dim % 4 == 0, "qkv_hidden_size",
             f"head dim {self.head_dim} must be divisible by 4 (2-D RoPE rotates pairs for rows and columns)")
        need(len(self.merge_kernel) == 2 and all(isinstance(k, int) and k > 0 for k in self.merge_kernel),
             "merge_kernel_size", f"must be two positive integers, got {self.merge_kernel!r}")
        # frequencies are theta ** -(2i/d): a base under 1 makes them grow without bound (NaN logits)
        need(math.isfinite(self.rope_theta) and self.rope_theta >= 1, "rope_theta",
             f"must be a finite number >= 1, got {self.rope_theta}")
        need(self.tower_norm_eps > 0 and self.projector_norm_eps > 0, "eps", "norm eps must be positive")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token (the projector's input): hidden x kernel area."""
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]


@dataclass(frozen=True)
class ModelConfig:
    """Kimi K3.1 / K3 / Kimi-Linear text model. All layer indices are 0-indexed.

    Attributes:
        variant: which family the config describes; K3 is K3.1 without `dsa`.
        kda_layers / mla_layers: the token mixer of each layer; together they cover every layer once.
        q_lora_rank: None means a direct `q_proj` (Kimi-Linear 48B); K3 uses a low-rank query.
        mla_use_output_gate: K3's sigmoid gate `g_proj` on the attention output.
        kda_full_rank_gate: K3's full-rank `g_proj` output gate; Kimi-Linear uses `g_a_proj`/`g_b_proj`.
        kda_gate_lower_bound: K3's bounded decay `lb * sigmoid(exp(A_log) * z)`; None selects
            Kimi-Linear's `-exp(A_log) * softplus(z)`.
        routed_expert_hidden_size: latent MoE width (K3); None runs experts at full width.
        hidden_act: `situ` (K3) or `silu` (Kimi-Linear), used by every MLP. The KDA short conv
            always uses SiLU.
        attn_res_block_size: Block Attention Residuals period (K3); None means plain residuals.
        expert_format: how routed experts are stored on disk (`mxfp4` = compressed-tensors pack).
        weight_prefix: prefix of text tensors in the checkpoint (`language_model.` for K3).
    """

    variant: Variant
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    # gated MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    kda_full_rank_gate: bool
    kda_gate_lower_bound: float | None
    # DSA indexer (K3.1 only)
    dsa: DSAConfig | None
    # MoE and dense MLP
    first_k_dense_replace: int
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    hidden_act: Literal["situ", "silu"]
    situ_beta: float
    situ_linear_beta: float
    # residual stream and norms
    attn_res_block_size: int | None
    rms_norm_eps: float
    latent_norm_eps: float = 1e-6
    # tokens and context
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    media_placeholder_token_id: int | None = None
    tie_word_embeddings: bool = False
    # storage
    expert_format: ExpertFormat = "dense"
    weight_prefix: str = ""
    vision: VisionConfig | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ---- derived layout -------------------------------------------------------------------
    def is_kda_layer(self, layer: int) -> bool:
        return layer in self._kda_set

    def is_dsa_layer(self, layer: int) -> bool:
        return self.dsa is not None and layer in self.dsa.layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.num_experts > 0

    def special_token_problem(self, name: str) -> str | None:
        """Why the special id `name` cannot be used (unset, or outside the vocabulary), or None when it can.

        A config may carry an id its vocabulary does not hold (a scaled-down config derived from the
        released one keeps `media_placeholder_token_id` 163605): it loads and runs text, and only what
        needs the id (images for the placeholder, a stop on eos) refuses or does without it.
        """
        value = getattr(self, name)
        if value is None:
            return f"the config sets no {name}"
        if not 0 <= value < self.vocab_size:
            return f"{name} {value} is outside the vocabulary [0, {self.vocab_size:,})"
        return None

    def special_token_id(self, name: str) -> int | None:
        """The special id `name` where this model can use it (set and inside the vocabulary), else None."""
        return None if self.special_token_problem(name) else getattr(self, name)

    def layer_kind(self, layer: int) -> str:
        """`kda`, `mla` or `dsa` (MLA with the indexer)."""
        if self.is_kda_layer(layer):
            return "kda"
        return "dsa" if self.is_dsa_layer(layer) else "mla"

    @property
    def _kda_set(self) -> frozenset[int]:
        return frozenset(self.kda_layers)

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_in_dim(self) -> int:
        """Width the routed experts read: the latent (K3) or the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def num_attn_res_blocks(self) -> int:
        """Block residuals at the head: the embedding plus one per completed block."""
        if self.attn_res_block_size is None:
            return 0
        return len(range(0, self.num_hidden_layers, self.attn_res_block_size))

    def summary(self) -> dict:
        """Human-facing facts about the architecture (CLI `inspect`, trace metadata)."""
        kinds = [self.layer_kind(i) for i in range(self.num_hidden_layers)]
        return {
            "variant": self.variant,
            "layers": self.num_hidden_layers,
            "layer_kinds": kinds,
            "kda_layers": kinds.count("kda"),
            "mla_layers": kinds.count("mla") + kinds.count("dsa"),
            "dsa_layers": kinds.count("dsa"),
            "moe_layers": sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers)),
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "attention_heads": self.num_attention_heads,
            "kda_heads": self.kda_num_heads,
            "kda_head_dim": self.kda_head_dim,
            "dsa_topk": None if self.dsa is None else self.dsa.topk,
            "dsa_index_heads": None if self.dsa is None else self.dsa.n_heads,
            "num_experts": self.num_experts,
            "experts_per_token": self.num_experts_per_token,
            "shared_experts": self.num_shared_experts,
            "expert_format": self.expert_format,
            "latent_moe": self.routed_expert_hidden_size,
            "attn_res_block_size": self.attn_res_block_size,
            "max_position_embeddings": self.max_position_embeddings,
            "config_hash": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """Stable hash of everything that changes the model's function (for snapshots, traces)."""
        payload = dataclasses.asdict(self)
        payload.pop("extra")
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- validation -----------------------------------------------------------------------
    def _validate(self) -> None:
        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field `{fld}`: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads",
                     "kda_head_dim", "conv_kernel_size", "intermediate_size"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, name, f"must be a positive integer, got {value!r}")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
        n = self.num_hidden_layers
        all_layers = set(range(n))
        kda, mla = set(self.kda_layers), set(self.mla_layers)
        overlap = sorted(kda & mla)
        need(not overlap, "linear_attn_config.kda_layers/full_attn_layers",
             f"layers {[i + 1 for i in overlap]} (1-indexed) are listed as both KDA and full attention")
        missing = sorted(all_layers - kda - mla)
        need(not missing, "linear_attn_config.kda_layers/full_attn_layers",
             f"layers {[i + 1 for i in missing]} (1-indexed) are in neither list; every layer needs one mixer")
        extra = sorted((kda | mla) - all_layers)
        need(not extra, "linear_attn_config", f"layers {[i + 1 for i in extra]} (1-indexed) exceed "
             f"num_hidden_layers={n}")
        need(len(kda) == len(self.kda_layers) and len(mla) == len(self.mla_layers),
             "linear_attn_config", "a layer is listed twice")
        need(self.hidden_act in ("situ", "silu"), "hidden_act",
             f"unknown activation {self.hidden_act!r}; supported: 'situ' (K3) and 'silu' (Kimi-Linear)")
        need(0 <= self.first_k_dense_replace <= n, "first_k_dense_replace", f"must be in [0, {n}]")
        if self.num_experts:
            need(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"must be in [1, num_experts={self.num_experts}]")
            need(self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0,
                 "num_expert_group", f"must divide num_experts={self.num_experts}")
            need(1 <= self.topk_group <= self.num_expert_group, "topk_group",
                 f"must be in [1, num_expert_group={self.num_expert_group}]")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
        if self.expert_format == "mxfp4":
            for fld, width in (("routed_expert_hidden_size/hidden_size", self.expert_in_dim),
                               ("moe_intermediate_size", self.moe_intermediate_size)):
                need(width % 32 == 0, fld, f"MXFP4 experts need widths divisible by 32, got {width}")
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size", "must be positive or null")
        if self.kda_gate_lower_bound is not None:
            need(self.kda_gate_lower_bound < 0, "linear_attn_config.gate_lower_bound",
                 f"must be negative (a log-decay bound), got {self.kda_gate_lower_bound}")
        if self.dsa is not None:
            d = self.dsa
            need(d.n_heads > 0 and d.head_dim > 0, "dsa_config", "indexer heads and head_dim must be positive")
            # decode capacities and per-query key lists are sized by top-k, whatever the context
            need(0 < d.topk <= min(MAX_DSA_TOPK, self.max_position_embeddings), "dsa_config.index_topk",
                 f"must be in [1, {min(MAX_DSA_TOPK, self.max_position_embeddings)}] (at most "
                 f"max_position_embeddings and {MAX_DSA_TOPK}), got {d.topk}")
            not_mla = sorted(set(d.layers) - mla)
            need(not not_mla, "dsa_config.layers",
                 f"layers {[i + 1 for i in not_mla]} (1-indexed) run the indexer but are not full-attention layers")
            need(self.q_lora_rank is not None, "q_lora_rank",
                 "the DSA indexer reads the low-rank query latent; q_lora_rank must be set")
        need(self.max_position_embeddings > 0, "max_position_embeddings", "must be positive")
        for name in SPECIAL_TOKEN_FIELDS:
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and not isinstance(value, bool)), name,
                 f"expected an integer token id or None, got {value!r:.40}")
        if self.vision is not None:
            need(self.vision.text_hidden_size == self.hidden_size, "vision_config.text_hidden_size",
                 f"the projector writes {self.vision.text_hidden_size}-wide tokens but hidden_size is {self.hidden_size}")
