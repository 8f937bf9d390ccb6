"""An image checked and turned into its media ids for a session, before anything in the session changes
(the session then runs the tower on it and commits it as a segment: `Session._append_image`).

Images (spec section 8): `append(image=...)` preprocesses the picture (a bad one raises ImageError
before anything changes), runs the vision tower once, and appends
`<|media_begin|>image WxH<|media_content|>` + one `<|media_pad|>` per merged patch + `<|media_end|>`;
prefill feeds the projector's outputs at those positions, whatever chunks split them. The segment's
`image` dict records the picture (size, grids, token range, pixel hash); snapshots keep it and the
thumbnail (a small PNG, for viewers), and need no pixels to resume (the image positions are in the
state once consumed). `append_message(role, text, images=[...])` puts images and text in ONE chat
message (images first, then the text), the section-9 format a chat with pictures uses.
"""

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


def image_record(prepared: PreparedImage, first: int) -> dict:
    """What a segment records of its picture (sizes, grids, token range from `first`, pixel hash)."""
    processed, rows, cols = prepared.processed, prepared.rows, prepared.cols
    return {"width": processed.original_size[0], "height": processed.original_size[1],
            "resized_width": processed.resized_size[0], "resized_height": processed.resized_size[1],
            "patch_rows": processed.grid[0], "patch_cols": processed.grid[1], "grid_rows": rows,
            "grid_cols": cols, "token_start": first, "token_end": first + rows * cols,
            "sha256": processed.sha256, "frames": processed.frames}


def pending_image_inputs(pending: list[tuple[int, torch.Tensor]], start: int, n: int,
                         device: torch.device | str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(projector rows, [1, n] mask) of the pending images (first position, rows) inside [start, start + n)."""
    rows, mask = [], None
    for first, embeds in pending:
        lo, hi = max(first, start), min(first + len(embeds), start + n)
        if lo >= hi:
            continue
        if mask is None:
            mask = torch.zeros(1, n, dtype=torch.bool, device=device)
        mask[0, lo - start: hi - start] = True
        rows.append(embeds[lo - first: hi - first])
    return (torch.cat(rows) if rows else None), mask
