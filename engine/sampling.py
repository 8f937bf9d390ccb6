"""Next-token sampling: pure functions of (logits, params, generator).

- temperature 0 is greedy (argmax, lowest id on ties);
- otherwise logits / temperature, then top-k, then top-p (nucleus) filtering, then one draw from
  a seeded `torch.Generator`, so a run repeated with the same seed is bit-identical.
Model card defaults: temperature 1.0, top-p 0.95.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from engine.errors import InputError


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
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["stop_ids"] = list(self.stop_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SamplingParams":
        return cls(**{**d, "stop_ids": tuple(d.get("stop_ids", ()))})


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(0 if seed is None else int(seed))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V] logits -> [V] fp32 log-weights with excluded tokens at -inf (temperature > 0)."""
    x = logits.float() / temperature
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
    if params.temperature == 0:
        return int(logits.argmax())
    weights = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
    return int(torch.multinomial(weights, 1, generator=generator))
