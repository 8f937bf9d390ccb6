"""Held-out exact-answer accuracy: needle prompts the training generator never produces.

The model answers `key: value`. Two exact measures per prompt, from one teacher-forced pass:
the value given the key before it (what greedy decoding emits after a response prefilled with
`key: `), and the whole response (restated key and value). A prompt's answer is exactly right
when greedy decoding would emit the whole assistant response
(`<|close|>think<|sep|><|open|>response<|sep|>{answer}<|close|>`): one teacher-forced forward pass
shows that, since greedy decoding emits a sequence iff every token of it is the argmax after its
prefix. Prompts use `workbench.retrieval_text.HELD_OUT` (other filler, key names and needle wording).
"""

from __future__ import annotations

import random
import time

import torch

from engine.model import KimiForCausalLM
from engine.tokenizer import Tokenizer
from training.tasks import HELD_OUT, answer_ids, needle_prompt
from workbench.retrieval_text import World


def _case(tok: Tokenizer, rng: random.Random, length: int, depth: float,
          world: World = HELD_OUT, style: str = "key") -> tuple[list[int], int, dict]:
    s = needle_prompt(tok, world, rng, length, depth, style)
    before, ans, after = answer_ids(tok, s.response)
    prompt = s.ids[: s.prompt_len]
    target = before + ans + after[:1]
    value_at = len(before) + len(tok.encode(s.prefill))   # where the model's own part starts in `target`
    return prompt + target, len(prompt), {"needle": [s.facts[0].start, s.facts[0].end], "answer": s.answer,
                                          "value_at": value_at}


@torch.no_grad()
def needle_accuracy(model: KimiForCausalLM, tok: Tokenizer, *, lengths=(1024,), depths=(0.1, 0.5, 0.9),
                    samples: int | dict = 4, modes=("sparse", "dense"), seed: int = 1234,
                    batch_tokens: int = 16384, world: World = HELD_OUT, style: str = "key") -> list[dict]:
    """Rows {length, depth, mode, correct, total, accuracy, seconds}: one per (length, depth, mode).
    `world`: HELD_OUT (the default: wording the training generator never produces) or TRAIN (the
    training distribution itself, to tell a generalisation gap from a capacity limit). `style`: the
    model's answer style (`answer_parts`); "value given the key" is everything after the prefilled part."""
    was_training = model.training
    model.eval()
    device = model.lm_head.weight.device   # prompts are built on the host, scored where the model lives
    saved = model.runtime.dsa_force_dense
    rows = []
    try:
        for length in lengths:
            n = samples[length] if isinstance(samples, dict) else samples
            for depth in depths:
                # the same prompts for both modes: the comparison is paired
                rng = random.Random(seed * 7919 + length * 31 + int(depth * 100))
                cases = [_case(tok, rng, length, depth, world, style) for _ in range(n)]
                for mode in modes:
                    model.runtime.dsa_force_dense = mode == "dense"
                    started = time.perf_counter()
                    correct = value_correct = 0
                    per = max(1, batch_tokens // max(len(c[0]) for c in cases))
                    for i in range(0, n, per):
                        group = cases[i:i + per]
                        width = max(len(c[0]) for c in group)
                        # left-aligned rows padded at the end: causal, so padding never reaches a row's prefix
                        ids = torch.zeros(len(group), width - 1, dtype=torch.long)
                        for b, (seq, _, _) in enumerate(group):
                            ids[b, : len(seq) - 1] = torch.tensor(seq[:-1])
                        logits = model(ids.to(device))
                        for b, (seq, plen, meta) in enumerate(group):
                            pred = logits[b, plen - 1: len(seq) - 1].argmax(-1).cpu()
                            want = torch.tensor(seq[plen:])
                            correct += int(torch.equal(pred, want))
                            at = meta["value_at"]
                            value_correct += int(torch.equal(pred[at:], want[at:]))
                    rows.append({"length": length, "depth": depth, "mode": mode, "correct": correct,
                                 "value_correct": value_correct, "total": n, "accuracy": correct / n,
                                 "value_accuracy": value_correct / n,
                                 "seconds": round(time.perf_counter() - started, 2)})
    finally:
        model.runtime.dsa_force_dense = saved
        model.train(was_training)
    return rows


def summary(rows: list[dict]) -> str:
    """'1024: sparse 83% (0%) dense 75% (8%) | ...': value given the key (whole response) over depths."""
    parts = []
    for length in sorted({r["length"] for r in rows}):
        bits = []
        for mode in ("sparse", "dense"):
            sel = [r for r in rows if r["length"] == length and r["mode"] == mode]
            if sel:
                total = sum(r["total"] for r in sel)
                acc = sum(r.get("value_correct", r["correct"]) for r in sel) / total
                bits.append(f"{mode} {acc:.0%} ({sum(r['correct'] for r in sel) / total:.0%})")
        parts.append(f"{length}: " + " ".join(bits))
    return " | ".join(parts)
