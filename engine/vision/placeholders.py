"""Images in the token stream (spec section 8): the text around an image and placeholder expansion.

- `image_prompt_ids`: `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`
  in ids (W x H the original size, width first; "image WxH" encoded as plain text).
- `expand_media_placeholders`: a prompt holds one `<|media_pad|>` per image, in order; each one
  becomes (h/2)(w/2) positions whose embeddings the session fills with the projector's outputs.
  The layout says, per expanded position, which image it belongs to and the merged patch's
  row/col (what the trace's token table records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.errors import InputError

MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's merged tokens sit in the expanded ids: positions [start, start + rows * cols)."""

    image: int
    start: int
    rows: int
    cols: int

    @property
    def length(self) -> int:
        return self.rows * self.cols

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ExpandedIds:
    """Expanded prompt layout.

    Attributes:
        input_ids: `[T]` long; every image position holds the pad id.
        image_index: `[T]` long, the image of each position, -1 on text.
        patch_row / patch_col: `[T]` long, the merged patch's row/col on the (h/2, w/2) grid, -1 on text.
        spans: one `ImageSpan` per image, in prompt order.
    """

    input_ids: torch.Tensor
    image_index: torch.Tensor
    patch_row: torch.Tensor
    patch_col: torch.Tensor
    spans: tuple[ImageSpan, ...]

    @property
    def is_image(self) -> torch.Tensor:
        return self.image_index >= 0

    def scatter_embeddings(self, text_embeds: torch.Tensor, image_embeds: Sequence[torch.Tensor]) -> torch.Tensor:
        """`[T, D]` text embeddings with each image span replaced by its `[rows * cols, D]` projector
        output (a new tensor; `text_embeds` is left alone)."""
        if len(image_embeds) != len(self.spans):
            raise InputError(f"{len(self.spans)} images in the prompt but {len(image_embeds)} embeddings given")
        out = text_embeds.clone()
        for span, emb in zip(self.spans, image_embeds):
            if emb.shape[0] != span.length:
                raise InputError(f"image {span.image}: {emb.shape[0]} embeddings for {span.length} positions")
            out[span.start:span.stop] = emb.to(out.dtype)
        return out


def expand_media_placeholders(input_ids: Sequence[int] | torch.Tensor, merged_grids: Sequence[tuple[int, int]],
                              pad_id: int) -> ExpandedIds:
    """Expand each `pad_id` of `input_ids` into its image's merged grid (rows x cols positions).

    Args:
        input_ids: the prompt with exactly one `pad_id` per image, in order.
        merged_grids: (h / 2, w / 2) of each image, in prompt order.
        pad_id: `media_placeholder_token_id` (163605 at full size; 256 + 21 with the byte-level tokenizer).

    Raises:
        InputError: the number of pads differs from the number of images, or a grid is empty.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    pads = (ids == pad_id).nonzero().flatten().tolist()
    if len(pads) != len(merged_grids):
        raise InputError(f"the prompt holds {len(pads)} <|media_pad|> tokens (id {pad_id}) for "
                         f"{len(merged_grids)} images; it needs exactly one per image")
    pieces_ids, pieces_img, pieces_row, pieces_col, spans = [], [], [], [], []
    prev, out_pos = 0, 0
    for i, (pad, (rows, cols)) in enumerate(zip(pads, merged_grids)):
        if rows <= 0 or cols <= 0:
            raise InputError(f"image {i}: empty merged grid {rows}x{cols}")
        text = ids[prev:pad]
        n = rows * cols
        pieces_ids += [text, torch.full((n,), pad_id, dtype=torch.long)]
        none = torch.full((len(text),), -1, dtype=torch.long)
        pieces_img += [none, torch.full((n,), i, dtype=torch.long)]
        pieces_row += [none, torch.arange(rows).repeat_interleave(cols)]
        pieces_col += [none, torch.arange(cols).repeat(rows)]
        out_pos += len(text)
        spans.append(ImageSpan(image=i, start=out_pos, rows=rows, cols=cols))
        out_pos += n
        prev = pad + 1
    tail = ids[prev:]
    none = torch.full((len(tail),), -1, dtype=torch.long)
    return ExpandedIds(input_ids=torch.cat(pieces_ids + [tail]), image_index=torch.cat(pieces_img + [none]),
                       patch_row=torch.cat(pieces_row + [none]), patch_col=torch.cat(pieces_col + [none]),
                       spans=tuple(spans))


def media_token_ids(tokenizer) -> dict[str, int]:
    """The four media control ids of `tokenizer` (an `engine.tokenizer.Tokenizer`)."""
    missing = [t for t in MEDIA_TOKENS if t not in tokenizer.special]
    if missing:
        raise InputError(f"this tokenizer has no media tokens {missing}; it cannot take images")
    return {t: tokenizer.special[t] for t in MEDIA_TOKENS}


def image_prompt_ids(tokenizer, width: int, height: int) -> list[int]:
    """Ids of `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`."""
    m = media_token_ids(tokenizer)
    return ([m["<|media_begin|>"]] + tokenizer.encode(f"image {width}x{height}")
            + [m["<|media_content|>"], m["<|media_pad|>"], m["<|media_end|>"]])
