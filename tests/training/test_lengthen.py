"""training.lengthen: continues a base text run (read only), resumable, exports with the tower."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from training import lengthen
from training import state as state_io
from training.model_setup import export, trainable_model, trained_demo_config


def _tiny(scale: float, stages: str = "") -> list[lengthen.Stage]:
    return [lengthen.Stage(1, 1, 256), lengthen.Stage(1, 1, 384)]


def _files(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_continues_the_base_resumes_and_leaves_the_base_alone(base, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lengthen, "schedule", _tiny)
    before = _files(base)
    state = tmp_path / "len"
    args = ["--base", str(base), "--state", str(state), "--eval-every", "100", "--eval-during", "", "--no-final"]
    assert lengthen.main(args + ["--stop-after", "1"]) == 0
    first = load_file(str(state / "step-0000001" / "model.safetensors"))
    base_w = load_file(str(base / "step-0000003" / "model.safetensors"))
    assert set(first) == set(base_w)
    assert any(not torch.equal(first[k], base_w[k]) for k in base_w if not k.endswith("e_score_correction_bias"))

    with pytest.raises(SystemExit, match="other settings"):   # a resume must keep the run's settings
        lengthen.main(args + ["--lr", "1e-4"])
    with pytest.raises(SystemExit, match="other settings"):   # the data options too (their defaults recorded)
        lengthen.main(args + ["--gaps"])
    assert lengthen.main(args) == 0   # resumes at step 1
    rows = list(csv.DictReader(open(state / "loss.csv")))
    assert [r["step"] for r in rows] == ["0", "1"] and [r["length"] for r in rows] == ["256", "384"]
    info = json.loads((state / "step-0000002" / "state.json").read_text())
    assert info["base"]["base_step"] == 3 and info["topk"] == 64 and info["drill_share"] == 0.5
    assert _files(base) == before


def test_export_carries_the_untrained_tower(base, tmp_path) -> None:
    model = trainable_model(trained_demo_config(64), 0)
    lengthen.load_base(base, model)
    full, config = lengthen.with_tower(model, 64, 0)
    assert config.vision is not None and full.vision is not None
    fresh = trainable_model(trained_demo_config(64, vision=True), 0).state_dict()
    state = full.state_dict()
    assert all(torch.equal(state[k], fresh[k]) for k in state if k.startswith("vision."))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert load_model(export(full, config, tmp_path / "ckpt")).vision is not None


def test_starts_from_a_written_checkpoint_with_its_experts_dequantized(tmp_path) -> None:
    """`--base` may be a checkpoint (how `builtin:demo` is continued once its training state is gone):
    the trainable model then computes what the engine's loader computes from the same files."""
    source = trainable_model(trained_demo_config(64), 3)
    full, config = lengthen.with_tower(source, 64, 3)
    ckpt = export(full, config, tmp_path / "ckpt")
    model = trainable_model(trained_demo_config(64), 0)
    info = lengthen.load_base(ckpt, model)
    assert info["checkpoint"] and info["topk"] == 64 and lengthen.base_settings(ckpt) == (0, 64)
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids), load_model(ckpt)(ids))


def test_stages_parse_and_reject_bad_text() -> None:
    assert lengthen.parse_stages("3x2x256, 1x1x512") == [lengthen.Stage(3, 2, 256), lengthen.Stage(1, 1, 512)]
    for bad in ("3x2", "ax2x256", "0x1x256"):
        with pytest.raises(SystemExit, match="--stages"):
            lengthen.parse_stages(bad)


def test_image_questions_train_the_tower_from_a_text_base_and_resume(base, tmp_path, monkeypatch) -> None:
    """`--image-every`: a text-only base gets the tower's seeded init, the image steps train tower and
    projector (the loss curve gains `image_loss` on those steps), and the state resumes with its tower."""
    monkeypatch.setattr(lengthen, "schedule", _tiny)
    state = tmp_path / "img"
    args = ["--base", str(base), "--state", str(state), "--eval-every", "100", "--eval-during", "", "--no-final",
            "--image-every", "2", "--image-batch", "2", "--image-length", "256"]
    assert lengthen.main(args + ["--stop-after", "1"]) == 0
    saved = load_file(str(state / "step-0000001" / "model.safetensors"))
    fresh = trainable_model(trained_demo_config(64, vision=True), 0).state_dict()
    tower = [k for k in fresh if k.startswith("vision.")]
    assert tower and set(saved) == set(fresh)
    assert any(not torch.equal(saved[k], fresh[k]) for k in tower)   # step 0 was an image step
    with pytest.raises(SystemExit, match="other settings"):
        lengthen.main(args[:-6] + ["--image-every", "3"])
    assert lengthen.main(args) == 0
    rows = list(csv.DictReader(open(state / "loss.csv")))
    assert rows[0]["image_loss"] != "nan" and rows[1]["image_loss"] == "nan"
    assert lengthen.base_has_tower(state) and not lengthen.base_has_tower(base)

    # the export writes MXFP4 experts with the trained tower (the training model's experts are dense)
    from training import export_state

    class Written(Exception):
        pass

    def written(full, config, out, losses):
        assert full.vision is not None
        raise Written(config)

    monkeypatch.setattr(lengthen, "export_and_reload", written)
    with pytest.raises(Written) as caught:
        export_state.main(["--state", str(state), "--out", str(tmp_path / "img-ckpt"), "--eval-lengths", "512",
                           "--eval-samples", "1"])
    config = caught.value.args[0]
    assert config.expert_format == "mxfp4" and config.vision is not None


def test_a_chain_of_continuations_exports_with_a_card_naming_every_run(base, tmp_path, monkeypatch) -> None:
    """`training.export_state` on a continuation of a continuation: the checkpoint's model card lists
    the chain of runs (`model_card.run_chain` follows each state's base), each run's loss curve lands
    beside it, and the untrained tower is said to be untrained."""
    from training import export_state
    from training.model_card import run_chain

    monkeypatch.setattr(lengthen, "schedule", _tiny)
    common = ["--eval-every", "100", "--eval-during", "", "--no-final"]
    first, second = tmp_path / "len-a", tmp_path / "len-b"
    assert lengthen.main(["--base", str(base), "--state", str(first)] + common) == 0
    assert lengthen.main(["--base", str(first), "--state", str(second), "--stream", "3000000"] + common) == 0
    chain = run_chain(state_io.latest(second))
    assert [Path(c["step_dir"]).parent.name for c in chain] == ["base", "len-a", "len-b"]
    out = tmp_path / "ckpt"
    assert export_state.main(["--state", str(second), "--out", str(out), "--eval-lengths", "512",
                              "--eval-samples", "1"]) == 0
    card = (out / "MODEL_CARD.md").read_text()
    assert "3 runs" in card and "--state " + str(first) in card and "--stream 3000000" in card
    assert "untrained" in card and "{" not in card
    assert {"loss_len-a.csv", "loss_len-b.csv"} <= {p.name for p in out.iterdir()}  # (the base fixture has none)
    assert load_model(out).vision is not None
    from workbench.task_templates import card_of

    prompting = card_of(out)   # the card's prompting defaults ship beside it (the tower is untrained: no pictures)
    assert (prompting.temperature, prompting.tasks) == (0.0, ("find-fact",)) and "one task" in prompting.notice
