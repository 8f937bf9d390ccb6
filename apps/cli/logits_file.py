"""The output file of `workbench logits`: refused before any work unless it is safe to write, and
replaced atomically.

An existing file at `--out` is replaced only with `--overwrite`, and only when it is a regular file
this command wrote (its safetensors metadata names `FORMAT`); a FIFO, a device, a symbolic link, a
directory or someone else's file is never touched. The new file is written beside the target and
renamed onto it, so a crash keeps the previous logits whole.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.errors import InputError
from engine.io.files import file_kind

FORMAT = "k3-workbench-logits"
HEADER_LIMIT = 16 << 20  # a header naming one tensor per sequence fits many times over


def is_logits_file(path: Path) -> bool:
    """Whether `path` is a safetensors file `workbench logits` wrote (header size checked before it is read)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > min(HEADER_LIMIT, size - 8):
                return False
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        return False
    if meta.get("format") == FORMAT:
        return True
    # written before the format was named: the two metadata keys and only logits.N tensors
    names = [k for k in header if k != "__metadata__"]
    return {"model", "config_hash"} <= set(meta) and all(k.startswith("logits.") for k in names)


def check_target(path: Path, *, overwrite: bool = False) -> None:
    """Refuse, before the model is loaded, an `--out` that logits cannot be written to (InputError, one line)."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise InputError(f"--out {path}: {parent} is not a directory") from None
        return
    if stat.S_ISLNK(mode):
        raise InputError(f"--out {path} is a symbolic link; refusing to write through it (give the file itself)")
    if stat.S_ISDIR(mode):
        raise InputError(f"--out {path} is a directory; give a .safetensors file path")
    if not stat.S_ISREG(mode):
        raise InputError(f"--out {path} is {file_kind(path) or 'not a regular file'}; refusing to replace it")
    if not is_logits_file(path):
        raise InputError(f"--out {path} exists and is not a logits file written by `workbench logits`; refusing to "
                         f"replace it (choose another path)")
    if not overwrite:
        raise InputError(f"--out {path} exists (logits written before); pass --overwrite to replace it")


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *, overwrite: bool) -> None:
    """Write `tensors` to `path` through a temporary beside it, renamed in once complete."""
    path = Path(path)
    check_target(path, overwrite=overwrite)  # again: the forward may have taken hours
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={**metadata, "format": FORMAT})
        os.replace(tmp, path)
    except OSError as exc:
        kept = "the previous file there is kept" if path.exists() else "nothing was written"
        raise InputError(f"cannot write logits to {path}: {exc.strerror or exc}; {kept}") from None
    finally:
        tmp.unlink(missing_ok=True)
