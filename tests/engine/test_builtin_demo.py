"""The shipped demo checkpoint (`builtin:demo`): loads, and answers a held-out 2K-token needle prompt
exactly, with some DSA layer selecting the needle for the answer tokens far above chance.

Skipped until the trained checkpoint is installed in engine/builtin/demo/ (see training/README.md).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from engine.builtin import ROOT

pytestmark = pytest.mark.skipif(not (ROOT / "demo" / "config.json").exists(),
                                reason="builtin:demo not installed (train it: training/README.md)")


def test_builtin_demo_answers_a_held_out_needle() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_demo_model import run_case_spans

    from engine import load_model
    from engine.builtin import resolve_builtin
    from engine.tokenizer import Tokenizer
    from training.tasks import HELD_OUT, answer_ids, needle_prompt

    path = resolve_builtin("builtin:demo")
    model = load_model(path)
    tok = Tokenizer.for_model(path, model.config.vocab_size)
    s = needle_prompt(tok, HELD_OUT, random.Random(5), 2048, 0.5)
    before, ans, after = answer_ids(tok, s.answer)
    target = before + ans + after[:1]
    f = s.facts[0]
    at = f.start + f.text.index(s.answer)
    result = run_case_spans(model, tok, s.ids[: s.prompt_len] + target, s.prompt_len, target,
                            {"value": (at, at + len(ans))}, chunk=1024, value=(len(before), len(before) + len(ans)))
    assert result["correct"]
    best = max((v["value"] for v in result["layers"].values()), key=lambda r: r["read"] / max(r["chance"], 1e-12))
    # some DSA layer selects the passcode's own tokens for >= 95% of the answer's tokens; at 2K
    # tokens 64 random picks hit a 6-token span ~17% of the time, so 10x chance is only reachable
    # from ~8K tokens on (benchmarks/bench_demo_model.py reports it there); here: well above it
    assert best["read"] >= 0.95 and best["read"] >= 3 * best["chance"], result["layers"]
