"""Checkpoint values, streamed with bounded memory: NaN/inf in float tensors, E8M0 scale byte 0xFF.

`workbench inspect` validates names, shapes and dtypes from the headers alone; this reads the data
too, a slice of at most `chunk_bytes` at a time through the shards' memory maps, so a 1.56 TB
checkpoint is checked in constant memory. One line per bad tensor names the shard, the tensor, how
many values are bad and the first bad index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from engine.config import ModelConfig
from engine.ops.mxfp4.reference import E8M0_NAN
from engine.weights.names import checkpoint_tensors
from engine.weights.safetensors_io import FLOAT_DTYPES, CheckpointFiles

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class ValueProblem:
    """One tensor with bad values: `str()` is the one-line report."""

    file: str
    tensor: str
    bad: int
    first: tuple[int, ...]
    what: str  # "NaN/inf" or "E8M0 scale byte 0xFF (NaN)"

    def __str__(self) -> str:
        return f"{self.file}: tensor {self.tensor}: {self.bad} {self.what} value(s), first at {list(self.first)}"


def _chunks(files: CheckpointFiles, name: str, chunk_bytes: int) -> Iterable[tuple[int, torch.Tensor]]:
    """(first row, rows) slices of dim 0 of at most ~chunk_bytes each (a whole row at least)."""
    info = files.tensors[name]
    if len(info.shape) == 0 or info.nbytes == 0:
        yield 0, files.get(name)
        return
    rows = info.shape[0]
    per_row = max(1, info.nbytes // max(rows, 1))
    step = max(1, chunk_bytes // per_row)
    for start in range(0, rows, step):
        yield start, files.get_slice(name, 0, start, min(rows, start + step))


def _first(mask: torch.Tensor, row0: int) -> tuple[int, ...]:
    index = mask.nonzero()[0].tolist() if mask.dim() else []
    if index:
        index[0] += row0
    return tuple(index)


def check_values(files: CheckpointFiles, config: ModelConfig | None = None, *,
                 names: Iterable[str] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 progress: Callable[[str], None] | None = None) -> list[ValueProblem]:
    """Every float tensor finite and no E8M0 scale 0xFF; returns the problems found (empty: all good).

    Args:
        files: the opened checkpoint (`CheckpointFiles.open(dir)`).
        config: when given, its tensor table says which uint8 tensors are E8M0 scales; otherwise
            uint8 tensors named `*weight_scale` are.
        names: tensors to check (default: all in the checkpoint).
        chunk_bytes: the most tensor bytes examined at once (memory stays O(chunk_bytes)).
        progress: called with each tensor name before it is checked.
    """
    scales = set()
    if config is not None:
        scales = {s.name for s in checkpoint_tensors(config) if s.kind == "scale"}
    problems: list[ValueProblem] = []
    for name in (names if names is not None else sorted(files.tensors)):
        info = files.tensors[name]
        is_float = info.dtype in FLOAT_DTYPES or info.dtype.startswith("F8_E")
        is_scale = info.dtype == "U8" and (name in scales or (config is None and name.endswith("weight_scale")))
        if not (is_float or is_scale):
            continue
        if progress is not None:
            progress(name)
        bad, first = 0, ()
        for row0, chunk in _chunks(files, name, chunk_bytes):
            mask = (chunk == E8M0_NAN) if is_scale else ~torch.isfinite(chunk.float() if chunk.dtype.itemsize == 1
                                                                         else chunk)
            n = int(mask.sum())
            if n and not first:
                first = _first(mask, row0)
            bad += n
        if bad:
            problems.append(ValueProblem(str(info.file), name, bad, first,
                                         "E8M0 scale byte 0xFF (NaN)" if is_scale else "NaN/inf"))
    return problems
