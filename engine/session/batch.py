"""Batched generation for several sequences of different lengths.

Prompts are left-padded to a common length; `ModelState.key_start` tells every layer where each
row really begins, so padding never leaks into any state: KDA sees zero inputs and no decay on
padding slots (its state after them is exactly a fresh one), MLA and the DSA indexer never see a
padding key. The model has no positional encoding, so a row's tokens compute exactly what they
compute alone. Rows decode in lock step; a row that has stopped keeps feeding its last token, and
its outputs are ignored.

    rows = BatchSession(model).generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(temperature=0))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.errors import InputError
from engine.model import KimiForCausalLM
from engine.session.sampling import SamplingParams, make_generator, sample


@dataclass
class BatchResult:
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False


class BatchSession:
    """One forward per step for a batch of independent sequences."""

    def __init__(self, model: KimiForCausalLM, *, prefill_chunk: int = 2048, pad_id: int = 0) -> None:
        self.model = model
        self.config = model.config
        self.prefill_chunk = prefill_chunk
        self.pad_id = pad_id
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.state = None
        self.lengths: list[int] = []

    def prefill(self, prompts: Sequence[Sequence[int]], *, return_logits: bool = False) -> torch.Tensor:
        """Left-pad and run the prompts. Returns the last logits [B, V], or all [B, L, V] (padding
        rows of each sequence first) with return_logits."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("every prompt of a batch needs at least one token")
        longest = max(len(p) for p in prompts)
        if longest > self.config.max_position_embeddings:
            raise InputError(f"a prompt has {longest} tokens; the model's limit is {self.config.max_position_embeddings}")
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p):] = torch.tensor(list(p), dtype=torch.long)
        self.model.check_input_ids(ids)
        self.lengths = [len(p) for p in prompts]
        self.state = self.model.empty_state(len(prompts), dtype=self.dtype, device=self.device)
        self.state.key_start = torch.tensor([longest - n for n in self.lengths], device=self.device)
        ids = ids.to(self.device)
        outputs = []
        with torch.inference_mode():
            for c0 in range(0, longest, self.prefill_chunk):
                chunk = ids[:, c0:c0 + self.prefill_chunk]
                logits = self.model(chunk, self.state, last_only=not return_logits).float()
                self.state.length += chunk.shape[1]
                outputs.append(logits)
        return torch.cat(outputs, dim=1) if return_logits else outputs[-1][:, -1]

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; returns the next logits [B, V]."""
        if self.state is None:
            raise InputError("prefill the batch first")
        with torch.inference_mode():
            x = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)
            logits = self.model(x, self.state)[:, -1].float()
        self.state.length += 1
        return logits

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[BatchResult]:
        """Sample every row to its own stop; `params` per row or shared (each row has its own
        generator seeded from its params, as a lone `Session` would be)."""
        per_row = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_row) != len(prompts):
            raise InputError(f"{len(per_row)} sampling params for {len(prompts)} prompts")
        generators = [make_generator(p.seed) for p in per_row]
        results = [BatchResult() for _ in prompts]
        logits = self.prefill(prompts)
        stops = [set(p.stop_ids) | ({self.config.special_token_id("eos_token_id")} - {None})
                 for p in per_row]
        budget = max(p.max_new_tokens for p in per_row)
        last = [p[-1] for p in prompts]
        for step in range(budget):
            for row, (res, p) in enumerate(zip(results, per_row)):
                if res.stopped or step >= p.max_new_tokens:
                    res.stopped = True
                    continue
                token = sample(logits[row], p, generators[row])
                res.tokens.append(token)
                last[row] = token
                if token in stops[row] or len(res.tokens) == p.max_new_tokens:
                    res.stopped = True
            if all(r.stopped for r in results) or max(self.lengths) + step + 1 >= self.config.max_position_embeddings:
                break
            logits = self.step(last)
        return results
