"""Session snapshots on disk, in open formats: `snapshot.json` + `state.safetensors` (no pickle).

This module only does file I/O. What a snapshot holds is the session's business
(`Session.state_dict()` / `Session.load_state_dict()`, which check the model, the token prefix and
every tensor's shape); here a state dict is written and read back: its `tensors` entry (name ->
tensor) goes to `state.safetensors`, every other entry (JSON values) to `snapshot.json` beside
`format` and `version`. Writing is atomic (a temporary directory renamed into place), so a crash
never leaves half a snapshot where the last good one was.

Layout of `state.safetensors` (version 1): `tokens` int64 [n]; `generator` uint8 (sampler RNG
state); `last_logits` fp32 [V]; per layer `layers.{i}.recurrent` / `.conv` (KDA) or `.latent` /
`.k_rope` / `.index_keys` (MLA, rows [0, consumed) only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.errors import InputError

FORMAT = "k3-workbench-snapshot"
VERSION = 1
META_FILE, STATE_FILE = "snapshot.json", "state.safetensors"


def prefix_hash(tokens: Sequence[int]) -> str:
    """SHA-256 of the token ids as int64: names the prefix a state belongs to."""
    return hashlib.sha256(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()).hexdigest()


def write_snapshot(path: Path, state: dict[str, Any], *, overwrite: bool = False) -> Path:
    """Write `state` (its `tensors` entry plus JSON values) to the directory `path`, atomically.

    Refuses a non-empty `path` unless `overwrite`; the old snapshot is replaced only after the new
    one is complete.
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise InputError(f"{path} exists and is not empty (pass overwrite=True to replace it)")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state["tensors"].items()}
    meta = {"format": FORMAT, "version": VERSION, **{k: v for k, v in state.items() if k != "tensors"}}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / STATE_FILE), metadata={"format": FORMAT})
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def read_snapshot(path: Path) -> dict[str, Any]:
    """The state dict written by `write_snapshot` (raises InputError naming the file that is wrong)."""
    path = Path(path)
    meta_file, state_file = path / META_FILE, path / STATE_FILE
    if not meta_file.exists() or not state_file.exists():
        raise InputError(f"{path}: not a snapshot (needs {META_FILE} and {STATE_FILE})")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{meta_file}: corrupt snapshot metadata ({exc})") from None
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
