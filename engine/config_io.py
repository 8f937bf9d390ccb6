"""Read and write `config.json` in the three real layouts.

- K3.1: top-level `model_type: kimi_k3` with nested `text_config` (`kimi_linear`), `vision_config`
  and a `dsa_config` (accepted at either level; key names vary, see `_parse_dsa`).
- K3: the same without `dsa_config` (dense gated MLA).
- Kimi-Linear: a flat `kimi_linear` config (softplus decay, low-rank KDA gate, SiLU, no AttnRes,
  no latent MoE), including what transformers' `save_pretrained` writes.

`parse_config(dict)` returns the frozen `ModelConfig`; `config_to_hf(config)` is its inverse and is
what the checkpoint writer stores.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.config import MAX_DSA_TOPK, DSAConfig, ModelConfig, VisionConfig
from engine.errors import ConfigError
from engine.io.files import parse_json, read_limited

MXFP4_FORMAT = "mxfp4-pack-quantized"
_MISSING = object()
MXFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 32}
_MAX_CONFIG_BYTES = 16 << 20

# sane upper bounds, checked before anything is sized by a value (K3.1 Pro: 93 layers, hidden 7168,
# vocab 163840, 896 experts); each is far above any real model and far below what exhausts memory
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
SPECIAL_ID_LIMIT = (1 << 31) - 1  # any id a 32-bit tokenizer can name, -1 ("none") included
MAX_EXPERTS = 32767  # expert ids are int16 in traces
MAX_POSITIONS = 2 ** 31 - 1  # positions are int32
MAX_VISION_GRID = 1 << 12  # a vision tower's learned position grid and patch merge kernel, per side


def load_config(path: str | Path) -> ModelConfig:
    """Parse `path` (a checkpoint directory or a config.json file)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json found")
    data = read_limited(file, "a config.json", ConfigError, _MAX_CONFIG_BYTES)
    raw = parse_json(data, str(file), ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level")
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None


def _get(d: dict, *names: str, default: Any = _MISSING) -> Any:
    """First present key among `names` (the real configs spell some fields several ways)."""
    for name in names:
        if name in d and d[name] is not None:
            return d[name]
    if default is _MISSING:
        raise ConfigError(f"config field `{names[0]}` is missing")
    return default


def _as_int(value: Any, fld: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field `{fld}`: expected an integer, got {value!r:.80}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"config field `{fld}`: expected an integer in [{lo}, {hi}], got {value:.6g}"
                          if abs(value) > 10 ** 15 else
                          f"config field `{fld}`: expected an integer in [{lo}, {hi}], got {value}")
    return value


def _opt_int(value: Any, fld: str, lo: int = 0, hi: int = MAX_WIDTH) -> int | None:
    return None if value is None else _as_int(value, fld, lo, hi)


def _as_float(value: Any, fld: str, *, positive: bool = False) -> float:
    """A finite number (ints accepted); `positive` also refuses zero and negatives."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field `{fld}`: expected a number, got {value!r:.80}")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out) or (positive and out <= 0):
        raise ConfigError(f"config field `{fld}`: expected a finite{' positive' if positive else ''} number, "
                          f"got {value!r:.80}")
    return out


def _as_dict(value: Any, fld: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"config field `{fld}`: expected an object, got {type(value).__name__}")
    return value


def _layer_list(values: Any, fld: str, n_layers: int) -> tuple[int, ...]:
    """1-indexed list from the config -> 0-indexed tuple."""
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in values):
        raise ConfigError(f"config field `{fld}`: expected a list of 1-indexed layer numbers")
    bad = [v for v in values if not 1 <= v <= n_layers]
    if bad:
        raise ConfigError(f"config field `{fld}`: layer numbers {bad} are outside 1..{n_layers} "
                          "(the lists are 1-indexed)")
    return tuple(v - 1 for v in values)


def _parse_dsa(raw: dict, mla_layers: tuple[int, ...], n_layers: int) -> DSAConfig:
    for key in ("index_rope", "use_rope", "rope", "rope_head_dim", "index_rope_head_dim", "qk_rope_head_dim",
                "rope_theta"):
        value = raw.get(key)
        if value not in (None, False, 0):
            raise ConfigError(f"config field `dsa_config.{key}`: indexer RoPE is not supported "
                              "(K3.1 is NoPE: the indexer scores keys without rotary)")
    layers_raw = _get(raw, "dsa_layers", "layers", "indexer_layers", default=None)
    layers = mla_layers if layers_raw is None else _layer_list(layers_raw, "dsa_config.layers", n_layers)
    return DSAConfig(
        n_heads=_as_int(_get(raw, "index_n_heads", "n_heads", "num_heads"), "dsa_config.index_n_heads", 1, MAX_HEADS),
        head_dim=_as_int(_get(raw, "index_head_dim", "head_dim"), "dsa_config.index_head_dim", 1, MAX_WIDTH),
        topk=_as_int(_get(raw, "index_topk", "topk", "top_k"), "dsa_config.index_topk", 1, MAX_DSA_TOPK),
        layers=tuple(sorted(layers)),
        k_norm_eps=_as_float(_get(raw, "index_k_norm_eps", "k_norm_eps", "norm_eps", default=1e-6),
                             "dsa_config.index_k_norm_eps", positive=True),
    )


def _parse_vision(raw: dict, text_hidden: int, text_eps: float) -> VisionConfig:
    """`vision_config` -> VisionConfig; K3 spells most fields with a `vt_` prefix."""
    def num(fld: str, *names: str, default: int, hi: int = MAX_WIDTH) -> int:
        return _as_int(_get(raw, *names, default=default), f"vision_config.{fld}", 1, hi)

    merge = _get(raw, "merge_kernel_size", default=[2, 2])
    if (not isinstance(merge, (list, tuple)) or len(merge) != 2
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in merge)):
        raise ConfigError(f"config field `vision_config.merge_kernel_size`: expected two integers, got {merge!r:.80}")
    for k in merge:
        _as_int(k, "vision_config.merge_kernel_size", 1, MAX_VISION_GRID)
    projector = raw.get("mm_projector_type", "patchmergerv2")
    if projector != "patchmergerv2":
        raise ConfigError(f"config field `vision_config.mm_projector_type`: only 'patchmergerv2' is supported, "
                          f"got {projector!r}")
    rope = raw.get("rope_parameters") or {}
    theta = _get(raw, "rope_theta", default=rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
    theta = _as_float(theta, "vision_config.rope_theta")  # VisionConfig checks its range
    return VisionConfig(
        patch_size=num("patch_size", "patch_size", default=14, hi=MAX_VISION_GRID),
        hidden_size=num("vt_hidden_size", "vt_hidden_size", "hidden_size", default=1024),
        num_layers=num("vt_num_hidden_layers", "vt_num_hidden_layers", "num_hidden_layers", default=27,
                       hi=MAX_LAYERS),
        num_heads=num("vt_num_attention_heads", "vt_num_attention_heads", "num_attention_heads", default=12,
                      hi=MAX_HEADS),
        qkv_hidden_size=num("qkv_hidden_size", "qkv_hidden_size", default=1536),
        intermediate_size=num("vt_intermediate_size", "vt_intermediate_size", "intermediate_size", default=4096),
        pos_emb_height=num("init_pos_emb_height", "init_pos_emb_height", default=64, hi=MAX_VISION_GRID),
        pos_emb_width=num("init_pos_emb_width", "init_pos_emb_width", default=64, hi=MAX_VISION_GRID),
        merge_kernel=(merge[0], merge[1]),
        text_hidden_size=num("text_hidden_size", "text_hidden_size", default=text_hidden),
        rope_theta=float(theta),
        projector_norm_eps=text_eps,
    )


def _expert_format(quant: dict | None) -> str:
    if not quant:
        return "dense"
    quant = _as_dict(quant, "quantization_config")
    method = quant.get("quant_method")
    groups = _as_dict(quant.get("config_groups") or {}, "quantization_config.config_groups")
    listed = [quant.get("format")] + [g.get("format") for g in groups.values() if isinstance(g, dict)]
    if not all(f is None or isinstance(f, str) for f in listed):
        raise ConfigError("config field `quantization_config.format`: expected a string")
    formats = set(listed) - {None}
    if method != "compressed-tensors" or formats - {MXFP4_FORMAT}:
        raise ConfigError(f"config field `quantization_config`: unsupported quantization "
                          f"(quant_method={method!r}, format={sorted(formats)}); "
                          f"supported: compressed-tensors {MXFP4_FORMAT!r} routed experts")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if weights is None:
            continue
        weights = _as_dict(weights, f"quantization_config.config_groups.{name}.weights")
        # MXFP4 is fixed: 4-bit floats sharing one scale per 32 values; any other layout is another format
        for key, fixed in MXFP4_WEIGHTS.items():
            if key in weights and weights[key] != fixed:
                raise ConfigError(f"config field `quantization_config.config_groups.{name}.weights.{key}`: "
                                  f"MXFP4 has {key} {fixed!r}, got {weights[key]!r:.40}")
    return "mxfp4"


def parse_config(raw: dict) -> ModelConfig:
    """Parse a config.json dict in the K3.1, K3 or Kimi-Linear layout."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type == "kimi_k3":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config field `text_config`: a kimi_k3 config needs a nested text_config object")
        dsa_raw = raw.get("dsa_config", text.get("dsa_config"))
        vision_raw = raw.get("vision_config")
        if vision_raw is not None and not isinstance(vision_raw, dict):
            raise ConfigError("config field `vision_config`: expected an object")
        prefix = "language_model."
        quant = text.get("quantization_config", raw.get("quantization_config"))
        media = raw.get("media_placeholder_token_id", text.get("media_placeholder_token_id"))
    elif model_type == "kimi_linear":
        text, dsa_raw, vision_raw, prefix = raw, raw.get("dsa_config"), None, ""
        quant = raw.get("quantization_config")
        media = raw.get("media_placeholder_token_id")
    else:
        raise ConfigError(f"unknown architecture: model_type={model_type!r}, architectures={archs}; "
                          "supported: kimi_k3 (Kimi K3 / K3.1) and kimi_linear (Kimi-Linear)")
    if dsa_raw is not None:
        _as_dict(dsa_raw, "dsa_config")
    text_type = text.get("model_type", "kimi_linear")
    if text_type != "kimi_linear":
        raise ConfigError(f"config field `text_config.model_type`: expected 'kimi_linear', got {text_type!r}")

    # bounded before anything is built from it (a set of all layer ids, the layer lists)
    n_layers = _as_int(_get(text, "num_hidden_layers"), "num_hidden_layers", 1, MAX_LAYERS)
    lin = _as_dict(text.get("linear_attn_config") or {}, "linear_attn_config")
    if "kda_layers" in lin and "full_attn_layers" in lin:
        kda = _layer_list(lin["kda_layers"], "linear_attn_config.kda_layers", n_layers)
        mla = _layer_list(lin["full_attn_layers"], "linear_attn_config.full_attn_layers", n_layers)
    elif isinstance(text.get("layer_types"), list):
        types = text["layer_types"]
        if len(types) != n_layers:
            raise ConfigError(f"config field `layer_types`: {len(types)} entries for {n_layers} layers")
        unknown = sorted({repr(t)[:40] for t in types if t not in ("linear_attention", "full_attention")})
        if unknown:
            raise ConfigError(f"config field `layer_types`: unknown layer types {unknown}")
        kda = tuple(i for i, t in enumerate(types) if t == "linear_attention")
        mla = tuple(i for i, t in enumerate(types) if t == "full_attention")
    else:
        raise ConfigError("config field `linear_attn_config.kda_layers`: missing; the layer lists "
                          "(kda_layers, full_attn_layers) must name every layer")

    if text.get("mla_use_nope", True) is not True:
        raise ConfigError("config field `mla_use_nope`: rotary MLA is not supported (K3 is NoPE)")
    hidden_act = str(_get(text, "hidden_act", default="silu")).lower()
    num_heads = _as_int(_get(text, "num_attention_heads"), "num_attention_heads", 1, MAX_HEADS)
    kv_heads = text.get("num_key_value_heads") or num_heads
    if kv_heads != num_heads:
        raise ConfigError(f"config field `num_key_value_heads`: MLA needs it equal to num_attention_heads "
                          f"({num_heads}), got {kv_heads}")
    lower_bound = lin.get("gate_lower_bound")
    is_kimi_linear = model_type == "kimi_linear"
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    # special ids are kept as the checkpoint gives them, even outside the vocabulary (a scaled-down config
    # derived from the released one keeps media_placeholder_token_id 163605 beside a small vocabulary; the
    # other implementations load it): only the use of such an id is refused (KimiConfig.special_token_problem)
    token_ids = {name: _opt_int(value, name, -SPECIAL_ID_LIMIT, SPECIAL_ID_LIMIT) for name, value in (
        ("bos_token_id", text.get("bos_token_id", raw.get("bos_token_id"))), ("eos_token_id", eos),
        ("pad_token_id", text.get("pad_token_id", raw.get("pad_token_id"))), ("media_placeholder_token_id", media))}

    mla_sorted = tuple(sorted(mla))
    q_lora = text.get("q_lora_rank")
    kwargs: dict[str, Any] = dict(
        vocab_size=_as_int(_get(text, "vocab_size"), "vocab_size", 1, MAX_VOCAB),
        hidden_size=_as_int(_get(text, "hidden_size"), "hidden_size", 1, MAX_WIDTH),
        num_hidden_layers=n_layers,
        kda_layers=tuple(sorted(kda)),
        mla_layers=mla_sorted,
        num_attention_heads=num_heads,
        q_lora_rank=_opt_int(q_lora, "q_lora_rank", 1),
        kv_lora_rank=_as_int(_get(text, "kv_lora_rank"), "kv_lora_rank", 1, MAX_WIDTH),
        qk_nope_head_dim=_as_int(_get(text, "qk_nope_head_dim"), "qk_nope_head_dim", 1, MAX_WIDTH),
        qk_rope_head_dim=_as_int(_get(text, "qk_rope_head_dim"), "qk_rope_head_dim", 0, MAX_WIDTH),
        v_head_dim=_as_int(_get(text, "v_head_dim"), "v_head_dim", 1, MAX_WIDTH),
        mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
        kda_num_heads=_as_int(_get(lin, "num_heads", default=text.get("linear_num_heads", num_heads)),
                              "linear_attn_config.num_heads", 1, MAX_HEADS),
        kda_head_dim=_as_int(_get(lin, "head_dim", default=text.get("linear_head_dim", 128)),
                             "linear_attn_config.head_dim", 1, MAX_WIDTH),
        conv_kernel_size=_as_int(_get(lin, "short_conv_kernel_size", default=text.get("linear_conv_kernel_dim", 4)),
                                 "linear_attn_config.short_conv_kernel_size", 1, 64),
        kda_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
        kda_gate_lower_bound=None if lower_bound is None else _as_float(lower_bound,
                                                                        "linear_attn_config.gate_lower_bound"),
        dsa=None if dsa_raw is None else _parse_dsa(dsa_raw, mla_sorted, n_layers),
        first_k_dense_replace=_as_int(_get(text, "first_k_dense_replace", default=1), "first_k_dense_replace",
                                      0, n_layers),
        intermediate_size=_as_int(_get(text, "intermediate_size"), "intermediate_size", 1, MAX_WIDTH),
        num_experts=_as_int(_get(text, "num_experts", "num_local_experts", "n_routed_experts", default=0),
                            "num_experts", 0, MAX_EXPERTS),
        num_experts_per_token=_as_int(_get(text, "num_experts_per_token", "num_experts_per_tok", default=1),
                                      "num_experts_per_token", 0, MAX_EXPERTS),
        num_shared_experts=_as_int(_get(text, "num_shared_experts", "n_shared_experts", default=0),
                                   "num_shared_experts", 0, 64),
        moe_intermediate_size=_as_int(_get(text, "moe_intermediate_size", default=0), "moe_intermediate_size",
                                      0, MAX_WIDTH),
        routed_expert_hidden_size=_opt_int(text.get("routed_expert_hidden_size"), "routed_expert_hidden_size", 1),
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)),
        routed_scaling_factor=_as_float(_get(text, "routed_scaling_factor", default=2.446 if is_kimi_linear else 1.0),
                                        "routed_scaling_factor"),
        moe_renormalize=bool(_get(text, "moe_renormalize", "norm_topk_prob", default=True)),
        num_expert_group=_as_int(_get(text, "num_expert_group", "n_group", default=1), "num_expert_group",
                                 1, MAX_EXPERTS),
        topk_group=_as_int(_get(text, "topk_group", default=1), "topk_group", 1, MAX_EXPERTS),
        hidden_act=hidden_act,
        situ_beta=_as_float(_get(text, "activation_situ_beta", default=4.0), "activation_situ_beta"),
        situ_linear_beta=_as_float(_get(text, "activation_situ_linear_beta", default=25.0),
                                   "activation_situ_linear_beta"),
        attn_res_block_size=_opt_int(text.get("attn_res_block_size"), "attn_res_block_size", 1, MAX_LAYERS),
        rms_norm_eps=_as_float(_get(text, "rms_norm_eps", default=1e-5), "rms_norm_eps", positive=True),
        max_position_embeddings=_as_int(_get(text, "max_position_embeddings", "model_max_length",
                                             default=1048576), "max_position_embeddings", 1, MAX_POSITIONS),
        **token_ids,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        expert_format=_expert_format(quant),
        weight_prefix=prefix,
        vision=None if not isinstance(vision_raw, dict) else _parse_vision(
            vision_raw, text["hidden_size"], float(_get(text, "rms_norm_eps", default=1e-5))),
    )
    router = str(text.get("moe_router_activation_func", "sigmoid")).lower()
    if router != "sigmoid":
        raise ConfigError(f"config field `moe_router_activation_func`: only 'sigmoid' is supported, got {router!r}")
    if kwargs["tie_word_embeddings"]:
        raise ConfigError("config field `tie_word_embeddings`: Kimi models have an untied lm_head")
    if is_kimi_linear:
        variant = "kimi-linear"
    else:
        variant = "k3.1" if kwargs["dsa"] is not None else "k3"
    return ModelConfig(variant=variant, **kwargs)


