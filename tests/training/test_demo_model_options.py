"""`training.demo_model`'s schedule and wording options: the stage grammar, the first shipped run's
schedule as the default, and a resumed run refusing other settings than the ones it saved."""

from __future__ import annotations

import pytest
import torch

from training import demo_model
from training.demo_model import DEFAULT_STAGES, Stage, parse_stages, schedule


def test_default_stages_are_the_first_shipped_schedule() -> None:
    assert schedule(1.0) == [Stage("dense", 800, 8, 512), Stage("dense", 250, 4, 1024), Stage("warmup", 60, 4, 1024),
                             Stage("sparse", 250, 4, 1024), Stage("sparse", 200, 2, 2048)]
    assert schedule(0.5, "dense:10x2x256,sparse:3x1x512") == [Stage("dense", 5, 2, 256), Stage("sparse", 2, 1, 512)]
    assert parse_stages(DEFAULT_STAGES)[2].phase == "warmup"


@pytest.mark.parametrize("bad", ["dense:10x2", "fast:10x2x256", "dense:0x2x256", "10x2x256"])
def test_bad_stage_names_the_part(bad: str) -> None:
    with pytest.raises(SystemExit, match="--stages"):
        parse_stages(bad)


def test_resume_refuses_other_wording_settings(tmp_path, capsys) -> None:
    common = ["--out", str(tmp_path / "out"), "--state", str(tmp_path / "state"), "--stages", "dense:2x1x128",
              "--no-final", "--eval-every", "1000", "--gaps"]
    assert demo_model.main(common + ["--stop-after", "1", "--varied-share", "0.5"]) == 0
    with pytest.raises(SystemExit, match="other settings.*varied_share"):
        demo_model.main(common + ["--varied-share", "0.7"])
    # the same settings resume and finish
    assert demo_model.main(common + ["--varied-share", "0.5"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_image_questions_train_the_tower_only_from_tower_from(tmp_path) -> None:
    """`--image-every 2 --tower-from 2`: image batches on even steps, the tower and projector at their
    seeded init until step 2, then trained; the log has the image loss on image steps only."""
    import csv

    from safetensors.torch import load_file

    from training import state as state_io

    def vision(step_dir):
        return {k: v for k, v in load_file(step_dir / "model.safetensors").items() if k.startswith("vision.")}

    args = ["--out", str(tmp_path / "out"), "--state", str(tmp_path / "state"), "--stages", "dense:3x1x256",
            "--no-final", "--eval-every", "1000", "--save-every", "1", "--image-every", "2", "--image-batch", "2",
            "--tower-from", "2"]
    assert demo_model.main(args + ["--stop-after", "2"]) == 0
    before = vision(state_io.latest(tmp_path / "state"))
    assert before, "the model carries the vision tower"
    from training.model_setup import trainable_model, trained_demo_config
    init = trainable_model(trained_demo_config(vision=True), 0).state_dict()
    assert all(torch.equal(init[k], v) for k, v in before.items()), "step 0's image batch left the vision weights alone"
    assert demo_model.main(args) == 0
    after = vision(state_io.latest(tmp_path / "state"))
    assert any(not (before[k] == after[k]).all() for k in before if "vision_tower" in k)
    assert any(not (before[k] == after[k]).all() for k in before if "vision_tower" not in k)
    rows = list(csv.DictReader(open(tmp_path / "state" / "loss.csv")))
    assert [r["image_loss"] != "nan" for r in rows] == [True, False, True]
