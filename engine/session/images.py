"""An image checked and turned into its media ids for a session, before anything in the session changes
(the session then runs the tower on it and commits it as a segment: `Session._append_image`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import InputError
from engine.model import KimiForCausalLM
from engine.tokenizer import Tokenizer
from engine.vision import ImageSource, ProcessedImage, image_prompt_ids, merged_grid, preprocess_image
from engine.vision.thumbnail import THUMBNAIL_PX


@dataclass
class PreparedImage:
    """An image checked and turned into its media ids (`ids`: pads expanded), not yet in the session."""

    processed: ProcessedImage
    label: str | None
    rows: int
    cols: int
    ids: list[int]
    pad_at: int  # index in `ids` of the first image position
    embeds: torch.Tensor | None = None  # projector outputs [rows * cols, hidden], once the tower ran


def prepare_image(model: KimiForCausalLM, tokenizer: Tokenizer | None, image: ImageSource,
                  name: str | None) -> PreparedImage:
    """Preprocess `image` into its media ids (pads expanded); changes nothing (ImageError / InputError first)."""
    vision = model.vision
    label = name or (Path(image).name if isinstance(image, (str, Path)) else None)
    if vision is None or model.vision_unavailable:
        raise InputError(f"{label or 'image'}: images are unavailable: {model.vision_unavailable}")
    if tokenizer is None:
        raise InputError("images need a tokenizer (for the media tokens around them)")
    c = vision.config
    processed: ProcessedImage = preprocess_image(image, name=label, patch=c.patch_size, merge=c.merge_kernel,
                                                 thumbnail=THUMBNAIL_PX)
    rows, cols = merged_grid(processed.grid, c.merge_kernel)
    body = image_prompt_ids(tokenizer, *processed.original_size)
    pad = model.config.media_placeholder_token_id
    if pad is None or body.count(pad) != 1:
        raise InputError(f"the tokenizer's <|media_pad|> is not the model's media_placeholder_token_id ({pad})")
    pad_at = body.index(pad)
    ids = body[:pad_at] + [pad] * (rows * cols) + body[pad_at + 1:]
    return PreparedImage(processed, label, rows, cols, ids, pad_at)
