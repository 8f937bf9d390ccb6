"""`training.trainer`: the loop every job shares, on a job that trains one linear layer (no model to build):
the loss log (the trainer's tokens/s column in its place), saves, evaluations before or after them,
--stop-after, --time-limit and resuming with the same or other settings."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from training import state as state_io
from training import trainer


class LineJob:
    name = "line"
    columns = ["step", "loss", "tokens_per_s", "lr"]

    def __init__(self, total: int = 5) -> None:
        torch.manual_seed(0)
        self.total = total
        self.model = torch.nn.Linear(3, 1)
        self.optimizers = {"main": torch.optim.AdamW(self.model.parameters(), lr=0.1)}
        self.events: list[str] = []

    def start(self, resumed: dict | None, run_info: dict) -> None:
        run_info["started"] = "resumed" if resumed else "fresh"

    def train_step(self, step: int) -> trainer.StepResult:
        x = torch.full((4, 3), float(step + 1))
        loss = self.model(x).pow(2).mean()
        loss.backward()
        loss = float(loss.detach())
        trainer.clipped_step(self.model.parameters(), self.optimizers["main"])
        self.events.append(f"step {step}")
        return trainer.StepResult([step, f"{loss:.5f}", "0.1"], 12, lambda ema, done: (f"loss {loss:.3f}",) * 2)

    def quick_eval(self, step: int, metrics: dict) -> None:
        self.events.append(f"eval {step}")
        metrics["evals"].append({"step": step})


def _train(tmp_path, job, **limits) -> tuple[trainer.Outcome, dict]:
    run_info = {"seed": 0, "lr": 0.1}   # the settings are recorded in every saved state
    return trainer.train(job, tmp_path, run_info, trainer.Limits(job.total, **limits), settings={"lr": 0.1},
                         defaults={})


def test_log_saves_and_evaluations(tmp_path, capsys) -> None:
    job = LineJob()
    outcome, metrics = _train(tmp_path, job, save_every=2, eval_every=2)
    assert outcome == trainer.Outcome(5, "done") and [e["step"] for e in metrics["evals"]] == [2, 4, 5]
    rows = list(csv.DictReader(open(tmp_path / "loss.csv")))
    assert list(rows[0]) == LineJob.columns and [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert all(float(r["tokens_per_s"]) > 0 and r["lr"] == "0.1" for r in rows)
    info = json.loads((state_io.latest(tmp_path) / "state.json").read_text())
    # by default a step is saved before it is evaluated: the last state lacks the last evaluation
    assert info["step"] == 5 and info["started"] == "fresh" and len(info["metrics"]["evals"]) == 2
    assert "step 5/5 loss" in capsys.readouterr().out


def test_evaluation_before_the_save_is_in_the_saved_state(tmp_path) -> None:
    job = LineJob(total=2)
    _train(tmp_path, job, save_every=1, eval_every=1, eval_before_save=True, stop_after=1)
    saved = json.loads((state_io.latest(tmp_path) / "state.json").read_text())
    assert saved["step"] == 1 and saved["metrics"]["evals"] == [{"step": 1}]


def test_stop_after_then_resume_trains_as_one_run(tmp_path) -> None:
    whole = LineJob()
    _train(tmp_path / "whole", whole, save_every=100, eval_every=100)
    first = LineJob()
    assert _train(tmp_path / "split", first, save_every=100, eval_every=100, stop_after=2)[0].reason == "stop-after"
    second = LineJob()
    outcome, _ = _train(tmp_path / "split", second, save_every=100, eval_every=100)
    assert outcome.step == 5 and second.events[0] == "step 2"
    assert all(torch.equal(a, b) for a, b in zip(whole.model.state_dict().values(), second.model.state_dict().values()))
    with open(tmp_path / "split" / "loss.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2", "3", "4"]
    info = json.loads((state_io.latest(tmp_path / "split") / "state.json").read_text())
    assert info["started"] == "resumed"


def test_resume_refuses_other_settings_and_a_check(tmp_path) -> None:
    _train(tmp_path, LineJob(), save_every=1, eval_every=100, stop_after=1)
    job = LineJob()
    with pytest.raises(SystemExit, match="other settings {'lr': \\(0.1, 0.2\\)}"):
        trainer.train(job, tmp_path, {}, trainer.Limits(5, 1, 100), settings={"lr": 0.2}, defaults={})

    def refuse(info: dict) -> None:
        raise SystemExit(f"seed {info['seed']}")
    with pytest.raises(SystemExit, match="seed 0"):
        trainer.train(LineJob(), tmp_path, {}, trainer.Limits(5, 1, 100), check=refuse)


def test_time_limit_saves_and_stops(tmp_path) -> None:
    job = LineJob()
    outcome, _ = _train(tmp_path, job, save_every=100, eval_every=1, time_limit=0.0)
    assert outcome == trainer.Outcome(1, "time-limit") and job.events == ["step 0"]   # no evaluation after it
    assert json.loads((state_io.latest(tmp_path) / "state.json").read_text())["step"] == 1


def test_schedule_helpers() -> None:
    assert [trainer.stage_index([2, 3], s) for s in (0, 1, 2, 4, 5, 99)] == [0, 0, 1, 1, 1, 1]
    assert trainer.warmup_cosine(0, 100, 10, 0.2) == pytest.approx(0.1)
    assert trainer.warmup_cosine(10, 100, 10, 0.2) == pytest.approx(1.0)
    assert trainer.warmup_cosine(100, 100, 10, 0.2) == pytest.approx(0.2)
