"""Token-id inputs read from files (`workbench logits --input-ids ids.json`): checked before any tensor.

`read_id_lists(path)` returns a non-empty list of non-empty lists of token ids, each in
[0, MAX_TOKEN_ID]; anything else is one `InputError` naming the file and the first bad entry (a
token id of 2**70 would otherwise overflow inside `torch.tensor` with a traceback). The model's
forward then checks the ids against its vocabulary.

`read_sequences(path)` also takes multimodal entries: `{"input_ids": [...], "images": ["a.png", ...]}`
(one `<|media_pad|>` per image in the ids, image paths relative to the JSON file), as `InputSequence`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import InputError
from engine.io.files import parse_json, read_limited

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


MAX_IMAGES_PER_SEQUENCE = 4096


@dataclass(frozen=True)
class InputSequence:
    """One entry of an input-ids file: token ids and the images its `<|media_pad|>` tokens stand for."""

    input_ids: list[int]
    images: tuple[Path, ...] = ()


def parse_sequences(data: Any, where: str, base: Path) -> list[InputSequence]:
    """Validate decoded JSON as a list whose entries are id lists or `{"input_ids", "images"}` objects."""
    shape = ('a non-empty JSON list whose entries are lists of integer token ids or objects '
             '{"input_ids": [...], "images": ["a.png", ...]}')
    if not isinstance(data, list) or not data:
        raise InputError(f"{where}: expected {shape}")
    ids_only, images = [], []
    for i, entry in enumerate(data):
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"input_ids", "images"})
            if unknown or "input_ids" not in entry:
                raise InputError(f"{where}: entry {i} must have \"input_ids\" (and optionally \"images\"); "
                                 f"got keys {sorted(entry)[:6]}")
            paths = entry.get("images", [])
            if (not isinstance(paths, list) or len(paths) > MAX_IMAGES_PER_SEQUENCE
                    or not all(isinstance(p, str) and p for p in paths)):
                raise InputError(f"{where}: entry {i}: \"images\" must be a list of at most "
                                 f"{MAX_IMAGES_PER_SEQUENCE} file names")
            ids_only.append(entry["input_ids"])
            images.append(tuple(base / p for p in paths))
        else:
            ids_only.append(entry)
            images.append(())
    checked = parse_id_lists(ids_only, where)
    return [InputSequence(ids, imgs) for ids, imgs in zip(checked, images)]


def read_sequences(path: str | Path) -> list[InputSequence]:
    """Input sequences from a JSON file (see `parse_sequences`); image paths resolved next to the file."""
    path = Path(path)
    return parse_sequences(_read_json(path), str(path), path.parent)


def _read_json(path: Path) -> Any:
    raw = read_limited(path, "a JSON file of token-id lists", InputError, _MAX_FILE_BYTES)
    return parse_json(raw, str(path), InputError)


def read_id_lists(path: str | Path) -> list[list[int]]:
    """Token-id lists from a JSON file (see `parse_id_lists`)."""
    path = Path(path)
    return parse_id_lists(_read_json(path), str(path))


def read_prompt_file(path: str | Path) -> str:
    """The UTF-8 text of a prompt file (a regular file of at most MAX_PROMPT_BYTES), else one InputError."""
    path = Path(path)
    raw = read_limited(path, "a UTF-8 prompt file", InputError, MAX_PROMPT_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None
