"""Deployment record: what a session ran on and how fast (the fields evaluation reports ask for), and
whether a deployment computes the model (`ConformanceLine`, one line per `workbench conformance` run).

model, precision, device and device count, prompt and output lengths, TTFT (time to first token),
TPOT (time per output token after the first), decode tokens/s, prefill tokens/s and peak memory
(process RSS high-water mark; plus CUDA's peak allocation when on a GPU).
"""

from __future__ import annotations

import math
import os
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


DEPLOYMENT_LOG = "deployment-record.jsonl"  # one JSON object a line: what was checked about a deployment


@dataclass
class ConformanceLine:
    """One conformance run against a deployment ("does it compute the model?"), as a line of the
    deployment record (`append_line`), beside the run's timings that `DeploymentRecord` holds."""

    endpoint: str
    model: str
    verdict: str                      # conforms | diverges | error
    max_logprob_diff: float | None    # nats, over every compared generated token
    first_divergent_layer: int | None
    first_divergent_position: int | None
    prompts: int
    errors: int = 0
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    kind: str = "conformance"

    def to_json(self) -> dict:
        return asdict(self)


def append_line(path: "str | os.PathLike[str]", line: ConformanceLine) -> None:
    """Append `line` to the deployment record file at `path` (JSON Lines, created when absent; one write
    of a whole line, so concurrent writers never interleave within a line)."""
    import json

    record = line.to_json()
    if record["max_logprob_diff"] is not None and not math.isfinite(record["max_logprob_diff"]):
        record["max_logprob_diff"] = str(record["max_logprob_diff"])  # JSON has no inf: "inf" says it
    text = json.dumps(record, allow_nan=False) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
