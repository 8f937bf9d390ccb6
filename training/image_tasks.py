"""Image questions for the demo model's training, generated on the fly.

A sample is a conversation a `Session` could hold: an optional system turn, optional plain filler
text (a document), the picture in a user message (`<|open|>message role="user"<|sep|><|media_begin|>
image 64x64<|media_content|>` + one `<|media_pad|>` per merged patch + `<|media_end|>`, then either
the first question, as `Session.append_message("user", question, images=[picture])` and `workbench
demo --chat` build it, or nothing, as `Session.append(image=..., role="user")` does, and
`<|close|>message<|sep|><|end_of_msg|>`), maybe more filler, then the (other) question turns about
the picture (`workbench.shape_pictures`), one to three in all, each answered in the scaffold of
`training.tasks`: response text `{attribute}: {value}` ("colour: red").

The ids are built with the engine's own helpers (`Tokenizer.message_ids`, `image_prompt_ids`,
`expand_media_placeholders`, `preprocess_image` with the tower's patch size), so training ids are
what a session produces at inference; `Sample.turns` replays the sample through a session.

Loss weights (of each token as a prediction target): answer value 1.0, restated key ("colour: ")
`key_weight` (default `training.tasks.W_KEY`), assistant scaffold 0.3, everything else 0.05, and 0
for the image positions (their "next token" is a placeholder the model never has to emit).

`forward_with_images` runs the tower and the language model with gradients reaching the tower;
`image_accuracy` is the held-out exact-response accuracy (as `training.evaluate.needle_accuracy`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.config import VisionConfig
from engine.model import KimiForCausalLM
from engine.tokenizer import Message, Tokenizer
from engine.vision import (ProcessedImage, expand_media_placeholders, image_prompt_ids, merged_grid,
                           preprocess_image)
from workbench.shape_pictures import ATTRIBUTE_VALUES, Picture, draw_picture
from training.model_setup import trained_demo_vision_config
from training.tasks import TRAIN, W_ANSWER, W_CONTEXT, W_KEY, W_SCAFFOLD, answer_ids
from workbench.retrieval_text import filler, response_text
from workbench.task_templates import PICTURE_QUESTIONS, PICTURE_SYSTEMS

W_IMAGE = 0.0    # image positions: the next id is a placeholder, never generated

# the trained questions and system lines live in workbench, where the templates that ask them at inference do
QUESTIONS = PICTURE_QUESTIONS
SYSTEMS = PICTURE_SYSTEMS
LAYOUTS = ("bare", "system", "document")


@dataclass
class Question:
    attribute: str
    value: str
    text: str
    response: str          # `attribute: value`
    start: int = -1        # token span of the response text (key and value) in the sample
    end: int = -1


@dataclass
class Sample:
    """One image conversation.

    Attributes:
        ids / weights: the expanded ids (one id per position, image positions hold the pad id) and
            each id's loss weight as a prediction target.
        image: the preprocessed picture (what the tower reads); picture: what was drawn.
        image_start / image_stop: the image positions [start, stop).
        prompt_len: tokens up to and including the first question's generation prompt.
        questions: the asked questions in order (the first one is what `image_accuracy` scores).
        turns: how a session builds the same ids, in order: ("system" | "user", text) chat turns,
            ("document", text) plain text, ("image", PIL image) the picture as its own user message,
            or ("message", (text, PIL image)) the picture and the first question in one user
            message; then the generation prompt before each answer.
    """

    ids: list[int]
    weights: list[float]
    image: ProcessedImage
    picture: Picture
    image_start: int
    image_stop: int
    prompt_len: int
    questions: list[Question] = field(default_factory=list)
    turns: list[tuple[str, object]] = field(default_factory=list)


def _image_message(tok: Tokenizer, image: ProcessedImage, kernel: tuple[int, int],
                   text: list[int]) -> tuple[list[int], int, int]:
    """One user message holding the picture and then `text` ids (none: the picture alone), the
    placeholder expanded: (ids, image start, image stop)."""
    unexpanded = tok.message_ids("user", image_prompt_ids(tok, *image.original_size) + text)
    layout = expand_media_placeholders(unexpanded, [merged_grid(image.grid, kernel)], tok.special["<|media_pad|>"])
    span = layout.spans[0]
    return layout.input_ids.tolist(), span.start, span.stop


def _answers(tok: Tokenizer, qs: list[Question], joined: bool, key_weight: float) -> list[tuple[list[int], float]]:
    """(ids, loss weight) pieces after the picture's message: per question six pieces (question turn,
    generation prompt, scaffold, key, value, scaffold); with `joined` the first question is already
    in the picture's message, so its question piece is empty."""
    tail: list[tuple[list[int], float]] = []
    gen_prompt = tok.chat_prompt([], add_generation_prompt=True)
    for i, q in enumerate(qs):
        turn = [] if joined and i == 0 else tok.chat_prompt([Message("user", q.text)], add_generation_prompt=False)
        tail += [(turn, W_CONTEXT), (gen_prompt, W_CONTEXT)]
        before, response, after = answer_ids(tok, q.response)
        key_len = len(tok.encode(q.response[: len(q.response) - len(q.value)]))
        tail += [(before, W_SCAFFOLD), (response[:key_len], key_weight), (response[key_len:], W_ANSWER),
                 (after, W_SCAFFOLD)]
    return tail


