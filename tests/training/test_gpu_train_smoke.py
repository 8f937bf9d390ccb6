"""The GPU training run's entry point at smoke size on the CPU (`python -m training.gpu_run --smoke`,
what `SMOKE=1 training/gpu_train.sh` runs): it measures, plans, trains a few steps, exports, evaluates
tiny interval cells and compares; every file it promises is there and the checkpoint loads with
`engine.load_model`. Run again on the same directory, it reuses the saved plan and state."""

from __future__ import annotations

import json

import torch

from engine import load_model
from training import gpu_run


def test_smoke_run_writes_a_loadable_checkpoint_and_reruns_from_its_plan(tmp_path, capsys) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "out"
    baseline = tmp_path / "absent.json"   # the comparison's path without builtin:demo's table
    args = ["--out", str(out), "--smoke", "--device", "cpu", "--baseline", str(baseline), "--threads", "1"]
    assert gpu_run.main(args) == 0
    ckpt = out / "checkpoint"
    for name in ("config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json",
                 "training.json", "MODEL_CARD.md", "generation_config.json", "prompting.json", "loss.csv",
                 "eval.json", "intervals.json", "INTERVALS.md", "plan.json"):
        assert (ckpt / name).is_file(), name
    for name in ("plan.json", "intervals.json", "INTERVALS.md", "COMPARISON.md", "comparison.json"):
        assert (out / name).is_file(), name
    assert (out / "state" / "latest.json").is_file()
    model = load_model(ckpt)
    assert model.config.expert_format == "mxfp4" and model.config.vision is not None
    rows = json.loads((out / "intervals.json").read_text())
    assert [(r["world"], r["length"], r["prompts"]) for r in rows] == [("in-world", 512, 1), ("held-out", 512, 1)]
    assert all(0.0 <= r["lo"] <= r["hi"] <= 1.0 for r in rows)
    plan = json.loads((out / "plan.json").read_text())
    training = json.loads((ckpt / "training.json").read_text())
    assert training["stage_spec"] == plan["stage_spec"] and training["size"] == "demo"
    assert (out / "COMPARISON.md").read_text().strip().endswith("beats builtin:demo on both tables: no (no baseline table)")
    capsys.readouterr()

    assert gpu_run.main(args) == 0   # finished state: no new measurement, exported and evaluated again
    printed = capsys.readouterr().out
    assert "resuming the plan" in printed and "measuring" not in printed
    assert json.loads((out / "plan.json").read_text()) == plan
