"""Token-id inputs read from files (`workbench logits --input-ids ids.json`): checked before any tensor.

`read_id_lists(path)` returns a non-empty list of non-empty lists of token ids, each in
[0, MAX_TOKEN_ID]; anything else is one `InputError` naming the file and the first bad entry (a
token id of 2**70 would otherwise overflow inside `torch.tensor` with a traceback). The model's
forward then checks the ids against its vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import InputError
from engine.fileio import read_limited

MAX_TOKEN_ID = 2 ** 31 - 1  # ids are int32 in traces; no vocabulary comes near
_MAX_FILE_BYTES = 1 << 30
MAX_PROMPT_BYTES = 1 << 30  # 1M tokens of text is ~4-8 MB; a GiB is a mistake, not a prompt


def parse_id_lists(data: Any, where: str) -> list[list[int]]:
    """Validate decoded JSON as a list of token-id lists; `where` names the source in errors."""
    shape = "a non-empty JSON list of non-empty lists of integer token ids"
    if not isinstance(data, list) or not data:
        raise InputError(f"{where}: expected {shape}")
    for i, seq in enumerate(data):
        if not isinstance(seq, list) or not seq:
            raise InputError(f"{where}: entry {i} is not a non-empty list (expected {shape})")
        for j, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InputError(f"{where}: entry [{i}][{j}] = {t!r:.40} is not an integer token id")
            if not 0 <= t <= MAX_TOKEN_ID:
                shown = f"{t:.4g}" if abs(t) > 10 ** 12 else str(t)
                raise InputError(f"{where}: entry [{i}][{j}] = {shown} is not a token id (0..{MAX_TOKEN_ID})")
    return data


def read_id_lists(path: str | Path) -> list[list[int]]:
    """Token-id lists from a JSON file (see `parse_id_lists`)."""
    path = Path(path)
    raw = read_limited(path, "a JSON file of token-id lists", InputError, _MAX_FILE_BYTES)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"{path}: not valid JSON ({str(exc)[:200]})") from None
    return parse_id_lists(data, str(path))


def read_prompt_file(path: str | Path) -> str:
    """The UTF-8 text of a prompt file (a regular file of at most MAX_PROMPT_BYTES), else one InputError."""
    path = Path(path)
    raw = read_limited(path, "a UTF-8 prompt file", InputError, MAX_PROMPT_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None
