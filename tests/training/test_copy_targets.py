"""Copy-attention targets: the pairs name equal tokens, the loss is the engine's attention, and it trains."""

from __future__ import annotations

import csv
import random

import pytest
import torch

from engine.layers.mla import GatedMLA
from engine.ops.mla.reference import dense_attention_expanded
from engine.tokenizer import Tokenizer
from training import lengthen
from training.copy_targets import CopySupervision, copy_attention_loss
from training.model_setup import trainable_model, trained_demo_config
from training.tasks import answer_ids, batch, build
from training.wording import varied_world
from workbench.retrieval_text import TRAIN

TOK = Tokenizer.byte_level()


@pytest.mark.parametrize("style", ["key", "span"])
def test_pairs_point_from_a_row_to_the_token_its_next_token_copies(style) -> None:
    answers_first = 0
    for seed in range(40):
        rng = random.Random(seed)
        world = varied_world(rng, gaps=True) if seed % 2 else TRAIN
        s = build(TOK, world, rng, 1024, drill=seed % 3 == 0, first_weight=3.0, style=style)
        assert s.copies
        for q, k in s.copies:
            assert 0 <= k <= q < len(s.ids) - 1 and s.ids[k] == s.ids[q + 1]
        # the first question's answer: the row before its copied part (the prefill's end) is a query
        start = s.prompt_len + len(answer_ids(TOK, "")[0]) + len(TOK.encode(s.prefill))
        answers_first += (start - 1) in {q for q, _ in s.copies}
    assert answers_first == 40


def test_batch_with_copies_is_the_same_batch_plus_pairs() -> None:
    worlds = lengthen.row_world(0.7, True)
    ids, weights = batch(TOK, 0, 3, 2, 768, world=worlds, first_weight=3.0)
    ids2, weights2, pairs = batch(TOK, 0, 3, 2, 768, world=worlds, first_weight=3.0, copies=True)
    assert torch.equal(ids, ids2) and torch.equal(weights, weights2)
    assert pairs.shape[0] == 2 and pairs.shape[-1] == 2
    valid = pairs[..., 0] >= 0
    b, p = valid.nonzero(as_tuple=True)
    q, k = pairs[b, p, 0], pairs[b, p, 1]
    assert bool((k <= q).all()) and bool((ids[b, q + 1] == ids[b, k]).all())
    assert bool((pairs[~valid] == -1).all())


def _dsa(model) -> list[GatedMLA]:
    return [m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None]


def test_loss_is_minus_log_of_the_engines_attention_on_the_target_mean_over_heads() -> None:
    torch.manual_seed(0)
    model = trainable_model(trained_demo_config(), 0)
    mod = _dsa(model)[-1]
    T = 96
    x = torch.randn(2, T, 128)
    pairs = torch.tensor([[[10, 3], [95, 40], [-1, -1]], [[50, 50], [60, 0], [70, 69]]])
    H, nope = mod.num_heads, mod.nope
    with torch.no_grad():
        loss, mass = copy_attention_loss(mod, x, pairs)
        q = mod.q_b_proj(mod.q_a_layernorm(mod.q_a_proj(x))).unflatten(-1, (H, nope + mod.rope))
        latent, k_rope = mod.kv_a_proj_with_mqa(x).split([mod.kv_lora_rank, mod.rope], dim=-1)
        kv = mod.kv_b_proj(mod.kv_a_layernorm(latent)).unflatten(-1, (H, nope + mod.v_dim))
        k = torch.cat((kv[..., :nope], k_rope.unsqueeze(2).expand(-1, -1, H, -1)), -1)
        # one-hot values: the engine's attention output is then its attention distribution over keys
        onehot = torch.eye(T).expand(2, T, T)[:, :, None, :].expand(-1, -1, H, -1)
        probs = dense_attention_expanded(q, k, onehot, torch.arange(T), mod.scale)   # [B, T, H, T]
    want = [probs[b, qr, :, kp].mean() for b in range(2) for qr, kp in pairs[b].tolist() if qr >= 0]
    want = torch.stack(want)
    torch.testing.assert_close(loss, -want.log().mean(), rtol=1e-4, atol=1e-5)
    assert mass == pytest.approx(float(want.mean()), rel=1e-4)


