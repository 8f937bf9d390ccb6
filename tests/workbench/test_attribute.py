"""workbench.attribute: masks inside the model, the surrogate, the needle found on builtin:demo, bad input.

Small contexts (builtin:demo at ~2K tokens, one CPU thread); the 32K / 128K figures are
benchmarks/bench_attribution.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import workbench
from engine.errors import InputError
from engine.interventions import InterventionPlan
from engine.interventions.plan import in_any_range, in_ranges
from engine.session import Session
from workbench.causal_effects import target_logprobs
from workbench.span_attribution import automatic_spans, given_spans
from workbench.span_attribution.reads import score_with_reads
from workbench.span_attribution.surrogate import fit, lasso, random_masks, spearman
from workbench.task_templates import append_task, fact_task
from workbench.text import haystack


def _fact_session(demo, tokens: int = 1800, depth: float = 0.4):
    model, tokenizer = demo
    text = haystack(tokens, tokenizer, seed=3)
    task = fact_task([("notes.txt", text)], "garage door", "7142", depth=depth, restate=False)
    session = Session(model, tokenizer, progress=False)
    spans = append_task(session, task, question=False)
    return session, task, spans["the fact"]


def test_in_any_range_equals_the_range_table():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, r = int(rng.integers(1, 400)), int(rng.integers(1, 40))
        positions = torch.from_numpy(np.sort(rng.choice(1000, size=n, replace=False))).long()
        starts = torch.from_numpy(rng.integers(0, 1000, size=r)).long()
        ranges = torch.stack([starts, starts + torch.from_numpy(rng.integers(0, 60, size=r)).long()], 1)
        ranges = torch.cat([ranges, torch.zeros(3, 2, dtype=torch.long)])  # padding rows
        assert torch.equal(in_any_range(positions, ranges), in_ranges(positions, ranges).any(-1))


def test_unreached_plan_is_not_handed_to_the_layers(demo):
    model, _ = demo
    plan = InterventionPlan([{"op": "kda.suppress_writes", "positions": [500, 501], "layers": "all"},
                             {"op": "dsa.hide", "positions": [300, 310], "layers": "all"}], model.config)
    assert plan.reach == (300, model.config.max_position_embeddings)
    assert not plan.acts_on(0, 300) and plan.acts_on(300, 301) and plan.acts_on(5000, 5001)
    only_kda = InterventionPlan([{"op": "kda.suppress_writes", "positions": [500, 501], "layers": "all"}], model.config)
    assert not only_kda.acts_on(501, 502) and only_kda.acts_on(0, 501)


def test_surrogate_recovers_a_planted_sparse_effect():
    rng = np.random.default_rng(1)
    X = random_masks(64, 40, rng)
    truth = np.zeros(40)
    truth[[3, 17, 29]] = [6.0, 2.5, -1.5]
    y = X @ truth - 4.0 + rng.normal(0, 0.05, 64)
    model = fit(X, y)
    assert set(np.flatnonzero(np.abs(model.weights) > 0.5)) == {3, 17, 29}
    assert np.allclose(model.weights[[3, 17, 29]], truth[[3, 17, 29]], atol=0.3)
    held = random_masks(32, 40, rng)
    assert spearman(model.predict(held), held @ truth) > 0.95
    w, _ = lasso(X, y, alpha=1e3)  # a penalty past every correlation zeroes every weight
    assert not w.any()
    assert spearman(np.ones(5), np.arange(5)) is None


def test_spans_cover_the_context_within_segments(demo):
    session, _, fact = _fact_session(demo)
    for mode in ("sentences", "paragraphs", "segments"):
        spans = automatic_spans(session, mode)
        assert spans[0].start == 0 and spans[-1].end == len(session.tokens)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))  # no gap, no overlap
        for seg in session.segments:
            assert not any(s.start < seg.start < s.end for s in spans)  # never across a segment boundary
    sentences = automatic_spans(session, "sentences")
    assert len(sentences) > 20
    assert any(s.start <= fact[0] and fact[1] <= s.end + 1 and s.end - s.start < 80 for s in sentences)


def test_masks_inside_the_model_equal_hiding_the_same_ranges(demo):
    """One mask = one spec of many dsa.hide ranges at the end of the context; the same ranges hidden as
    entries in another order (the same computation: the plan merges them) give the same bits, and a mask
    hiding only spans no DSA layer read scores exactly what the plain run does."""
    session, task, fact = _fact_session(demo, tokens=1200)
    session.prefill()
    end = len(session.tokens)
    plain, counts = score_with_reads(session, task, [session.tokenizer.encode("7142")][0], "user", end)
    target = session.tokenizer.encode("7142")
    ranges = [(fact[0], fact[1]), (40, 90), (300, 333), (90, 120)]
    spec = [{"op": "dsa.hide", "positions": list(r), "layers": "all"} for r in ranges]
    merged = [{"op": "dsa.hide", "positions": [40, 120], "layers": "all"}] + [
        {"op": "dsa.hide", "positions": list(r), "layers": "all"} for r in ranges[2::-2]]
    a = target_logprobs(session, spec, task, target)
    b = target_logprobs(session, merged, task, target)
    assert np.array_equal(a, b)
    assert a.sum() < plain.sum() - 1.0  # the fact is among them
    unread = [i for i in range(end) if counts[i] == 0]
    assert unread, "some key is never read at 1.2K tokens (top-k 64)"
    runs = [(s, e + 1) for s, e in _runs(unread)][:40]
    hidden = target_logprobs(session, [{"op": "dsa.hide", "positions": list(r), "layers": "all"} for r in runs],
                             task, target)
    np.testing.assert_allclose(hidden, plain, atol=1e-5)  # fp32 logits: the same keys are read


def _runs(positions):
    out = []
    for p in positions:
        if out and out[-1][1] == p - 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return out


def test_the_needle_ranks_first_on_builtin_demo(demo):
    session, task, fact = _fact_session(demo)
    result = workbench.attribute(session, continuation=task, masks=32, holdout=8, top=3, seed=0)
    first = result.spans[0]
    assert first.start <= fact[0] < first.end or first.start < fact[1] <= first.end
    assert first.source == "checked" and first.controls == 8
    assert first.effect < first.control_min - 1.0 and "depends on" in first.verdict
    assert result.right is True and result.answer.endswith("7142")
    assert result.lds is not None and result.lds > 0.3
    assert result.runs < 40 + 1 + 3 * 9 + 1
    checked = result.checked()
    assert [s.effect for s in checked] == sorted(s.effect for s in checked)
    doc = result.to_json()
    assert doc["spans"][0]["start"] == first.start and isinstance(doc["attribution_s"], float)


def test_bad_input_is_a_clear_error(demo):
    model, tokenizer = demo
    empty = Session(model, tokenizer, progress=False)
    with pytest.raises(InputError, match="context is empty"):
        workbench.attribute(empty, continuation="What?", target="x")
    session, task, _ = _fact_session(demo, tokens=300)
    end = len(session.tokens)
    with pytest.raises(InputError, match="needs a target"):
        workbench.attribute(session, continuation="What is the code?")
    with pytest.raises(InputError, match=r"not inside the context's"):
        workbench.attribute(session, continuation=task, spans=[(10, end + 5)])
    with pytest.raises(InputError, match="spans must be one of"):
        workbench.attribute(session, continuation=task, spans="words")
    with pytest.raises(InputError, match="empty"):
        given_spans([], end)
    with pytest.raises(InputError, match="masks must be"):
        workbench.attribute(session, continuation=task, masks=0)
    session.prefill()
    with pytest.raises(InputError, match="kda: the session has consumed"):
        workbench.attribute(session, continuation=task, kda=True)


def test_an_image_is_cut_into_bands_of_patch_rows():
    import random

    from workbench.sessions import load_with_tokenizer

    model, tokenizer = load_with_tokenizer("preset:tiny")
    session = Session(model, tokenizer, progress=False)
    session.append("A picture follows. Look at it.", name="doc")
    picture = workbench.draw_shape(random.Random(7), 64, shape="circle", colour="red", position="left")
    session.append(image=picture.image, name="picture.png", role="user")
    image = next(s for s in session.segments if s.kind == "image")
    spans = [s for s in automatic_spans(session, "sentences") if s.label == "picture.png"]
    patches = [s for s in spans if s.kind == "image patches"]
    rows, cols, first = image.image["grid_rows"], image.image["grid_cols"], image.image["token_start"]
    assert 1 <= len(patches) <= 8 and patches[0].start == first and patches[-1].end == first + rows * cols
    assert all((s.start - first) % cols == 0 and (s.end - s.start) % cols == 0 for s in patches)  # whole rows
    assert spans[0].start == image.start and spans[-1].end == image.end


def test_bad_evidence_names_itself(demo):
    session, task, _ = _fact_session(demo, tokens=300)
    with pytest.raises(InputError, match="evidence"):
        workbench.attribute(session, continuation=task, evidence=[(5, 10**9)])


def test_kda_masks_rerun_from_kept_states_as_from_the_start(demo):
    """With kda=True a mask re-runs the context from the latest state kept before its first hidden span: the
    same log-probability as suppressing those writes from an unprefilled session (float rounding only: the
    context is prefilled in other pieces)."""
    from workbench.span_attribution.core import _spec

    session, task, fact = _fact_session(demo, tokens=500)
    fresh = session.fork()
    result = workbench.attribute(session, continuation=task, kda=True, masks=8, holdout=2, top=1, controls=1,
                                 spans="paragraphs")
    assert result.kda and result.candidates == len(result.spans)
    target = session.tokenizer.encode("7142")
    for row, measured in list(zip(result.mask_matrix, result.mask_logprobs))[:3]:
        hidden = [span for span, kept in zip(result.candidate_spans, row) if not kept]
        direct = target_logprobs(fresh, _spec(hidden, kda=True), task, target).sum() if hidden else None
        if direct is not None:
            assert measured == pytest.approx(float(direct), abs=2e-3)
