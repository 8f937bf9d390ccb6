"""Per-sequence state, one typed object per layer kind (spec section 10).

- `KDAState`: the recurrent state S [B, H, K, V] (fp32) and the short-conv tail [B, 3D, k-1].
- `MLACache`: latent c [B, cap, R] + shared key k_r [B, cap, Dr], plus the DSA indexer keys
  [B, cap, Di] on K3.1's sparse layers. Rows are indexed by sequence position. On the CPU the
  indexer keys are stored key-major ([B, Di, cap] in memory, seen through a transposed view), because
  every decode step scores all of them: BLAS then streams `q [Hi, Di] @ K [Di, cap]` row by row
  (faster at long context: docs/benchmarks.md, 'Kernels and layers (CPU)'). CUDA keeps rows contiguous (the
  Triton scorer reads whole key rows).
- `ModelState`: one entry per layer and the number of tokens already consumed (`length`).

Shapes and dtypes come from the config alone (`shapes`), so a planner can size them without
building a model. Layers read and write rows [start, start + T) of a cache but never move
`length`: only the session does (after a whole forward step succeeded).

Each state turns itself into named tensors (`to_tensors`) and back (`from_tensors`, which checks
every name and shape against the config and copies), so snapshots and forks never reach into the
fields: `ModelState.to_tensors()` names them `layers.{i}.{field}` (MLA rows [0, length) only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from engine.config import ModelConfig
from engine.errors import InputError

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _checked(tensors: Mapping[str, torch.Tensor], prefix: str, shapes: Shapes) -> dict[str, torch.Tensor]:
    """`tensors[prefix + name]` for every name of `shapes`, each of the shape the config implies."""
    out = {}
    for name, (shape, _) in shapes.items():
        key = prefix + name
        if key not in tensors:
            raise InputError(f"missing tensor {key}")
        if tuple(tensors[key].shape) != tuple(shape):
            raise InputError(f"tensor {key} has shape {list(tensors[key].shape)}, the model implies {list(shape)}")
        out[name] = tensors[key]
    return out


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

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """`recurrent` and `conv` (the tensors themselves, not copies)."""
        return {"recurrent": self.recurrent, "conv": self.conv}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], config: ModelConfig, batch: int, *,
                     heads: int | None = None, device: torch.device | str = "cpu", prefix: str = "") -> "KDAState":
        """A new state holding copies of `tensors[prefix + name]` (names and shapes checked; raises InputError)."""
        shapes = cls.shapes(config, batch, heads)
        found = _checked(tensors, prefix, shapes)
        return cls(**{k: found[k].to(device=device, dtype=dt, copy=True) for k, (_, dt) in shapes.items()})


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
        t = {k: _rows(shape, dt, torch.device(device), key_major=k == "index_keys") for k, (shape, dt) in s.items()}
        return cls(latent=t["latent"], k_rope=t["k_rope"], index_keys=t.get("index_keys"))

    def to_tensors(self, length: int) -> dict[str, torch.Tensor]:
        """Rows [0, length) of `latent`, `k_rope` (and `index_keys` on DSA layers), as views."""
        out = {"latent": self.latent[:, :length], "k_rope": self.k_rope[:, :length]}
        if self.index_keys is not None:
            out["index_keys"] = self.index_keys[:, :length]
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], config: ModelConfig, layer: int, batch: int,
                     length: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     capacity: int = 256, prefix: str = "") -> "MLACache":
        """A new cache (capacity at least `length`) holding copies of rows [0, length) (raises InputError)."""
        found = _checked(tensors, prefix, cls.shapes(config, layer, batch, length))
        cache = cls.empty(config, layer, batch, max(capacity, length), dtype, device)
        for name, t in found.items():
            getattr(cache, name)[:, :length] = t.to(device=device, dtype=dtype)
        return cache

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    def reserve(self, needed: int) -> None:
        """Grow (amortised doubling) so rows [0, needed) exist."""
        if needed > self.capacity:
            self.grow_to(max(needed, 2 * self.capacity))

    def grow_to(self, capacity: int) -> None:
        """Reallocate every buffer at `capacity` rows (at least the current one), keeping the rows
        and each buffer's memory layout."""
        if capacity <= self.capacity:
            return

        def grow(t: torch.Tensor, key_major: bool) -> torch.Tensor:
            new = _rows((t.shape[0], capacity, t.shape[2]), t.dtype, t.device, key_major=key_major)
            new[:, : t.shape[1]] = t
            return new

        self.latent = grow(self.latent, False)
        self.k_rope = grow(self.k_rope, False)
        if self.index_keys is not None:
            self.index_keys = grow(self.index_keys, True)

    def write_at(self, positions: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 index_keys: torch.Tensor | None) -> None:
        """Store rows at `positions` ([T] device tensor) in place, never growing (the decode step:
        the caller reserved the capacity beforehand, so shapes stay static)."""
        self.latent.index_copy_(1, positions, latent.to(self.latent.dtype))
        self.k_rope.index_copy_(1, positions, k_rope.to(self.k_rope.dtype))
        if index_keys is not None:
            assert self.index_keys is not None
            keys = index_keys.to(self.index_keys.dtype)
            if self.index_keys.stride(1) == 1:
                # key-major: write through the [B, Di, cap] buffer itself, so a compiled step updates it in
                # place (through the transposed view inductor copied the whole buffer every step)
                self.index_keys.transpose(1, 2).index_copy_(2, positions, keys.transpose(1, 2))
            else:
                self.index_keys.index_copy_(1, positions, keys)

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


def _rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, key_major: bool) -> torch.Tensor:
    """Zeros of logical shape [B, cap, D]; `key_major` on the CPU stores them [B, D, cap] (a
    transposed view: see the module docstring). Always a normal tensor, also when grown inside
    `inference_mode`, so a compiled decode step sees the same kind of tensor before and after growth."""
    with torch.inference_mode(False):
        if key_major and device.type == "cpu":
            b, cap, d = shape
            return torch.zeros((b, d, cap), dtype=dtype, device=device).transpose(1, 2)
        return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class ModelState:
    """Everything a sequence batch carries between forward calls."""

    layers: list[LayerState]
    length: int = 0
    # [B] first real cache slot of each row when a batch is left-padded to a common length (None:
    # no padding); padding slots hold no key and leave the recurrent state untouched
    key_start: torch.Tensor | None = None

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

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Every layer's state as `layers.{i}.{field}` (MLA rows [0, length) only), plus `key_start` if set."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            parts = layer.to_tensors() if isinstance(layer, KDAState) else layer.to_tensors(self.length)
            out.update({f"layers.{i}.{name}": t for name, t in parts.items()})
        if self.key_start is not None:
            out["key_start"] = self.key_start
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], config: ModelConfig, length: int, batch: int = 1, *,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", capacity: int = 256,
                     kda_heads: int | None = None) -> "ModelState":
        """The inverse of `to_tensors` for a sequence batch that consumed `length` tokens (copies; raises
        InputError naming the first missing or misshapen tensor)."""
        layers: list[LayerState] = []
        for i in range(config.num_hidden_layers):
            prefix = f"layers.{i}."
            if config.is_kda_layer(i):
                layers.append(KDAState.from_tensors(tensors, config, batch, heads=kda_heads, device=device,
                                                    prefix=prefix))
            else:
                layers.append(MLACache.from_tensors(tensors, config, i, batch, length, dtype=dtype, device=device,
                                                    capacity=capacity, prefix=prefix))
        key_start = tensors.get("key_start")
        if key_start is not None:
            key_start = key_start.to(device=device, copy=True)
        return cls(layers=layers, length=length, key_start=key_start)


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