def test_supervision_hooks_the_last_dsa_layer_and_raises_the_mass() -> None:
    torch.manual_seed(0)
    model = trainable_model(trained_demo_config(), 0)
    copier = CopySupervision(model)
    assert copier.layers == _dsa(model)[-1:] and len(CopySupervision(model, "all").layers) == len(_dsa(model))
    with pytest.raises(ValueError, match="last"):
        CopySupervision(model, "first")
    ids, _, pairs = batch(TOK, 0, 1, 2, 384, copies=True)
    copier.active, copier.pairs = True, pairs
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    masses = []
    for _ in range(5):
        model(ids)
        loss, mass = copier.take()
        loss.backward()
        opt.step()
        opt.zero_grad()
        masses.append(mass)
    assert masses[-1] > 3 * masses[0], masses   # measured: 0.005 -> 0.052
    copier.active = False
    model(ids)
    assert copier.take() == (None, pytest.approx(float("nan"), nan_ok=True))
    copier.remove()


def test_lengthen_records_the_copy_columns_and_refuses_to_resume_without_the_option(base, tmp_path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setattr(lengthen, "schedule", lambda scale, stages="": [lengthen.Stage(2, 1, 256)])
    state = tmp_path / "run"
    args = ["--base", str(base), "--state", str(state), "--eval-during", "", "--no-final", "--copy-weight", "0.5"]
    assert lengthen.main(args + ["--stop-after", "1"]) == 0
    with pytest.raises(SystemExit, match="other settings"):
        lengthen.main(args[:-2])
    assert lengthen.main(args) == 0
    rows = list(csv.DictReader(open(state / "loss.csv")))
    assert len(rows) == 2 and all(float(r["copy_loss"]) > 0 and 0 <= float(r["copy_mass"]) <= 1 for r in rows)


def test_jump_probe_reports_each_case_on_a_saved_state(tmp_path, capsys) -> None:
    from training import jump_probe
    from training import state as state_io

    state_io.save(tmp_path / "s", 1, trainable_model(trained_demo_config(64), 0), {}, {"seed": 0, "topk": 64})
    assert jump_probe.main(["--state", str(tmp_path / "s"), "--length", "384", "--prompts", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[-1].startswith("384 tokens, 2 prompts: value right")
    cases = jump_probe.probe(jump_probe.load(None, tmp_path / "s"), TOK, 384, 1)
    assert len(cases[0].head_probs) == 4 and all(0 <= p <= 1 for p in cases[0].head_probs)
    assert len(cases[0].top_keys) == 3


def test_first_of_runs_keeps_the_jump_of_each_copied_run() -> None:
    from training.copy_targets import first_of_runs

    pairs = torch.tensor([[[10, 3], [11, 4], [12, 5], [30, 20], [-1, -1]], [[7, 1], [9, 2], [10, 3], [-1, -1], [-1, -1]]])
    kept = first_of_runs(pairs)
    assert kept.tolist() == [[[10, 3], [-1, -1], [-1, -1], [30, 20], [-1, -1]],
                             [[7, 1], [9, 2], [-1, -1], [-1, -1], [-1, -1]]]


def test_best_head_loss_is_the_most_attending_heads() -> None:
    torch.manual_seed(0)
    model = trainable_model(trained_demo_config(), 0)
    mod = _dsa(model)[-1]
    x = torch.randn(1, 64, 128)
    pairs = torch.tensor([[[20, 5], [63, 0]]])
    with torch.no_grad():
        mix, _ = copy_attention_loss(mod, x, pairs, "mixture")
        best, best_mass = copy_attention_loss(mod, x, pairs, "best")
    assert float(best) <= float(mix) + 1e-6 and 0 < best_mass <= 1
    with pytest.raises(ValueError, match="heads"):
        CopySupervision(model, heads="all")


def test_lengthen_with_copy_targets_and_picture_questions_trains(base, tmp_path, monkeypatch) -> None:
    """The picture batch is no copy batch: copy targets stop collecting before it, so no copy loss of
    one step's picture forward reaches the next step's backward (it failed there: a graph of weights the
    optimizer had since changed)."""
    monkeypatch.setattr(lengthen, "schedule", lambda scale, stages="": [lengthen.Stage(2, 1, 256)])
    args = ["--base", str(base), "--state", str(tmp_path / "run"), "--eval-during", "", "--no-final",
            "--copy-weight", "0.5", "--image-every", "2", "--image-batch", "2"]
    assert lengthen.main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "run" / "loss.csv")))
    assert [r["image_loss"] != "nan" for r in rows] == [True, False] and all(float(r["copy_loss"]) > 0 for r in rows)
