"""Arguments of the session's public API, checked before anything changes: a wrong type, an over-long
segment name or ids that are not integer token ids are the engine's own one-line InputError, never a
TypeError or a silently converted id from deep inside."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from engine.errors import InputError
from engine.session.segments import MAX_SEGMENT_NAME


def check_types(**values: tuple[Any, type]) -> None:
    """InputError naming the first argument that is neither None nor of its type (a public API
    answers a wrong type with the engine's own error, not a TypeError from deep inside)."""
    for name, (value, kind) in values.items():
        if value is not None and not isinstance(value, kind):
            raise InputError(f"{name}= must be a {kind.__name__}, got {type(value).__name__}")


def check_names(*names: str | None) -> None:
    """InputError for a segment name longer than MAX_SEGMENT_NAME (before anything changes)."""
    for name in names:
        if name is not None and len(name) > MAX_SEGMENT_NAME:
            raise InputError(f"a segment name of {len(name):,} characters; at most {MAX_SEGMENT_NAME:,} are kept")


def token_ids(ids: Any) -> list[int]:
    """`ids` as a list of ints: a sequence or 1-D tensor of integers (never floats, bools or text,
    which `int()` would silently turn into other ids)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputError(f"ids= must be a 1-D tensor of integer token ids, got {ids.dtype} {list(ids.shape)}")
        return ids.tolist()
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InputError(f"ids= must be a 1-D array of integer token ids, got {ids.dtype} {list(ids.shape)}")
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InputError(f"ids= must be a sequence of integer token ids, got {type(ids).__name__}")
    bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))), None)
    if bad is not None:
        raise InputError(f"ids= must hold integer token ids, got {bad!r:.40}")
    out = [int(i) for i in ids]
    huge = next((i for i in out if not -2 ** 63 <= i < 2 ** 63), None)  # a tensor could not even hold it
    if huge is not None:
        raise InputError(f"token id {huge:.3g} is outside the vocabulary")
    return out
