"""The researcher's toolkit (issue 40 sections 2-4): run_with_cache, the AttnRes logit lens and patching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import workbench
from engine.errors import InputError
from engine.hooks import hooks
from engine.session import Session
from tests.helpers import random_ids
from workbench.analysis.causal import DEPENDS
from workbench.toolkit import Spilled, logit_lens, patch, run_with_cache, target_rank
from workbench.toolkit.prompts import fact_prompts


def session_of(model, n: int = 300, seed: int = 0, chunk: int = 64) -> Session:
    s = Session(model, prefill_chunk=chunk)
    s.append(ids=random_ids(n, seed))
    return s


def test_the_position_filter_keeps_exactly_the_rows_asked(demo):
    model, _ = demo
    every = run_with_cache(session_of(model), ["hook_resid_post", "dsa.hook_selection"], layers=[1, 2])
    asked = [3, 64, 200, 299]
    some = run_with_cache(session_of(model), ["hook_resid_post", "dsa.hook_selection"], asked, layers=[1, 2])
    assert sorted(some) == ["blocks.1.hook_resid_post", "blocks.2.dsa.hook_selection", "blocks.2.hook_resid_post"]
    for name, rows in some.items():
        assert some.positions[name].tolist() == asked
        assert every.positions[name].tolist() == list(range(300))
        assert torch.equal(rows, every[name][:, asked])  # the same forward, the rows picked in the hook


def test_a_kda_state_is_cached_after_each_position_asked(demo):
    model, _ = demo
    s = session_of(model)
    cache = run_with_cache(s, "blocks.0.kda.hook_state", positions=[99, 299])
    assert cache["blocks.0.kda.hook_state"].shape[0] == 2
    torch.testing.assert_close(cache["blocks.0.kda.hook_state"][1], s.state.layers[0].recurrent, rtol=1e-5, atol=1e-5)
    # without positions only the last state is kept (not one per prefill chunk: 5 here)
    last = run_with_cache(session_of(model), "blocks.0.kda.hook_state")
    assert last.positions["blocks.0.kda.hook_state"].tolist() == [299]
    # positions already run are refused, not silently left out
    half = session_of(model)
    half.prefill(until=100)
    with pytest.raises(InputError, match="before the pending tokens"):
        run_with_cache(half, "blocks.0.kda.hook_state", positions=[50, 200])


def test_past_the_byte_limit_points_spill_to_safetensors_and_read_back_the_same(demo, tmp_path):
    model, _ = demo
    held = run_with_cache(session_of(model), "hook_resid_post", positions=range(0, 300, 3))
    spilled = run_with_cache(session_of(model), "hook_resid_post", positions=range(0, 300, 3), max_bytes=20_000,
                             spill_dir=tmp_path)
    assert spilled.spilled()  # 6 points x 100 rows x 128 x 4 bytes do not fit in 20 KB
    for name in spilled.spilled():
        value = spilled[name]
        assert isinstance(value, Spilled) and list(value.directory.glob("part-*.safetensors"))
        assert torch.equal(value.load(), held[name])
        assert spilled.positions[name].tolist() == list(range(0, 300, 3))


def test_with_nothing_pending_the_session_is_replayed_and_left_as_it_was(demo):
    model, _ = demo
    s = session_of(model)
    s.prefill()
    before = (s.length, s.last_logits.clone())
    cache = run_with_cache(s, "hook_resid_post", positions=[10], layers=[0])
    assert cache.positions["blocks.0.hook_resid_post"].tolist() == [10]
    assert s.length == before[0] and torch.equal(s.last_logits, before[1])


@pytest.mark.parametrize("kwargs, message", [
    ({"names": ["hook_nonsense"]}, "no hook point named 'hook_nonsense'"),
    ({"names": "hook_resid_post", "layers": [99]}, "layers= holds 99"),
    ({"names": "hook_resid_post", "positions": [300]}, "positions= holds 300"),
    ({"names": "hook_resid_post", "positions": []}, "positions= is empty"),
    ({"names": "hook_resid_post", "positions": [1.5]}, "integer positions"),
    ({"names": "hook_resid_post", "max_bytes": -1}, "max_bytes="),
])
def test_bad_requests_are_one_line(demo, kwargs, message):
    model, _ = demo
    with pytest.raises(InputError, match=message) as err:
        run_with_cache(session_of(model, 300), **kwargs)
    assert "\n" not in str(err.value)


def test_the_lens_at_the_last_layer_is_the_models_own_next_token_distribution(demo):
    model, _ = demo
    s = session_of(model, 200)
    lens = workbench.logit_lens(s, positions=[50, 199])
    assert lens.shape == (model.config.num_hidden_layers, 2, model.config.vocab_size)
    # the very arithmetic of the forward, on rows instead of a chunk (another matmul shape): fp32 rounding only
    torch.testing.assert_close(lens[-1, -1], torch.log_softmax(s.last_logits.float(), -1), rtol=0, atol=1e-4)
    torch.testing.assert_close(lens.exp().sum(-1), torch.ones(lens.shape[:2]), rtol=0, atol=1e-4)
    # the naive lens (final norm and head on the last layer's prefix sum, no output mix) is another distribution
    prefix = run_with_cache(session_of(model, 200), "blocks.5.hook_resid_post", positions=[199])
    with torch.inference_mode():
        naive = torch.log_softmax(model.lm_head(model.model.norm(prefix["blocks.5.hook_resid_post"]))[0, -1], -1)
    assert (naive - lens[-1, -1]).abs().max() > 0.1
    rank, prob = target_rank(lens, int(lens[-1, -1].argmax()))
    assert rank[-1, -1] == 0 and rank.shape == (model.config.num_hidden_layers, 2)
    assert abs(float(prob[-1, -1]) - float(lens[-1, -1].max().exp())) < 1e-6


def test_patching_the_demo_needle_forks_from_the_shared_prefix_and_finds_the_layer_that_carries_it(demo):
    model, tok = demo
    clean, corrupted, answer = fact_prompts(model, tok, 500)
    first = next(i for i, (a, b) in enumerate(zip(clean, corrupted)) if a != b)
    embedded: list[int] = []

    def count(module, args, out):
        embedded.extend(range(int(module.start), int(module.start) + out.shape[1]))

    with hooks(model, [("hook_embed", count)]):
        report = patch(Session(model, tok), clean, corrupted, answer, kinds=("resid", "kda"), layers=[0, 4],
                       controls=8)
    # the part before the first difference ran once; every branch continued from a fork
    assert report.forked_at == first
    assert sum(p < first for p in embedded) == first
    assert report.clean - report.corrupted > 5  # the demo reads the needle: the corrupted value loses the answer
    layers, cols, grid = report.grid("resid")
    assert layers == [0, 4] and len(cols) == 2
    needle = [c for c in report.cells if c.kind == "resid" and c.layer == 4 and c.where == cols[0]][0]
    assert needle.fraction > 0.5 and needle.label == DEPENDS, needle.sentence
    assert len(needle.controls) == 8 and max(needle.controls) < 0.1  # same-size spans elsewhere restore nothing
    heads = report.grid("kda")[2]
    assert heads.shape == (2, 2) and np.isfinite(heads).all()
    assert report.groups and "random head set of the same size" in report.groups[0].sentence  # 1 pair left of 4 heads


def test_patch_refuses_prompts_it_cannot_compare(demo):
    model, tok = demo
    s = Session(model, tok)
    with pytest.raises(InputError, match="the same length"):
        patch(s, [1, 2, 3], [1, 2], [5])
    with pytest.raises(InputError, match="the same: nothing to restore"):
        patch(s, [1, 2, 3], [1, 2, 3], [5])
    with pytest.raises(InputError, match="kinds= holds"):
        patch(s, [1, 2, 3], [1, 9, 3], [5], kinds=("everything",))
    with pytest.raises(InputError, match="layers= must be layer numbers"):
        patch(s, [1, 2, 3], [1, 9, 3], [5], layers=[99])
    with pytest.raises(InputError, match="state_position=0 must lie in"):
        patch(s, [1, 2, 3], [1, 9, 3], [5], state_position=0)


def test_a_state_restored_at_the_prompts_last_position_scores_from_the_forks_own_logits(demo):
    model, tok = demo
    clean = tok.encode("The code is 3-8-2-5. The code is")
    corrupted = tok.encode("The code is 7-1-4-6. The code is")
    report = patch(Session(model, tok), clean, corrupted, tok.encode(" 3"), kinds=("kda",), layers=[0],
                   state_position=len(clean) - 1, controls=0, group=0)
    assert len(report.cells) == 2 and all(np.isfinite(c.gain) for c in report.cells)
