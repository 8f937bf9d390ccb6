"""Deployment record: what a session ran on and how fast (the fields evaluation reports ask for).

model, precision, device and device count, prompt and output lengths, TTFT (time to first token),
TPOT (time per output token after the first), decode tokens/s, prefill tokens/s and peak memory
(process RSS high-water mark; plus CUDA's peak allocation when on a GPU).
"""

from __future__ import annotations

import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field

import torch


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


@dataclass
class DeploymentRecord:
    model: str
    config_hash: str
    variant: str
    precision: str
    device: str
    device_count: int = 1
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    peak_memory_bytes: int = 0
    peak_device_memory_bytes: int | None = None
    host: str = field(default_factory=platform.node)
    started_at: float = field(default_factory=time.time)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_tokens += tokens
        self.prefill_seconds += seconds
        if self.prefill_seconds > 0:
            self.prefill_tokens_per_s = self.prompt_tokens / self.prefill_seconds
        self._memory()

    def note_first_token(self, seconds_since_request: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = seconds_since_request

    def note_output_token(self) -> None:
        self.output_tokens += 1

    def note_decode_step(self, seconds: float) -> None:
        """One decode forward (it produces the logits of the next output token)."""
        self.decode_steps += 1
        self.decode_seconds += seconds
        self.tpot_s = self.decode_seconds / self.decode_steps
        self.tokens_per_s = self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else None
        self._memory()

    def _memory(self) -> None:
        self.peak_memory_bytes = max(self.peak_memory_bytes, peak_rss_bytes())
        if torch.cuda.is_available() and self.device.startswith("cuda"):
            self.peak_device_memory_bytes = int(torch.cuda.max_memory_allocated())

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "DeploymentRecord":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)
