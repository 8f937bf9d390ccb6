"""Sharded safetensors checkpoints: headers checked before any data is touched, tensors mmapped.

`CheckpointFiles.open(dir)` reads `model.safetensors.index.json` (or a lone `model.safetensors`),
parses every shard's header itself and checks it against the file size, so a truncated or missing
shard is reported by name instead of failing deep inside a reader. Tensor data is read lazily
through memory maps (`safetensors.safe_open`): only what is asked for is paged in, and
`get_slice` reads just one rank's rows or columns of a tensor. `bytes_read` counts what was read.

`read_into` reads one tensor's bytes with plain file reads straight into the memory that keeps it
(a model parameter), converting the dtype through one tensor-sized buffer when the file's differs.
Loading through the memory map instead left every page of the file mapped into the process until
the handles closed: on a 443 MB fp32 checkpoint the load peaked at the parameters plus the whole
file (1,233 MB) where the parameters alone hold 810 MB after it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.io.files import read_limited, require_regular

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 512 * 1024 * 1024
_MAX_INDEX = 256 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1, "F4": 1}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # where the tensor's bytes start in the file


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one shard's header. Raises CheckpointError naming the file on any defect."""
    if path.exists():
        require_regular(path, "a safetensors shard", CheckpointError)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: truncated or not safetensors: header claims {header_len} bytes, "
                                      f"file has {size}")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    data_size = size - 8 - header_len
    out: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        name = key if key.isprintable() else repr(key)  # for messages only: they stay one line
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not (isinstance(dtype, str) and all(_is_count(v) for v in (*shape, begin, end)) and begin <= end):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {entry!r:.200}") from None
        numel = 1
        for s in shape:
            numel *= s
        expected = numel * _ITEMSIZE.get(dtype, 0)
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name}: unknown dtype {dtype!r:.40}")
        if end - begin != expected:
            raise CheckpointError(f"{path}: tensor {name}: header says {end - begin} bytes for "
                                  f"{dtype}{list(shape)} ({expected} expected)")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated: tensor {name} needs bytes up to {end} of the data "
                                  f"section but the file holds only {max(data_size, 0)}")
        out[key] = TensorInfo(path, dtype, shape, expected, 8 + header_len + begin)
    return out


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_weight_map(root: Path, index_path: Path) -> dict[str, str]:
    """The index's weight_map, checked: {tensor name: shard file inside the checkpoint directory}."""
    data = read_limited(index_path, f"a {INDEX_FILE}", CheckpointError, _MAX_INDEX)
    try:
        weight_map = json.loads(data.decode("utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_path}: corrupt index ({str(exc)[:200]})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: corrupt index (weight_map must be an object {{tensor: shard file}}, "
                              f"got {type(weight_map).__name__})")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{index_path}: corrupt index (weight_map[{name!r:.80}] must be a shard file "
                                  f"name, got {file!r:.80})")
        # a shard lies inside the checkpoint directory (lexically: a symlink there may point anywhere,
        # as the Hugging Face cache's snapshot links do), never at ../ or an absolute path
        normal = os.path.normpath(file)
        if os.path.isabs(file) or normal == ".." or normal.startswith(".." + os.sep) or "\0" in file:
            raise CheckpointError(f"{index_path}: weight_map[{name!r:.80}] = {file!r:.80} points outside the "
                                  f"checkpoint directory {root}; shards must lie inside it (or be symlinks there)")
    return weight_map


class CheckpointFiles:
    """All tensors of a (sharded) safetensors checkpoint, by name; data read on demand."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo]) -> None:
        self.root = root
        self.tensors = tensors
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0  # tensor bytes handed out by get / get_slice

    @classmethod
    def open(cls, root: str | os.PathLike) -> "CheckpointFiles":
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        index_path = root / INDEX_FILE
        tensors: dict[str, TensorInfo] = {}
        if index_path.exists():
            weight_map = _read_weight_map(root, index_path)
            by_file: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                by_file.setdefault(file, []).append(name)
            for file, names in sorted(by_file.items()):
                shard = root / file
                if not shard.exists():
                    raise CheckpointError(f"{shard}: shard file is missing (the index maps {len(names)} tensors "
                                          f"to it, e.g. {names[0]})")
                header = read_header(shard)
                for name in names:
                    if name not in header:
                        raise CheckpointError(f"{shard}: tensor {name} is listed in {INDEX_FILE} but not in the shard")
                    tensors[name] = header[name]
                for name in header.keys() - set(names):
                    tensors.setdefault(name, header[name])
        else:
            files = [root / SINGLE_FILE] if (root / SINGLE_FILE).exists() else sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{root}: no {INDEX_FILE} and no *.safetensors files")
            for shard in files:
                tensors.update(read_header(shard))
        return cls(root, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> Iterator[str]:
        return iter(self.tensors)

    def _handle(self, info: TensorInfo) -> object:
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt")
            except Exception as exc:  # the library's own errors are not user-readable
                raise CheckpointError(f"{info.file}: cannot open shard ({exc})") from None
            self._handles[info.file] = handle
        return handle

    def get(self, name: str) -> torch.Tensor:
        """The tensor (memory-mapped; copy or convert before writing to it)."""
        info = self.tensors[name]
        try:
            t = self._handle(info).get_tensor(name)  # type: ignore[attr-defined]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{info.file}: tensor {name}: cannot read ({exc})") from None
        self.bytes_read += info.nbytes
        return t

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows/columns [start, stop) of `dim` of a tensor, reading only those bytes."""
        info = self.tensors[name]
        index = (slice(None),) * dim + (slice(start, stop),)
        try:
            t = self._handle(info).get_slice(name)[index]  # type: ignore[attr-defined]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{info.file}: tensor {name}: cannot read [{start}:{stop}] of dim {dim} "
                                  f"({exc})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Read tensor `name` into `dest` (a contiguous CPU tensor of as many elements, any float dtype
        when the file's is one) with file reads: no memory map stays behind, and a tensor whose dtype
        matches is read in place with no copy at all."""
        info = self.tensors[name]
        source_dtype = DTYPES.get(info.dtype)
        numel = 1
        for s in info.shape:
            numel *= s
        if source_dtype is None or dest.device.type != "cpu" or not dest.is_contiguous() or dest.numel() != numel:
            raise ValueError(f"internal: {name} ({info.dtype}{list(info.shape)}) cannot be read into "
                             f"{dest.dtype}{list(dest.shape)} on {dest.device}")
        target = dest if source_dtype == dest.dtype else torch.empty(info.shape, dtype=source_dtype)
        view = memoryview(target.view(torch.uint8).numpy()).cast("B") if info.nbytes else memoryview(b"")
        try:
            with open(info.file, "rb", buffering=0) as f:
                f.seek(info.offset)
                done = 0
                while done < info.nbytes:
                    n = f.readinto(view[done:])
                    if not n:
                        raise CheckpointError(f"{info.file}: truncated while reading tensor {name} "
                                              f"({done} of {info.nbytes} bytes)")
                    done += n
        except OSError as exc:
            raise CheckpointError(f"{info.file}: tensor {name}: cannot read ({exc})") from None
        if target is not dest:
            dest.copy_(target.view(dest.shape))
        self.bytes_read += info.nbytes

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
