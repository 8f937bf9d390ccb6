"""Deterministic random weights for any config, tensor by tensor.

Each tensor is drawn from its own generator seeded by (seed, name), so a tensor's value does not
depend on which other tensors are drawn or in what order: `preset:NAME` in memory, a written
checkpoint, and one rank's slice of it all agree. Values are scaled so activations stay O(1)
(projections ~ N(0, 1/fan_in)), norms sit near 1, and KDA decays span short and long memories.
Floats are rounded through the storage dtype (bf16 by default; the real checkpoint keeps A_log,
dt_bias, conv weights, o_norm and the router bias in fp32), so memory and disk agree bit for bit.
"""

from __future__ import annotations

import math
import zlib

import torch

from engine.config import ModelConfig
from engine.errors import InputError
from engine.ops.mxfp4 import reference as mxfp4
from engine.weights.names import TensorSpec

# each tensor's generator seed is seed * 1_000_003 + crc32(name), which must fit the 64 bits
# a torch generator takes
MAX_SEED = (2 ** 64 - 1 - 2 ** 32) // 1_000_003
FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def storage_dtype(spec: TensorSpec, float_dtype: torch.dtype) -> torch.dtype:
    if spec.kind != "float":
        return torch.uint8
    return torch.float32 if spec.name.endswith(FP32_SUFFIXES) else float_dtype


class RandomSource:
    """`get(spec)` returns the tensor a random checkpoint of `config` holds under `spec.name`."""

    def __init__(self, config: ModelConfig, seed: int = 0, float_dtype: torch.dtype = torch.bfloat16) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InputError(f"weights seed must be an integer in [0, {MAX_SEED}], got {seed!r:.40}")
        self.config = config
        self.seed = seed
        self.float_dtype = float_dtype
        self._mx_cache: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def get(self, spec: TensorSpec) -> torch.Tensor:
        if spec.kind in ("packed", "scale"):
            return self._mxfp4_part(spec)
        value = self._float(spec)
        return value.to(storage_dtype(spec, self.float_dtype))

    def get_slice(self, spec: TensorSpec, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows/columns [start, stop) of `dim`: drawn whole, then cut (so every rank agrees)."""
        return self.get(spec).narrow(dim, start, stop - start)

    def _mxfp4_part(self, spec: TensorSpec) -> torch.Tensor:
        base = spec.name.rsplit(".", 1)[0]  # ...experts.{e}.w1
        if self._mx_cache is None or self._mx_cache[0] != base:
            out_f = spec.shape[0]
            in_f = spec.shape[1] * (2 if spec.kind == "packed" else 32)
            dense = torch.randn(out_f, in_f, generator=self._gen(base)) / math.sqrt(in_f)
            self._mx_cache = (base, mxfp4.quantize(dense))
        packed, scale = self._mx_cache[1]
        return packed if spec.kind == "packed" else scale

    def _float(self, spec: TensorSpec) -> torch.Tensor:
        g = self._gen(spec.name)
        shape, init = spec.shape, spec.init

        def randn(std: float = 1.0) -> torch.Tensor:
            return torch.randn(shape, generator=g) * std

        def uniform(lo: float, hi: float) -> torch.Tensor:
            return lo + (hi - lo) * torch.rand(shape, generator=g)

        fan_in = shape[-1] if len(shape) > 1 else 1
        if init == "embed":
            return randn()
        if init == "norm":
            return 1.0 + randn(0.1)
        if init == "bias":
            return randn(0.1)
        if init == "conv":
            return randn(0.5)
        if init == "a_log":
            return torch.log(uniform(1.0, 8.0))
        if init == "dt_bias":
            if self.config.kda_gate_lower_bound is not None:
                # bounded gate: z well below 0 gives slow decay, near 0 fast; spread over both
                return uniform(-6.0, 0.0)
            dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
            return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        if init == "router_bias":
            return randn(0.1)
        if init in ("linear", "router", "res_proj"):
            return randn(1.0 / math.sqrt(fan_in))
        raise ValueError(f"no random init rule {init!r} for {spec.name}")
