"""`workbench attribute`: the --json schema (token positions end exclusive, spans by effect) and bad flags."""

from __future__ import annotations

import json

import torch

from apps.cli import main
from engine.tokenizer import Tokenizer
from workbench.text import haystack

SPAN_KEYS = {"start": int, "end": int, "text": str, "effect": float, "control_min": (float, type(None)),
             "control_max": (float, type(None)), "controls": int, "verdict": str}


def test_json_schema(tmp_path, capsys):
    torch.set_num_threads(1)
    doc = tmp_path / "doc.txt"
    doc.write_text(haystack(900, Tokenizer.for_model("builtin:demo", 512), seed=5))
    out = tmp_path / "out" / "attr.json"
    assert main(["attribute", "--model", "builtin:demo", "--prompt-file", str(doc), "--task", "find-fact", "--key",
                 "garage door", "--value", "7142", "--no-restate", "--masks", "16", "--holdout", "4", "--top", "2",
                 "--seed", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LDS" in printed and "the answer depends on" in printed
    result = json.loads(out.read_text())
    assert isinstance(result["answer"], str) and result["right"] in (True, False, None)
    assert isinstance(result["target_logprob"], float)
    assert result["lds"] is None or isinstance(result["lds"], float)
    assert isinstance(result["prefill_s"], float) and isinstance(result["attribution_s"], float)
    spans = result["spans"]
    for span in spans:
        for key, kind in SPAN_KEYS.items():
            assert isinstance(span[key], kind), (key, span[key])
        assert 0 <= span["start"] < span["end"] <= result["context_tokens"]
    checked = [s for s in spans if s["source"] == "checked"]
    assert len(checked) == 2 and spans[:2] == checked
    assert checked[0]["effect"] <= checked[1]["effect"]  # largest drop first
    assert "7142" in checked[0]["text"] and checked[0]["controls"] == 8
    rest = [s["effect"] for s in spans[2:]]
    assert rest == sorted(rest)


def test_bad_flags(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    base = ["attribute", "--model", "builtin:demo", "--prompt-file"]
    assert main(base + [str(doc), "--question", "What?"]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(base + [str(doc), "--task", "find-fact"]) == 2
    assert "--key" in capsys.readouterr().err
    assert main(base + [str(empty), "--question", "Q", "--target", "T"]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(base + [str(tmp_path / "missing.txt"), "--question", "Q", "--target", "T"]) == 2
