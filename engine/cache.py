"""Per-sequence state, one typed object per layer kind (spec section 10).

- `KDAState`: the recurrent state S [B, H, K, V] (fp32) and the short-conv tail [B, 3D, k-1].
- `MLACache`: latent c [B, cap, R] + shared key k_r [B, cap, Dr], plus the DSA indexer keys
  [B, cap, Di] on K3.1's sparse layers. Rows are indexed by sequence position.
- `ModelState`: one entry per layer and the number of tokens already consumed (`length`).

Shapes and dtypes come from the config alone (`state_shapes`), so a planner can size them without
building a model. Layers read and write rows [start, start + T) of a cache but never move
`length`: only the session does (after a whole forward step succeeded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig


@dataclass
class KDAState:
    """Recurrent memory of one KDA layer for a batch of sequences."""

    recurrent: torch.Tensor  # [B, H, K, V] fp32
    conv: torch.Tensor  # [B, 3 * H * K, kernel - 1] fp32: the last pre-conv q|k|v inputs

    @staticmethod
    def shapes(config: ModelConfig, batch: int,
               heads: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """`heads`: the heads this process holds (tensor parallelism shards them); default all."""
        h, d = heads or config.kda_num_heads, config.kda_head_dim
        return {"recurrent": ((batch, h, d, d), torch.float32),
                "conv": ((batch, 3 * h * d, config.conv_kernel_size - 1), torch.float32)}

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, device: torch.device | str = "cpu",
              heads: int | None = None) -> "KDAState":
        s = cls.shapes(config, batch, heads)
        return cls(**{k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in s.items()})


@dataclass
class MLACache:
    """Latent KV cache (and indexer keys) of one MLA layer; grows in place by doubling."""

    latent: torch.Tensor  # [B, cap, R]
    k_rope: torch.Tensor  # [B, cap, Dr]
    index_keys: torch.Tensor | None  # [B, cap, Di] on DSA layers

    @staticmethod
    def shapes(config: ModelConfig, layer: int, batch: int, length: int,
               dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {"latent": ((batch, length, config.kv_lora_rank), dtype),
               "k_rope": ((batch, length, config.qk_rope_head_dim), dtype)}
        if config.is_dsa_layer(layer):
            assert config.dsa is not None
            out["index_keys"] = ((batch, length, config.dsa.head_dim), dtype)
        return out

    @classmethod
    def empty(cls, config: ModelConfig, layer: int, batch: int, capacity: int = 256,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "MLACache":
        s = cls.shapes(config, layer, batch, capacity, dtype)
        t = {k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in s.items()}
        return cls(latent=t["latent"], k_rope=t["k_rope"], index_keys=t.get("index_keys"))

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    def reserve(self, needed: int) -> None:
        """Grow (amortised doubling) so rows [0, needed) exist."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)

        def grow(t: torch.Tensor) -> torch.Tensor:
            new = t.new_zeros(t.shape[0], cap, t.shape[2])
            new[:, : t.shape[1]] = t
            return new

        self.latent = grow(self.latent)
        self.k_rope = grow(self.k_rope)
        if self.index_keys is not None:
            self.index_keys = grow(self.index_keys)

    def write(self, start: int, latent: torch.Tensor, k_rope: torch.Tensor,
              index_keys: torch.Tensor | None) -> None:
        """Store rows [start, start + T) (T = latent.shape[1])."""
        end = start + latent.shape[1]
        self.reserve(end)
        self.latent[:, start:end] = latent
        self.k_rope[:, start:end] = k_rope
        if index_keys is not None:
            assert self.index_keys is not None
            self.index_keys[:, start:end] = index_keys


LayerState = KDAState | MLACache


@dataclass
class ModelState:
    """Everything a sequence batch carries between forward calls."""

    layers: list[LayerState]
    length: int = 0
    # [B] first real cache slot of each row when a batch is left-padded to a common length (None:
    # no padding); padding slots hold no key and leave the recurrent state untouched
    key_start: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, config: ModelConfig, batch: int = 1, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", capacity: int = 256, kda_heads: int | None = None) -> "ModelState":
        """`kda_heads`: KDA heads per process under tensor parallelism (MLA caches are replicated)."""
        layers: list[LayerState] = []
        for i in range(config.num_hidden_layers):
            if config.is_kda_layer(i):
                layers.append(KDAState.zeros(config, batch, device, kda_heads))
            else:
                layers.append(MLACache.empty(config, i, batch, capacity, dtype, device))
        return cls(layers=layers)


def state_bytes(config: ModelConfig, batch: int, length: int, cache_dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of per-sequence state at `length` tokens, by component (for planning)."""
    out = {"kda_recurrent": 0, "kda_conv": 0, "mla_latent": 0, "indexer_keys": 0}
    for i in range(config.num_hidden_layers):
        if config.is_kda_layer(i):
            for name, (shape, dt) in KDAState.shapes(config, batch).items():
                out["kda_" + name] += _numel(shape) * dt.itemsize
        else:
            for name, (shape, dt) in MLACache.shapes(config, i, batch, length, cache_dtype).items():
                key = "indexer_keys" if name == "index_keys" else "mla_latent"
                out[key] += _numel(shape) * dt.itemsize
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