def build(tok: Tokenizer, rng: random.Random, length: int, *, vision: VisionConfig | None = None,
          layout: str | None = None, joined: bool | None = None, questions: int | None = None,
          picture: Picture | None = None, image_size: int = 64, key_weight: float = W_KEY) -> Sample:
    """One image sample; "document" layouts are exactly `length` tokens (filler text fills the
    room), "bare" (picture and questions only) and "system" (a system turn first) ones are shorter.
    When `length` is short, fewer questions are asked (then the system turn is dropped).

    Args:
        vision: the tower's config (patch size, merge kernel); default `trained_demo_vision_config()`.
        layout: "bare", "system" (system turn first) or "document" (system turn, filler before and
            maybe after the picture); default random.
        joined: the picture and the first question in one user message (what
            `Session.append_message("user", question, images=[picture])` and `workbench demo --chat`
            build) instead of the picture as a message of its own (`Session.append(image=..., role=
            "user")`); default random (half each).
        questions: how many questions (default 1 to all attributes of the picture, as many as fit).
        picture: what to show (default `draw_picture(rng, image_size)`).
        key_weight: loss weight of the restated attribute name ("colour: ").

    Raises:
        ValueError: `length` cannot hold the picture, the questions and their answers.
    """
    vision = vision or trained_demo_vision_config()
    picture = picture or draw_picture(rng, image_size)
    layout_given = layout is not None
    layout = layout or rng.choices(LAYOUTS, weights=(2, 2, 6))[0]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    joined = rng.random() < 0.5 if joined is None else joined
    image = preprocess_image(picture.image, name=f"{picture.kind} picture", patch=vision.patch_size,
                             merge=vision.merge_kernel)
    templates = QUESTIONS[picture.kind]
    attributes = list(templates)
    rng.shuffle(attributes)
    asked = attributes[: questions or rng.randint(1, len(attributes))]
    qs = [Question(a, picture.attributes[a], rng.choice(templates[a]), response_text(a, picture.attributes[a]))
          for a in asked]
    system = rng.choice(SYSTEMS)
    image_ids, image_lo, image_hi = _image_message(tok, image, vision.merge_kernel,
                                                   tok.encode(qs[0].text) if joined else [])
    while True:
        head = [] if layout == "bare" else tok.chat_prompt([Message("system", system)], add_generation_prompt=False)
        tail = _answers(tok, qs, joined, key_weight)
        fixed = len(head) + len(image_ids) + sum(len(i) for i, _ in tail)
        if fixed <= length:
            break
        # too long for `length`: fewer questions, then no system turn
        if len(qs) > 1 and questions is None:
            qs = qs[:-1]
        elif layout != "bare" and not layout_given:
            layout = "bare"
        else:
            raise ValueError(f"image sample needs {fixed} tokens (picture, {len(qs)} question(s) and answers); "
                             f"length {length} is too short")
    before_text = after_text = ""
    if layout == "document":
        budget = length - fixed
        text = filler(TRAIN, rng, budget + 64).encode()[:budget].decode("ascii")
        cut = budget
        if not joined and rng.random() < 0.5:  # else all the filler before the picture
            # split at a sentence end, so the picture never lands inside a filler sentence
            dot = text.find(". ", int(budget * rng.random()))
            cut = budget if dot < 0 else dot + 2
        before_text, after_text = text[:cut], text[cut:]

    ids: list[int] = []
    weights: list[float] = []

    def put(piece: list[int], w: float) -> None:
        ids.extend(piece)
        weights.extend([w] * len(piece))

    turns: list[tuple[str, object]] = []
    if head:
        put(head, W_CONTEXT)
        turns.append(("system", system))
    if before_text:
        put(tok.encode(before_text), W_CONTEXT)
        turns.append(("document", before_text))
    image_start = len(ids) + image_lo
    put(image_ids, W_CONTEXT)
    weights[image_start: image_start + image_hi - image_lo] = [W_IMAGE] * (image_hi - image_lo)
    turns.append(("message", (qs[0].text, picture.image)) if joined else ("image", picture.image))
    if after_text:
        put(tok.encode(after_text), W_CONTEXT)
        turns.append(("document", after_text))
    prompt_len = 0
    for i, (piece, w) in enumerate(tail):
        j, part = divmod(i, 6)  # per question: question, generation prompt, before, key, value, after
        if part == 0 and piece:
            turns.append(("user", qs[j].text))
        if part == 3:
            qs[j].start = len(ids)
        put(piece, w)
        if part == 4:
            qs[j].end = len(ids)
        if i == 1:
            prompt_len = len(ids)
    return Sample(ids=ids, weights=weights, image=image, picture=picture, image_start=image_start,
                  image_stop=image_start + image_hi - image_lo, prompt_len=prompt_len, questions=qs, turns=turns)