def _text_dict(c: ModelConfig) -> dict[str, Any]:
    lin: dict[str, Any] = {
        "head_dim": c.kda_head_dim,
        "num_heads": c.kda_num_heads,
        "short_conv_kernel_size": c.conv_kernel_size,
        "kda_layers": [i + 1 for i in c.kda_layers],
        "full_attn_layers": [i + 1 for i in c.mla_layers],
    }
    if c.kda_full_rank_gate:
        lin["use_full_rank_gate"] = True
    if c.kda_gate_lower_bound is not None:
        lin["gate_lower_bound"] = c.kda_gate_lower_bound
    d: dict[str, Any] = {
        "model_type": "kimi_linear",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": True,
        "linear_attn_config": lin,
        "num_experts": c.num_experts,
        "num_experts_per_token": c.num_experts_per_token,
        "num_shared_experts": c.num_shared_experts,
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": c.moe_renormalize,
        "topk_method": "noaux_tc",
        "num_expert_group": c.num_expert_group,
        "topk_group": c.topk_group,
        "routed_scaling_factor": c.routed_scaling_factor,
        "first_k_dense_replace": c.first_k_dense_replace,
        "intermediate_size": c.intermediate_size,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "tie_word_embeddings": False,
    }
    if c.variant != "kimi-linear":
        d.update({
            "mla_use_output_gate": c.mla_use_output_gate,
            "routed_expert_hidden_size": c.routed_expert_hidden_size,
            "latent_moe_use_norm": c.latent_moe_use_norm,
            "activation_situ_beta": c.situ_beta,
            "activation_situ_linear_beta": c.situ_linear_beta,
            "attn_res_block_size": c.attn_res_block_size,
        })
    if c.expert_format == "mxfp4":
        d["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": MXFP4_FORMAT,
            "config_groups": {"group_0": {
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "format": MXFP4_FORMAT,
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "scale_dtype": "uint8"},
            }},
        }
    return d


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The config.json dict of `c` in its variant's real layout (inverse of `parse_config`)."""
    text = _text_dict(c)
    if c.variant == "kimi-linear":
        text["architectures"] = ["KimiLinearForCausalLM"]
        if c.dsa is not None:
            text["dsa_config"] = _dsa_dict(c)
        return text
    out: dict[str, Any] = {
        "architectures": ["KimiK31ForConditionalGeneration" if c.dsa else "KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "media_placeholder_token_id": c.media_placeholder_token_id,
        "text_config": text,
    }
    if c.dsa is not None:
        text["dsa_config"] = _dsa_dict(c)
    if c.vision is not None:
        v = c.vision
        out["vision_config"] = {
            "patch_size": v.patch_size, "vt_hidden_size": v.hidden_size, "vt_num_hidden_layers": v.num_layers,
            "vt_num_attention_heads": v.num_heads, "qkv_hidden_size": v.qkv_hidden_size,
            "vt_intermediate_size": v.intermediate_size, "init_pos_emb_height": v.pos_emb_height,
            "init_pos_emb_width": v.pos_emb_width, "merge_kernel_size": list(v.merge_kernel),
            "mm_projector_type": "patchmergerv2", "text_hidden_size": v.text_hidden_size,
            "rope_theta": v.rope_theta,
        }
    return out


def _dsa_dict(c: ModelConfig) -> dict[str, Any]:
    d = c.dsa
    assert d is not None
    return {"index_n_heads": d.n_heads, "index_head_dim": d.head_dim, "index_topk": d.topk,
            "dsa_layers": [i + 1 for i in d.layers], "index_k_norm_eps": d.k_norm_eps}
