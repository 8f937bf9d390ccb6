"""The decoder: embeddings, 93 (or N) layers with Block Attention Residuals, norm and LM head.

Module names equal the checkpoint's tensor names (`model.layers.{L}.self_attn.q_proj.weight`, ...)
except the routed experts, which are stacked per layer (see `engine.weights.names`). The layer kind
comes from the config: KDA or gated MLA (with the DSA indexer on K3.1's sparse layers); a dense MLP
in the first `first_k_dense_replace` layers and the latent MoE elsewhere.

Residual stream (K3, spec section 2): a prefix sum P and a list of block residuals B; each layer
mixes them with a learned softmax before its mixer and before its FFN. Kimi-Linear (no
`attn_res_block_size`) uses plain residual sums.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from engine.cache import KDAState, MLACache, ModelState
from engine.config import ModelConfig
from engine.errors import InputError
from engine.heap import LARGE_ALLOCATION_BYTES, release_free_heap
from engine.hooks import HookPoint, bind_points, through
from engine.layers.attn_res import ResNorm, attn_res
from engine.layers.common import GatedMLP, RMSNorm, activation
from engine.layers.kda import KimiDeltaAttention
from engine.layers.mla import GatedMLA
from engine.layers.moe import LatentMoE
from engine.numerics import all_finite, nonfinite_error
from engine.parallel import comm
from engine.parallel.ep import expert_range
from engine.parallel.mesh import SINGLE, ParallelContext, check_divisible
from engine.parallel.tp import VocabParallelEmbedding
from engine.probes import ProbeContext, bind_probes
from engine.runtime import RuntimeOptions
from engine.vision.preprocess import ProcessedImage
from engine.vision.tower import VisionModel


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, runtime: RuntimeOptions,
                 expert_ids: Sequence[int] | None = None, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.parallel = parallel
        self.eps = c.rms_norm_eps
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.block_size = c.attn_res_block_size
        if self.block_size is not None:
            self.self_attention_res_norm = ResNorm(c.hidden_size)
            self.self_attention_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
            self.mlp_res_norm = ResNorm(c.hidden_size)
            self.mlp_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
        if c.is_kda_layer(layer_idx):
            self.self_attn: nn.Module = KimiDeltaAttention(c, layer_idx, runtime, parallel)
        else:
            self.self_attn = GatedMLA(c, layer_idx, runtime, parallel)
        self.is_moe = c.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(c, runtime, expert_ids, parallel, layer_idx)
        else:
            # tensor parallel: this rank's slice of the width; down_proj is row-parallel
            self.mlp = GatedMLP(c.hidden_size, parallel.split(c.intermediate_size), activation(c))
        # named hook points (engine.hooks; docs/hooks.md): identity modules, called only with a hook attached.
        # resid_* see the prefix sum P of the current block (spec section 2), [B, T, hidden]
        name = f"blocks.{layer_idx}"
        self.hook_resid_pre = HookPoint(f"{name}.hook_resid_pre")
        self.hook_attn_res_weights = HookPoint(f"{name}.attn_res.hook_weights")  # [B, T, blocks + 1]
        self.hook_attn_res_out = HookPoint(f"{name}.attn_res.hook_out")  # the mixer's input, before its norm
        self.hook_attn_out = HookPoint(f"{name}.attn.hook_out")  # the mixer's output (KDA or MLA)
        self.hook_resid_mid = HookPoint(f"{name}.hook_resid_mid")
        self.hook_mlp_res_weights = HookPoint(f"{name}.mlp_res.hook_weights")
        self.hook_mlp_res_out = HookPoint(f"{name}.mlp_res.hook_out")
        self.hook_mlp_out = HookPoint(f"{name}.mlp.hook_out")  # the FFN's output (dense MLP or MoE)
        self.hook_resid_post = HookPoint(f"{name}.hook_resid_post")

    def mixer(self, x: torch.Tensor, state: KDAState | MLACache | None, start: int,
              key_start: torch.Tensor | None) -> torch.Tensor:
        return self.self_attn(x, state, start, key_start)

    def ffn(self, x: torch.Tensor, start: int) -> torch.Tensor:
        if self.is_moe:
            return self.block_sparse_moe(x, start)
        return comm.all_reduce(self.mlp(x), self.parallel, "mlp")

    def forward(self, prefix: torch.Tensor, blocks: list[torch.Tensor], state=None, start: int = 0,
                key_start: torch.Tensor | None = None) -> torch.Tensor:
        """One layer. Returns the new prefix sum; appends to `blocks` at block starts (K3)."""
        prefix = through(self.hook_resid_pre, prefix, start)
        if self.block_size is None:
            h = through(self.hook_resid_mid, prefix + through(
                self.hook_attn_out, self.mixer(self.input_layernorm(prefix), state, start, key_start), start), start)
            return through(self.hook_resid_post,
                           h + through(self.hook_mlp_out, self.ffn(self.post_attention_layernorm(h), start), start),
                           start)
        h = attn_res(prefix, blocks, self.self_attention_res_norm.weight, self.self_attention_res_proj.weight,
                     self.eps, self.hook_attn_res_weights, start) if blocks else prefix
        h = through(self.hook_attn_res_out, h, start)
        if self.layer_idx % self.block_size == 0:
            blocks.append(prefix)
            prefix = torch.zeros_like(prefix)
        mixed = through(self.hook_attn_out, self.mixer(self.input_layernorm(h), state, start, key_start), start)
        prefix = through(self.hook_resid_mid, prefix + mixed, start)
        m = attn_res(prefix, blocks, self.mlp_res_norm.weight, self.mlp_res_proj.weight, self.eps,
                     self.hook_mlp_res_weights, start)
        m = through(self.hook_mlp_res_out, m, start)
        out = through(self.hook_mlp_out, self.ffn(self.post_attention_layernorm(m), start), start)
        return through(self.hook_resid_post, prefix + out, start)


class KimiModel(nn.Module):
    """`model.*`: embeddings, decoder layers, final norm (and the output AttnRes mix)."""

    def __init__(self, config: ModelConfig, runtime: RuntimeOptions, expert_ids: Sequence[int] | None = None,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        c = config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(c, i, runtime, expert_ids, parallel)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_res = c.attn_res_block_size is not None
        self.eps = c.rms_norm_eps
        if self.attn_res:
            self.output_attn_res_norm = ResNorm(c.hidden_size)
            self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
        self.hook_embed = HookPoint("hook_embed")  # [B, T, hidden]
        self.hook_attn_res_final_weights = HookPoint("attn_res_final.hook_weights")  # [B, T, blocks + 1]
        self.hook_attn_res_final_out = HookPoint("attn_res_final.hook_out")  # the final norm's input
        self.hook_normalized = HookPoint("ln_final.hook_normalized")  # what lm_head reads
        bind_points(self)  # `self.hook_*` reads without nn.Module.__getattr__ (eager decode reads ~150 a step)

    def forward(self, input_ids: torch.Tensor, state: ModelState | None = None,
                layer_outputs: list[torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (or `inputs_embeds` [B, T, hidden]) -> final normed hidden [B, T, hidden].
        `start`: the first position as a device tensor (the decode step, `engine.decode.step`); default
        `state.length`."""
        if start is None:
            start = 0 if state is None else state.length
        key_start = None if state is None else state.key_start
        prefix = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        prefix = through(self.hook_embed, prefix, start)
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            prefix = layer(prefix, blocks, None if state is None else state.layers[i], start, key_start)
            if layer_outputs is not None:
                layer_outputs.append(prefix)
        if self.attn_res:
            prefix = attn_res(prefix, blocks, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
                              self.eps, self.hook_attn_res_final_weights, start)
            prefix = through(self.hook_attn_res_final_out, prefix, start)
        return through(self.hook_normalized, self.norm(prefix), start)

    def output_mix(self, prefix: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The head's input for a prefix sum `prefix` [..., hidden] and the blocks available at its depth
        (each [..., hidden]): the output AttnRes mix (K3) and the final norm, as `forward` applies them
        after the last layer (the AttnRes logit lens applies it at every depth)."""
        if self.attn_res:
            prefix = attn_res(prefix, blocks, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
                              self.eps)
        return self.norm(prefix)


class KimiForCausalLM(nn.Module):
    """The model. `forward(input_ids [B, T]) -> logits [B, T, vocab]`; with `image_embeds` the
    positions holding `<|media_pad|>` take the projector's outputs instead of the token embedding.

    Attributes:
        config: the parsed `ModelConfig`.
        vision: the MoonViT-V2 tower + merge + projector (`engine.vision.VisionModel`, keys = the
            checkpoint's `vision_tower.*` / `mm_projector.*` names), or None when the config has no
            vision tower or the checkpoint holds no vision tensors (`vision_unavailable` says why).
        runtime: switches shared by all layers (`RuntimeOptions`).
        parallel: this process's place in the tensor/expert-parallel layout (`ParallelContext`);
            with world > 1 every rank holds its heads, widths, vocabulary rows and experts, and
            `forward` returns the full logits on every rank.
    """

    def __init__(self, config: ModelConfig, runtime: RuntimeOptions | None = None,
                 expert_ids: Sequence[int] | None = None, parallel: ParallelContext = SINGLE,
                 with_vision: bool = True) -> None:
        super().__init__()
        if parallel.world > 1:
            check_divisible(config, parallel.world)
            if expert_ids is None:
                expert_ids = expert_range(config.num_experts, parallel.rank, parallel.world)
        self.config = config
        self.runtime = runtime or RuntimeOptions()
        self.parallel = parallel
        self.probe_context = ProbeContext(rank=parallel.rank)  # step and phase set by the session per forward
        self.model = KimiModel(config, self.runtime, expert_ids, parallel)
        self.lm_head = nn.Linear(config.hidden_size, parallel.split(config.vocab_size), bias=False)
        # The vision tower is replicated, never split: every rank holds all of it and computes the
        # same image embeddings (0.45 B parameters, about 0.9 GB in bf16 at K3.1 Pro size, small
        # beside the ~195 GB of text weights a rank of 8 holds), so no collective is needed for images.
        self.vision: VisionModel | None = (VisionModel(config.vision) if config.vision is not None and with_vision
                                           else None)
        placeholder = config.special_token_problem("media_placeholder_token_id") if config.vision else None
        self.vision_unavailable: str | None = (
            "this model has no vision tower" if config.vision is None else
            "the checkpoint holds no vision tensors (a text-only export)" if self.vision is None else
            f"the config's {placeholder}: image positions cannot be written" if placeholder else None)
        bind_probes(self, self.probe_context)

    def empty_state(self, batch: int = 1, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", capacity: int = 256) -> ModelState:
        """Per-sequence state shaped for this process: its KDA heads under tensor parallelism."""
        return ModelState.empty(self.config, batch, dtype=dtype, device=device, capacity=capacity,
                                kda_heads=self.parallel.split(self.config.kda_num_heads))

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise InputError(f"input_ids must be a tensor of token ids [batch, tokens], got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise InputError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:  # the layers' shapes assume at least one position
            raise InputError(f"input_ids holds no tokens (shape {tuple(input_ids.shape)}); give at least one")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= self.config.vocab_size)]
            raise InputError(f"token ids {bad.unique()[:8].tolist()} are outside the vocabulary "
                             f"[0, {self.config.vocab_size})")

    def encode_images(self, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        """Run the vision tower on preprocessed images: one `[(h/2)(w/2), hidden]` tensor each (every
        image attends only to itself). InputError when the model has no vision weights."""
        if self.vision is None or self.vision_unavailable:
            names = ", ".join(im.name for im in images[:3])
            raise InputError(f"{names or 'image'}: images are unavailable: {self.vision_unavailable}")
        return self.vision.embed(images)

    def embed_inputs(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None,
                     image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings `[B, T, hidden]` with the image positions replaced by `image_embeds`.

        Args:
            image_embeds: `[N, hidden]` projector outputs, in position order (batch row, then position).
            image_mask: `[B, T]` bool, True at the N image positions; default: where `input_ids`
                holds `media_placeholder_token_id` (expanded ids, `engine.vision.expand_media_placeholders`).
        """
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is None:
            return embeds
        if image_mask is None:
            problem = self.config.special_token_problem("media_placeholder_token_id")
            if problem:
                raise InputError(f"image embeddings need the media placeholder token: {problem}")
            pad = self.config.media_placeholder_token_id
            image_mask = input_ids == pad
        if image_mask.shape != input_ids.shape:
            raise InputError(f"image_mask has shape {tuple(image_mask.shape)}; input_ids {tuple(input_ids.shape)}")
        n = int(image_mask.sum())
        if image_embeds.dim() != 2 or image_embeds.shape != (n, embeds.shape[-1]):
            raise InputError(f"{n} image positions need image_embeds of shape [{n}, {embeds.shape[-1]}], "
                             f"got {tuple(image_embeds.shape)}")
        return embeds.masked_scatter(image_mask.to(embeds.device)[..., None], image_embeds.to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor, state: ModelState | None = None, *, last_only: bool = False,
                layer_outputs: list[torch.Tensor] | None = None, image_embeds: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward.

        Args:
            input_ids (torch.Tensor): `[B, T]` token ids.
            image_embeds / image_mask (torch.Tensor, Optional): projector outputs `[N, hidden]` for
                the image positions (see `embed_inputs`); the language model treats them like any
                token (causal, no positional encoding).
            inputs_embeds (torch.Tensor, Optional): `[B, T, hidden]` input embeddings to run instead
                of looking up `input_ids` (which are still checked and name the positions in errors).
            state (ModelState, Optional): continue after `state.length` tokens; layers read and update
                it, but `state.length` is left for the caller (the session) to advance.
            last_only (bool): compute logits for the last position only (`[B, 1, vocab]`).
            layer_outputs (list, Optional): receives each layer's output (the residual prefix).

        Returns:
            logits `[B, T, vocab]` (or `[B, 1, vocab]`).
        """
        self.check_input_ids(input_ids)
        if inputs_embeds is None and image_embeds is not None:
            inputs_embeds = self.embed_inputs(input_ids, image_embeds, image_mask)
        hidden = self.model(input_ids, state, layer_outputs, inputs_embeds)
        if last_only:
            hidden = hidden[:, -1:]
        logits_bytes = hidden.shape[:-1].numel() * self.lm_head.out_features * hidden.element_size()
        if hidden.device.type == "cpu" and logits_bytes >= LARGE_ALLOCATION_BYTES:
            # every position's logits are a fresh mapping on top of the heap the layers' transients grew:
            # its free pages go back first, or both count at the peak (engine.heap)
            release_free_heap()
        logits = comm.all_gather(self.lm_head(hidden), self.parallel, dim=-1, tag="lm_head")
        if not all_finite(logits):  # one reduction; the culprit is only searched on failure
            raise nonfinite_error(self, input_ids, logits, state)
        return logits
