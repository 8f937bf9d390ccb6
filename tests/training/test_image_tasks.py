"""Image questions for the demo model's training: deterministic batches, ids equal to what a
`Session` builds for the same picture, answer spans and weights, gradients into the tower, and the
export of a model with its tower (loads with `engine.load_model`, encodes the same embeddings)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from engine import load_model
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.shape_pictures import ATTRIBUTE_VALUES, COLOURS, DIGITS, POSITIONS, SHAPES, draw_digit, draw_shape
from training.image_tasks import W_IMAGE, build, forward_with_images, image_accuracy, image_batch, response_text
from training.model_setup import (export, trainable_model, trained_demo_config, trained_demo_vision_config)
from training.tasks import W_ANSWER, W_CONTEXT, W_KEY, W_SCAFFOLD


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.byte_level()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return trainable_model(trained_demo_config(vision=True), seed=0)


def test_vision_option_is_off_by_default() -> None:
    assert trained_demo_config().vision is None
    assert trained_demo_config(vision=True).vision == trained_demo_vision_config()


def test_pictures_are_seeded_and_cover_every_value() -> None:
    a, b = draw_shape(random.Random(4)), draw_shape(random.Random(4))
    assert a.attributes == b.attributes and a.image.tobytes() == b.image.tobytes()
    rng = random.Random(0)
    seen = {"colour": set(), "shape": set(), "position": set(), "digit": set()}
    for _ in range(200):
        for p in (draw_shape(rng), draw_digit(rng)):
            for k, v in p.attributes.items():
                seen[k].add(v)
    assert seen == {"colour": set(COLOURS), "shape": set(SHAPES), "position": set(POSITIONS), "digit": set(DIGITS)}
    # different digits draw different pictures (seven segments, not all the same strokes)
    pics = {draw_digit(random.Random(1), digit=d).image.tobytes() for d in DIGITS}
    assert len(pics) == 10


def test_image_batches_are_deterministic(tok) -> None:
    a = image_batch(tok, 3, 7, 4, 256)
    b = image_batch(tok, 3, 7, 4, 256)
    c = image_batch(tok, 3, 8, 4, 256)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[3], b[3])
    assert all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(a[2], b[2]))
    assert not torch.equal(a[0], c[0])
    ids, weights, images, mask = a
    pad = tok.special["<|media_pad|>"]
    assert torch.equal(mask, ids == pad)  # byte-level text never holds the pad id
    assert mask.sum(1).tolist() == [16] * 4  # a 64 x 64 picture: 8 x 8 patches, 4 x 4 merged tokens
    assert len(images) == 4 and all(im.grid == (8, 8) for im in images)
    assert (weights[:, -1] == 0).all()
    # a row's weight at t weighs predicting ids[t + 1]: never an image position
    assert (weights[:, :-1][mask[:, 1:]] == W_IMAGE).all()


def test_answer_spans_and_weights(tok) -> None:
    rng = random.Random(11)
    for layout, joined in itertools.product(("bare", "system", "document"), (False, True)):
        for _ in range(3):
            s = build(tok, rng, 640, layout=layout, joined=joined)
            assert layout != "document" or len(s.ids) == 640
            assert s.ids[s.image_start: s.image_stop] == [tok.special["<|media_pad|>"]] * 16
            assert set(s.weights[s.image_start: s.image_stop]) == {W_IMAGE}
            for q in s.questions:
                assert q.response == response_text(q.attribute, q.value) == f"{q.attribute}: {q.value}"
                assert q.value == s.picture.attributes[q.attribute]
                assert tok.decode(s.ids[q.start: q.end]) == q.response
                key = len(q.attribute) + 2
                assert s.weights[q.start: q.start + key] == [W_KEY] * key
                assert s.weights[q.start + key: q.end] == [W_ANSWER] * len(q.value)
                assert s.weights[q.end] == W_SCAFFOLD  # <|close|>response
                assert s.weights[q.start - 1] == W_SCAFFOLD  # <|sep|> after <|open|>response
            first = s.questions[0]
            gen = tok.chat_prompt([], add_generation_prompt=True)
            assert s.ids[s.prompt_len - len(gen): s.prompt_len] == gen and s.prompt_len < first.start
            assert s.weights[s.prompt_len - 1] == W_CONTEXT
    late = build(tok, random.Random(2), 640, key_weight=0.95)  # the lead's later key weight
    q = late.questions[0]
    assert late.weights[q.start: q.start + len(q.attribute) + 2] == [0.95] * (len(q.attribute) + 2)
    with pytest.raises(ValueError, match="too short"):
        build(tok, random.Random(0), 120)


def _replay(model, tok, s) -> Session:
    """The sample's conversation up to its first generation prompt, appended to a Session."""
    session = Session(model, tok)
    for kind, x in s.turns:
        if kind == "image":
            session.append(image=x, role="user")
        elif kind == "message":
            session.append_message("user", x[0], images=[x[1]])
        elif kind == "document":
            session.append(x)
        else:
            session.append(x, role=kind)
        if kind == "message" or (kind == "user" and x == s.questions[0].text):
            break
    session.append(ids=tok.chat_prompt([], add_generation_prompt=True))
    return session


