"""Next-token sampling: pure functions of (logits, params, generator).

- temperature 0 is greedy (argmax, lowest id on ties);
- otherwise logits / temperature, then top-k, then top-p (nucleus) filtering, then one draw from
  a seeded `torch.Generator`, so a run repeated with the same seed is bit-identical.
Model card defaults: temperature 1.0, top-p 0.95.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch

from engine.errors import InputError, NumericsError

_FLOAT32_MAX = 3.0e38  # a little under torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    """Attributes:
    temperature: 0 = greedy; > 0 scales logits before sampling.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 = off).
    top_k: keep the k most likely tokens (0 = off).
    seed: generator seed (None = 0, so runs are reproducible unless asked otherwise).
    max_new_tokens: generation budget; 0 generates nothing (prefill only).
    stop_ids: token ids that end generation (the stop token is emitted, then generation stops).
    """

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{name} must be a number, got {value!r:.40}")
            return float(value)

        def integer(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if not (value is None and allow_none) and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"{name} must be an integer, got {value!r:.40}")

        temperature = number("temperature")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        integer("top_k")
        integer("max_new_tokens")
        integer("seed", allow_none=True)
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            raise InputError(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.stop_ids, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2 ** 31 for i in self.stop_ids):
            raise InputError(f"stop_ids must be token ids, got {self.stop_ids!r:.80}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["stop_ids"] = list(self.stop_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SamplingParams":
        if not isinstance(d, dict):
            raise InputError(f"sampling parameters must be an object, got {type(d).__name__}")
        unknown = sorted(map(str, set(d) - {f.name for f in fields(cls)}))
        if unknown:
            raise InputError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))[:120]}")
        stop = d.get("stop_ids", ())
        if not isinstance(stop, (list, tuple)):
            raise InputError(f"stop_ids must be a list of token ids, got {stop!r:.40}")
        return cls(**{**d, "stop_ids": tuple(stop)})


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(0 if seed is None else int(seed))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V] logits -> [V] fp32 log-weights with excluded tokens at -inf (temperature > 0)."""
    x = logits.float()
    finite = x[torch.isfinite(x)]
    if finite.numel() and float(finite.abs().max()) / temperature > _FLOAT32_MAX:
        # a tiny temperature would overflow logits / temperature to inf and the softmax to NaN:
        # shift by the maximum first (x - max <= 0) and divide in float64, so the best token stays at
        # 0 and the rest go to large negatives or -inf (sampling tends to greedy, as it should)
        x = ((x.double() - finite.max().double()) / temperature).float()
    else:
        x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first always stays)
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token id from `logits` [V] (on any device; the draw happens on the CPU)."""
    logits = logits.detach().float().cpu()
    if torch.isnan(logits).any() or not (logits > float("-inf")).any():
        bad = int(torch.isnan(logits).sum())
        raise NumericsError(f"the model's next-token logits are not usable ({bad} of {logits.numel()} are NaN, "
                            f"or all are -inf); the weights or the input are likely bad")
    if params.temperature == 0:
        return int(logits.argmax())
    weights = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
    return int(torch.multinomial(weights, 1, generator=generator))