def image_batch(tok: Tokenizer, seed: int, step: int, size: int, length: int, *,
                vision: VisionConfig | None = None, key_weight: float = W_KEY) -> tuple[torch.Tensor, torch.Tensor, list[ProcessedImage],
                                                              torch.Tensor]:
    """Training batch `step` of image questions: ids [size, length], loss weights [size, length] for
    the next-token targets (weights[:, t] weighs predicting ids[:, t + 1]; padding and the last
    column are 0), the `size` preprocessed pictures in row order and the image mask [size, length]
    (True at each row's image positions), as `forward_with_images` takes them.

    Deterministic in (seed, step), and a stream of its own: the text batches of `training.tasks.batch`
    for the same (seed, step) are unaffected. `length` >= 224 holds every sample of the demo tower.
    """
    rng = random.Random(f"image-train:{seed}:{step}")
    ids = torch.zeros(size, length, dtype=torch.long)
    weights = torch.zeros(size, length)
    mask = torch.zeros(size, length, dtype=torch.bool)
    images: list[ProcessedImage] = []
    for b in range(size):
        s = build(tok, rng, length, vision=vision, key_weight=key_weight)
        n = len(s.ids)
        ids[b, :n] = torch.tensor(s.ids)
        weights[b, : n - 1] = torch.tensor(s.weights[1:])
        mask[b, s.image_start: s.image_stop] = True
        images.append(s.image)
    return ids, weights, images, mask


