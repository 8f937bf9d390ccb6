"""Session snapshots on disk, in open formats: `snapshot.json` + `state.safetensors` (no pickle).

This module only does file I/O. What a snapshot holds is the session's business
(`Session.state_dict()` / `Session.load_state_dict()`, which check the model, the token prefix and
every tensor's shape); here a state dict is written and read back: its `tensors` entry (name ->
tensor) goes to `state.safetensors`, every other entry (JSON values) to `snapshot.json` beside
`format` and `version`. Writing is atomic (a temporary directory renamed into place, the old one
set aside first and deleted last, `engine.io.atomic_dir`), so a crash at any point leaves the last
good snapshot loadable; the next save or load recovers it and removes stale temporaries.
`overwrite` replaces only a snapshot (recognised by `snapshot.json`'s `format`), never anything else,
and files the user added to a snapshot directory are carried into the new one.

Layout of `state.safetensors` (version 1): `tokens` int64 [n]; `generator` uint8 (sampler RNG
state); `last_logits` fp32 [V]; per layer `layers.{i}.recurrent` / `.conv` (KDA) or `.latent` /
`.k_rope` / `.index_keys` (MLA, rows [0, consumed) only); `thumbnails.{segment id}` uint8 [n] per
image segment: its thumbnail's PNG bytes (longest side <= 512 px; checked by `engine.session` on
read), so viewers of a resumed session draw the picture without the source pixels.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.io import atomic_dir
from engine.errors import InputError
from engine.io.files import parse_json, read_limited, require_regular

FORMAT = "k3-workbench-snapshot"
VERSION = 1
META_FILE, STATE_FILE = "snapshot.json", "state.safetensors"
META_LIMIT = 64 << 20  # segments and records of a long session fit many times over


def prefix_hash(tokens: Sequence[int]) -> str:
    """SHA-256 of the token ids as int64: names the prefix a state belongs to."""
    return hashlib.sha256(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()).hexdigest()


def is_snapshot(path: Path) -> bool:
    """Whether `path` is a directory this module wrote (its snapshot.json names our format)."""
    try:
        meta = parse_json((Path(path) / META_FILE).read_bytes(), META_FILE, InputError)
    except (OSError, InputError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT and (Path(path) / STATE_FILE).is_file()


def check_target(path: Path, *, overwrite: bool = False) -> None:
    """Refuse, before any work, a `path` a snapshot cannot be saved to (InputError, one line)."""
    path = Path(path)
    atomic_dir.recover(path, is_snapshot)
    atomic_dir.require_ours(path, overwrite, is_snapshot, "a snapshot", InputError)
    if path.is_dir() and any(path.iterdir()):
        atomic_dir.require_replaceable(path, _written_here, InputError)


def _written_here(name: str) -> bool:
    return name in (META_FILE, STATE_FILE)


def write_snapshot(path: Path, state: dict[str, Any], *, overwrite: bool = False) -> Path:
    """Write `state` (its `tensors` entry plus JSON values) to the directory `path`, atomically.

    Refuses a non-empty `path` unless `overwrite` and it is a snapshot; the old snapshot is replaced
    only after the new one is complete, in steps that keep one of them loadable at every instant.
    """
    path = Path(path)
    check_target(path, overwrite=overwrite)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state["tensors"].items()}
    meta = {"format": FORMAT, "version": VERSION, **{k: v for k, v in state.items() if k != "tensors"}}
    with atomic_dir.building(path, "snapshot", InputError, is_snapshot) as tmp:
        save_file(tensors, str(tmp / STATE_FILE), metadata={"format": FORMAT})
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:  # the marker: written last
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        atomic_dir.carry_over(path, tmp, _written_here)
        atomic_dir.replace(tmp, path)
    return path


def read_snapshot(path: Path) -> dict[str, Any]:
    """The state dict written by `write_snapshot` (raises InputError naming the file that is wrong)."""
    path = Path(path)
    atomic_dir.recover(path, is_snapshot)
    meta_file, state_file = path / META_FILE, path / STATE_FILE
    if not meta_file.exists() or not state_file.exists():
        raise InputError(f"{path}: not a snapshot (needs {META_FILE} and {STATE_FILE})")
    raw = read_limited(meta_file, "snapshot metadata (JSON)", InputError, META_LIMIT)
    require_regular(state_file, "snapshot state (safetensors)", InputError)
    try:
        meta = parse_json(raw, str(meta_file), InputError)
    except InputError as exc:
        raise InputError(f"corrupt snapshot metadata: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{meta_file}: not a K3 Workbench snapshot")
    if meta.get("version") != VERSION:
        raise InputError(f"{meta_file}: snapshot version {meta.get('version')} is not supported (this engine reads "
                         f"version {VERSION})")
    try:
        tensors = load_file(str(state_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"{state_file}: corrupt snapshot state ({exc})") from None
    state = {k: v for k, v in meta.items() if k not in ("format", "version")}
    state["tensors"] = tensors
    return state
