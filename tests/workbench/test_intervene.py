"""workbench.intervene and workbench.effects on the tiny preset (issue 30)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import workbench
from engine import load_model
from engine.errors import InputError
from engine.session import Session
from engine.tokenizer import Tokenizer
from tests.helpers import random_ids


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny:k3.1", seed=1)


def context(model) -> Session:
    s = Session(model, Tokenizer.byte_level(), prefill_chunk=16)
    s.append(ids=random_ids(30, 1), name="intro")
    s.append(ids=random_ids(12, 2), name="needle")
    s.append(ids=random_ids(30, 3), name="filler")
    return s


QUESTION = random_ids(6, 4)
HIDE_NEEDLE = {"op": "dsa.hide", "segment": "needle", "layers": "all"}


def test_segments_resolve_and_bad_names_change_nothing(model, tmp_path):
    s = context(model)
    with workbench.intervene(s, HIDE_NEEDLE) as items:
        assert items[0].positions == (30, 42) and s.interventions == items
        s.prefill()
    assert s.interventions == () and s.intervention_log[0]["positions"] == [30, 42]
    for bad, message in (({"op": "dsa.hide", "segment": "nope"}, "no segment named 'nope'"),
                         ({"op": "kda.erase", "segment": "needle", "heads": [9]}, "head(s) [9] do not exist"),
                         ({"op": "moe.ban", "experts": [99]}, "expert(s) [99] do not exist")):
        with pytest.raises(InputError, match="intervention 0") as info:
            with workbench.intervene(s, bad):
                pytest.fail("the block must not run")
        assert message in str(info.value)
    assert len(s.intervention_log) == 1
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"op": "kda.erase", "segment": "needle"}]))
    assert callable(workbench.load_intervention_spec) and callable(workbench.intervene)
    from workbench.interventions import resolve
    assert resolve(s, spec)[0].at == 41  # the segment's last position
    spec.write_text("[{")
    with pytest.raises(InputError, match="spec.json: not valid JSON"):
        resolve(s, spec)


def test_an_edit_restored_after_a_block_is_not_applied_twice(model):
    s = context(model)
    s.prefill()
    s.set_interventions([{"op": "kda.scale", "at": 40, "factor": 0.5}])
    state = s.state.layers[0].recurrent.clone()
    with workbench.intervene(s, HIDE_NEEDLE):
        pass
    assert torch.equal(s.state.layers[0].recurrent, state)


def test_effects_are_deterministic_and_match_a_hand_run(model):
    s = context(model)
    target = random_ids(4, 5)
    first = workbench.effects(s, HIDE_NEEDLE, continuation=QUESTION, target=target, max_new_tokens=5)
    assert s.length == first.fork_at == 72  # the context was prefilled once, up to the fork
    again = workbench.effects(s, HIDE_NEEDLE, continuation=QUESTION, target=target, max_new_tokens=5)
    assert again.plain.answer == first.plain.answer and again.intervened.answer == first.intervened.answer
    assert np.array_equal(again.kl, first.kl)
    assert first.kl.shape == (len(first.plain.answer),) and first.kl.max() > 0
    # by hand: the context as it is, then the question and teacher forcing with the needle hidden
    hand = context(model)
    hand.prefill()
    hand.set_interventions([{"op": "dsa.hide", "positions": [30, 42]}])
    hand.append(ids=QUESTION)
    logits = torch.cat((hand.prefill()[None], hand.feed(target[:-1])))
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(target)[:, None])[:, 0]
    assert np.allclose(first.intervened.target_logprobs, want.numpy(), atol=1e-5)
    table = first.table()
    assert list(table["kind"]).count("target") == 4 and first.target_logprob_change is not None


def test_effects_of_nothing_is_no_effect(model):
    s = context(model)
    out = workbench.effects(s, {"op": "dsa.hide", "positions": [500, 600]}, continuation=QUESTION,
                            target=[1, 2, 3], max_new_tokens=4)
    assert out.plain.answer == out.intervened.answer and float(out.kl.max()) == 0.0
    assert out.target_logprob_change == 0.0


def test_write_side_interventions_fork_before_their_position(model):
    s = context(model)
    spec = {"op": "kda.suppress_writes", "segment": "needle", "layers": "all"}
    out = workbench.effects(s, spec, continuation=QUESTION, max_new_tokens=3)
    assert out.fork_at == 30 and s.length == 30
    assert out.kl.max() > 0
    s.prefill()
    with pytest.raises(InputError, match="has consumed 72 tokens"):
        workbench.effects(s, spec, continuation=QUESTION)


def test_a_recorded_session_keeps_its_interventions_in_the_trace(model, tmp_path):
    s = context(model)
    with workbench.record(s, trace=tmp_path / "t"):
        with workbench.intervene(s, HIDE_NEEDLE):
            s.prefill()
    session_json = json.loads((tmp_path / "t" / "session.json").read_text())
    assert session_json["interventions"] == [{"op": "dsa.hide", "positions": [30, 42], "layers": "all",
                                              "from": 0, "to": 72}]


def test_attribution_rows_stand_beside_controls_and_match_effects(model):
    target = random_ids(3, 6)
    frame = workbench.attribution(context(model), ["needle"], continuation=QUESTION, target=target, kda="layers",
                                  controls=1, seed=1)
    # the needle x (2 DSA layers + all) + the needle x 4 KDA layers + 5 MoE layers
    assert len(frame) == 3 + 4 + 5
    assert set(frame["op"]) == {"dsa.hide", "kda.suppress_writes", "moe.ban"}
    assert frame["effect"].is_monotonic_increasing and frame[["control_min", "control_max"]].notna().all().all()
    again = workbench.attribution(context(model), ["needle"], continuation=QUESTION, target=target, moe=False,
                                  controls=1, seed=1)
    same = frame[frame["op"] == "dsa.hide"].reset_index(drop=True)
    # the same rows and controls (seeded); the context was prefilled in other pieces: float rounding only
    assert again[["op", "segment", "layer"]].equals(same[["op", "segment", "layer"]])
    assert np.allclose(again[["effect", "control_mean", "plain"]], same[["effect", "control_mean", "plain"]], atol=1e-4)
    row = frame[(frame["op"] == "dsa.hide") & (frame["layer"] == "all")].iloc[0]
    direct = workbench.effects(context(model), HIDE_NEEDLE, continuation=QUESTION, target=target, max_new_tokens=1)
    assert row["effect"] == pytest.approx(direct.target_logprob_change, abs=1e-4)
    kda_row = frame[(frame["op"] == "kda.suppress_writes") & (frame["layer"] == "1")].iloc[0]
    direct = workbench.effects(context(model), {"op": "kda.suppress_writes", "segment": "needle", "layers": [1]},
                               continuation=QUESTION, target=target, max_new_tokens=1)
    assert kda_row["effect"] == pytest.approx(direct.target_logprob_change, abs=1e-4)