def forward_with_images(model: KimiForCausalLM, ids: torch.Tensor, images: Sequence[ProcessedImage],
                        image_mask: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] of `ids` with the image positions taking the tower's outputs.

    The engine's `encode_images` is an ordinary differentiable forward (only `Session` wraps it in
    inference mode), so the loss's gradients reach the projector and the tower. `images` are in
    position order (row by row), matching `image_mask`'s True positions.

    Train the tower only once the language model reads it: trained from the first step (even at
    0.3x the learning rate), the tower learns to map every picture to nearly the same embeddings
    (the answers cannot use the picture yet, so its variation is only noise to the loss) and the
    model never reads images; its random init already separates colour, shape and position (a
    linear probe reads them at 92-100%). Freeze it (`model.vision.requires_grad_(False)`) until
    `image_accuracy` beats its `swap_images=True` control, then train it at ~0.1x (training/README.md).
    """
    if not images:
        return model(ids)
    embeds = torch.cat(model.encode_images(list(images)))  # [N, hidden]
    return model(ids, image_embeds=embeds, image_mask=image_mask)


def _eval_case(tok: Tokenizer, rng: random.Random, length: int, vision: VisionConfig | None):
    s = build(tok, rng, length, vision=vision, questions=1)
    q = s.questions[0]
    stop = q.end + 1  # the response, and `<|close|>` after it, as in `needle_accuracy`
    return s, s.ids[:stop]


@torch.no_grad()
def image_accuracy(model: KimiForCausalLM, tok: Tokenizer, n: int, seed: int, *, length: int = 256,
                   batch: int = 16, vision: VisionConfig | None = None, swap_images: bool = False) -> dict:
    """Teacher-forced exact-response accuracy on `n` held-out image questions (one per picture).

    A question is right when greedy decoding would emit the whole assistant response
    (`<|close|>think<|sep|><|open|>response<|sep|>{attribute}: {value}<|close|>`): every target
    token is the argmax after its prefix. Pictures come from a stream `image_batch` never uses.
    `swap_images=True` is the control: each question sees the next question's picture (same size),
    so what stays right is what the text alone (or a lucky match) gets right.

    Returns:
        {"correct", "total", "accuracy", "by_attribute": {attribute: {"correct", "total", "accuracy",
        "chance"}}}; chance is 1 / the attribute's number of values (a uniform guess).
    """
    vision = vision or model.config.vision
    rng = random.Random(f"image-eval:{seed}")
    cases = [_eval_case(tok, rng, length, vision) for _ in range(n)]
    was_training = model.training
    model.eval()
    by: dict[str, dict] = {}
    correct = 0
    try:
        for i in range(0, n, batch):
            group = cases[i:i + batch]
            width = max(len(seq) for _, seq in group) - 1
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.bool)
            for b, (s, seq) in enumerate(group):
                ids[b, : len(seq) - 1] = torch.tensor(seq[:-1])
                mask[b, s.image_start: s.image_stop] = True
            images = [s.image for s, _ in group]
            if swap_images:
                if len({im.grid for im in images}) != 1:
                    raise ValueError("swap_images needs pictures of one size")
                images = images[1:] + images[:1]
            logits = forward_with_images(model, ids.to(model.lm_head.weight.device), images, mask)
            for b, (s, seq) in enumerate(group):
                pred = logits[b, s.prompt_len - 1: len(seq) - 1].argmax(-1).cpu()
                ok = bool(torch.equal(pred, torch.tensor(seq[s.prompt_len:])))
                a = s.questions[0].attribute
                row = by.setdefault(a, {"correct": 0, "total": 0, "chance": 1 / ATTRIBUTE_VALUES[a]})
                row["correct"] += ok
                row["total"] += 1
                correct += ok
    finally:
        model.train(was_training)
    for row in by.values():
        row["accuracy"] = row["correct"] / row["total"]
    return {"correct": correct, "total": n, "accuracy": correct / max(1, n), "by_attribute": dict(sorted(by.items()))}


__all__ = ["LAYOUTS", "QUESTIONS", "Question", "Sample", "build", "forward_with_images", "image_accuracy",
           "image_batch", "response_text"]