@pytest.mark.parametrize("joined", [False, True])
def test_sample_ids_and_logits_equal_a_sessions(model, tok, joined) -> None:
    """The same conversation appended to a Session (the picture through `append(image=...,
    role="user")`, or with the first question through `append_message`) holds exactly the
    sample's ids, and its prefill logits equal `forward_with_images`'s."""
    s = build(tok, random.Random(5), 600, layout="document", questions=2, joined=joined)
    kinds = [k for k, _ in s.turns]
    assert kinds[:3] == ["system", "document", "message" if joined else "image"]
    session = _replay(model, tok, s)
    assert session.tokens == s.ids[: s.prompt_len]
    seg = next(g for g in session.segments if g.kind == "image")
    assert (seg.image["token_start"], seg.image["token_end"]) == (s.image_start, s.image_stop)
    model.eval()
    try:
        with torch.no_grad():
            want = session.prefill(return_logits=True)
            mask = torch.zeros(1, s.prompt_len, dtype=torch.bool)
            mask[0, s.image_start: s.image_stop] = True
            got = forward_with_images(model, torch.tensor([s.ids[: s.prompt_len]]), [s.image], mask)[0]
    finally:
        model.train()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_tower(model, tok) -> None:
    ids, weights, images, mask = image_batch(tok, 0, 0, 2, 224)
    logits = forward_with_images(model, ids, images, mask)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, :-1].flatten()
    ((ce * w).sum() / w.sum()).backward()
    grads = {n: p.grad for n, p in model.vision.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None or float(g.abs().sum()) == 0]


def test_image_accuracy_reports_chance(model, tok) -> None:
    out = image_accuracy(model, tok, 4, seed=0, length=224)
    assert out["total"] == 4 and 0 <= out["correct"] <= 4
    assert sum(r["total"] for r in out["by_attribute"].values()) == 4
    for a, r in out["by_attribute"].items():
        assert r["chance"] == 1 / ATTRIBUTE_VALUES[a]
    assert model.training  # left as it was


def test_export_with_vision_loads_and_encodes(tmp_path, tok) -> None:
    config = trained_demo_config(vision=True)
    trained = trainable_model(config, seed=2)
    with torch.no_grad():  # what the checkpoint stores: bf16 floats
        for p in trained.vision.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    out = export(trained, config, tmp_path / "ckpt")
    loaded = load_model(out)
    assert loaded.vision is not None and loaded.config.vision == trained_demo_vision_config()
    s = build(tok, random.Random(3), 256)
    trained.eval()
    with torch.no_grad():
        want = trained.encode_images([s.image])[0]
        got = loaded.encode_images([s.image])[0]
    assert got.shape == (16, 128)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)
    # and a session on the loaded model takes the picture
    session = Session(loaded, Tokenizer.for_model(out, loaded.config.vocab_size) or tok)
    seg = session.append(image=s.picture.image, role="user")
    assert seg.image["grid_rows"] * seg.image["grid_cols"] == 16
