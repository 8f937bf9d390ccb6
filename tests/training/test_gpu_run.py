"""`training.gpu_run`'s sizing (measured speeds and a time budget -> steps per stage, the evaluation's
cost from two prefills), its verdict against builtin:demo's table, and the device plumbing the CUDA
run relies on, checked on the CPU: bf16 autocast through the larger size's training step (dense,
indexer warm-up and sparse, with a picture batch) and states that load onto whatever device asks."""

from __future__ import annotations

import json

import pytest
import torch

from training import device as device_io
from training import state as state_io
from training.demo_model import Stage, weighted_loss
from training.distill import ExpertBalance, IndexerDistill, query_rows
from training.gpu_run import (GPU_PLAN, StageShare, eval_seconds, fit_prefill, plan_stages, stage_spec,
                              write_comparison)
from training.interval_table import Cell


def test_plan_stages_fills_the_budget_at_the_measured_speeds() -> None:
    plan = (StageShare("dense", 0.5, 8, 512), StageShare("warmup", 0.1, 4, 1024), StageShare("sparse", 0.4, 2, 2048))
    speeds = {("dense", 8, 512): 40_960.0, ("warmup", 4, 1024): 81_920.0, ("sparse", 2, 2048): 8_192.0}
    stages = plan_stages(plan, speeds, 100.0)
    # 50 s at 40,960 tokens/s over 4,096-token steps; 10 s at 81,920 / 4,096; 40 s at 8,192 / 4,096
    assert stages == [Stage("dense", 500, 8, 512), Stage("warmup", 200, 4, 1024), Stage("sparse", 80, 2, 2048)]
    assert stage_spec(stages) == "dense:500x8x512,warmup:200x4x1024,sparse:80x2x2048"
    seconds = sum(st.steps * st.batch * st.length / speeds[(st.phase, st.batch, st.length)] for st in stages)
    assert seconds <= 100.0
    # twice the speed, twice the steps; a tiny budget still gives every stage a step; the smoke bound caps them
    assert [s.steps for s in plan_stages(plan, {k: 2 * v for k, v in speeds.items()}, 100.0)] == [1000, 400, 160]
    assert [s.steps for s in plan_stages(plan, speeds, 0.01)] == [1, 1, 1]
    assert [s.steps for s in plan_stages(plan, speeds, 100.0, max_steps=3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="no measured speed"):
        plan_stages(plan, {**speeds, ("sparse", 2, 2048): 0.0}, 100.0)


def test_gpu_plan_keeps_the_demo_order_and_its_shares_sum_to_one() -> None:
    assert [s.phase for s in GPU_PLAN] == ["dense", "dense", "warmup", "sparse", "sparse", "sparse", "sparse"]
    assert sum(s.share for s in GPU_PLAN) == pytest.approx(1.0)
    assert [s.length for s in GPU_PLAN] == sorted(s.length for s in GPU_PLAN)


def test_evaluation_cost_extrapolates_the_square_term() -> None:
    a, b = 1e-5, 1e-10
    fitted = fit_prefill((4096, 16384), (a * 4096 + b * 4096 ** 2, a * 16384 + b * 16384 ** 2))
    assert fitted == pytest.approx((a, b))
    cells = [Cell("in-world", 131072, 2), Cell("held-out", 2048, 3)]
    assert eval_seconds(cells, fitted) == pytest.approx(2 * (a * 131072 + b * 131072 ** 2) + 3 * (a * 2048 + b * 2048 ** 2))
    assert fit_prefill((1000, 2000), (2.0, 3.0)) == (0.0015, 0.0)   # longer is cheaper per token: linear


def _row(world: str, length: int, k: int, n: int) -> dict:
    return {"world": world, "length": length, "prompts": n, "value_correct": k, "correct": k, "lo": 0.0, "hi": 1.0}


def test_comparison_with_the_shipped_table(tmp_path) -> None:
    base = [_row("in-world", 2048, 20, 24), _row("held-out", 2048, 8, 24), _row("in-world", 131072, 5, 24)]
    (tmp_path / "base.json").write_text(json.dumps(base))
    better = [_row("in-world", 2048, 21, 24), _row("held-out", 2048, 20, 24), _row("held-out", 8192, 0, 24)]
    verdict = write_comparison(tmp_path, better, tmp_path / "base.json")
    assert verdict["beats"] and verdict["held-out"]["lengths"] == [2048]   # pooled over the lengths both measured
    text = (tmp_path / "COMPARISON.md").read_text()
    assert text.strip().endswith("beats builtin:demo on both tables: yes") and "| held-out | 2,048 | 20/24 (83%)" in text
    worse_in_world = [_row("in-world", 2048, 2, 24), _row("held-out", 2048, 20, 24)]
    assert not write_comparison(tmp_path, worse_in_world, tmp_path / "base.json")["beats"]
    assert "on both tables: no" in (tmp_path / "COMPARISON.md").read_text()
    missing = write_comparison(tmp_path, better, tmp_path / "absent.json")
    assert not missing["beats"] and "no baseline table" in (tmp_path / "COMPARISON.md").read_text()


def test_device_choice_names_the_problem() -> None:
    assert device_io.resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert device_io.resolve_device("auto").type == "cpu"
        with pytest.raises(SystemExit, match="no CUDA device is visible"):
            device_io.resolve_device("cuda")
    assert not device_io.uses_bf16(torch.device("cpu"), "auto") and device_io.uses_bf16(torch.device("cpu"), "bf16")
    assert device_io.uses_bf16(torch.device("cuda"), "auto") and not device_io.uses_bf16(torch.device("cuda"), "fp32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_gpu_run_without_cuda_says_so(tmp_path) -> None:
    from training import gpu_run

    with pytest.raises(SystemExit, match="no CUDA device is visible.*--smoke"):
        gpu_run.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_larger_size_trains_under_bf16_autocast_and_its_state_loads_anywhere(tmp_path) -> None:
    """The GPU run's model (`gpu_demo_config`, with the tower) through the three phases' steps and a
    picture batch under bf16 autocast (on the CPU: the same casts CUDA autocast makes to matmuls):
    finite losses and gradients, fp32 weights and moments; the saved state holds host tensors."""
    from engine.tokenizer import Tokenizer
    from training.image_tasks import forward_with_images, image_batch
    from training.model_setup import gpu_demo_config, trainable_model
    from training.tasks import batch

    torch.set_num_threads(1)
    tok = Tokenizer.byte_level()
    model = trainable_model(gpu_demo_config(vision=True), 0)
    model.runtime.kernels = "reference"
    distill, balance = IndexerDistill(model), ExpertBalance(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = device_io.autocast(torch.device("cpu"), True)
    gen = torch.Generator().manual_seed(0)
    for step, phase in enumerate(("dense", "warmup", "sparse")):
        ids, weights = batch(tok, 0, step, 1, 128)
        model.runtime.dsa_force_dense = phase != "sparse"
        distill.active, distill.sparse = phase != "dense", phase == "sparse"
        distill.rows = query_rows(weights, 16, gen) if distill.active else None
        with amp:
            loss, _ = weighted_loss(model(ids), ids, weights)
            kl = distill.take()
        assert torch.isfinite(loss) and (kl is None) == (phase == "dense")
        (loss + (kl if kl is not None else 0.0)).backward()
    ids, weights, images, mask = image_batch(tok, 0, 0, 1, 256, vision=model.config.vision)
    model.runtime.dsa_force_dense, distill.active = True, False
    with amp:
        loss, _ = weighted_loss(forward_with_images(model, ids, images, mask), ids, weights)
    loss.backward()
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    opt.step()
    assert balance.update() > 0
    assert all(q.dtype == torch.float32 for q in model.parameters())
    state_io.save(tmp_path, 1, model, {"main": opt}, {"seed": 0})
    again = trainable_model(gpu_demo_config(vision=True), 1)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    state_io.load(state_io.latest(tmp_path), again, {"main": opt2})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    moments = [s["exp_avg"] for s in opt2.state.values()]
    assert moments and all(m.device == q.device for m, q in zip(moments, opt2.state))


def test_unreadable_plan_or_baseline_is_named(tmp_path) -> None:
    from training import gpu_run

    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text("{not json")
    with pytest.raises(SystemExit, match="plan.json: not a plan this program wrote"):
        gpu_run.main(["--out", str(out), "--smoke", "--device", "cpu"])
    plan = {"size": "demo", "train_s": 1.0, "measure_s": 1.0, "tower_from": 0,
            "stages": [{"phase": s.phase, "steps": 1, "batch": s.batch, "length": s.length} for s in gpu_run.SMOKE_PLAN]}
    huge = {**plan, "stages": [{**plan["stages"][0], "batch": 10 ** 9}, *plan["stages"][1:]]}
    for bad, problem in ((huge, "not this program's stage shapes"), ({**plan, "size": "gpu"}, "gpu-size run"),
                         ({**plan, "tower_from": 99}, "tower_from")):
        (out / "plan.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=problem):
            gpu_run.main(["--out", str(out), "--smoke", "--device", "cpu"])
    (tmp_path / "base.json").write_text('[{"world": "held-out"}]')
    verdict = write_comparison(tmp_path, [_row("held-out", 2048, 1, 2)], tmp_path / "base.json")
    assert not verdict["beats"] and "unreadable" in (tmp_path / "COMPARISON.md").read_text()


def test_time_limit_stops_saves_and_exports_what_was_trained(tmp_path) -> None:
    from training import demo_model

    out = tmp_path / "ckpt"
    assert demo_model.main(["--out", str(out), "--state", str(tmp_path / "state"), "--stages", "dense:3x1x128",
                            "--time-limit", "0", "--eval-every", "1000", "--eval-lengths", "256",
                            "--eval-samples", "1", "--device", "cpu"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["stopped_early"].startswith("step 1 of 3")
    assert record["stages"] == [{"phase": "dense", "steps": 1, "batch": 1, "length": 128}]
    assert record["planned_stages"][0]["steps"] == 3 and "hardware" not in record   # a CPU run reads as before
    assert json.loads((tmp_path / "state" / "latest.json").read_text())["step"] == 1
