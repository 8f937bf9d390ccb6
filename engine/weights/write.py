"""Write checkpoints in the exact real layout: config.json, sharded safetensors + index, tokenizer.

Tensors are produced one shard at a time from a source (random weights by default), so writing
needs memory for one shard, not the model. Shards are balanced by bytes; an expert's packed
weight and its scale always land in the same shard (as in the real K3 files).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from engine.io import atomic_dir
from engine.config import ModelConfig
from engine.config_io import config_to_hf
from engine.errors import InputError
from engine.io.files import parse_json
from engine.tokenizer import NUM_SPECIAL, write_byte_level_tokenizer
from engine.weights.names import TensorSpec, checkpoint_tensors
from engine.weights.random_init import RandomSource, storage_dtype
from engine.weights.safetensors_io import INDEX_FILE


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and alone in its storage: safetensors refuses tensors that share one, and the
    fused projections' weights are views of one stack (`engine.layers.fused`)."""
    t = t.contiguous()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _plan_shards(specs: list[TensorSpec], n_shards: int, float_dtype: torch.dtype) -> list[list[TensorSpec]]:
    sizes = [s.numel * storage_dtype(s, float_dtype).itemsize for s in specs]
    target = sum(sizes) / n_shards
    shards: list[list[TensorSpec]] = [[]]
    acc = 0.0
    for i, (spec, size) in enumerate(zip(specs, sizes)):
        pair_break = spec.kind == "scale"  # keep weight_packed + weight_scale together
        if acc >= target and len(shards) < n_shards and not pair_break:
            shards.append([])
            acc = 0.0
        shards[-1].append(spec)
        acc += size
    return shards


def write_checkpoint(config: ModelConfig, out_dir: str | Path, *, seed: int = 0, shards: int = 2,
                     float_dtype: torch.dtype = torch.bfloat16, source=None, tokenizer: bool = True,
                     overwrite: bool = False, vision: bool = True) -> Path:
    """Write a checkpoint of `config` (random weights from `seed` unless `source` is given).

    Args:
        shards: number of `model-XXXXX-of-YYYYY.safetensors` files.
        float_dtype: storage dtype of float tensors (bf16 like the real checkpoint; A_log, dt_bias,
            conv weights, o_norm and the router bias stay fp32).
        tokenizer: also write the byte-level tokenizer files (when vocab = 256 bytes + 256 specials).
        overwrite: replace a checkpoint this function wrote (nothing else): built in a temporary beside
            it and swapped in by `engine.io.atomic_dir`, so a kill at any moment keeps one whole
            checkpoint; files the user added to the old one are carried into the new one.
        vision: write the vision tower's tensors when the config has one (False: a text-only export,
            whose config.json still carries the vision_config).
    """
    out = Path(out_dir)
    check_checkpoint_target(out, overwrite=overwrite)
    source = source or RandomSource(config, seed, float_dtype)
    with atomic_dir.building(out, "checkpoint", InputError, is_written_checkpoint) as tmp:
        _write_files(config, tmp, seed, shards, float_dtype, source, tokenizer, vision)
        atomic_dir.carry_over(out, tmp, _own_files(out))
        atomic_dir.replace(tmp, out)
    return out


def _write_files(config: ModelConfig, out: Path, seed: int, shards: int, float_dtype: torch.dtype, source,
                 tokenizer: bool, vision: bool) -> None:
    specs = list(checkpoint_tensors(config, include_vision=vision))
    plan = _plan_shards(specs, max(1, shards), float_dtype)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard_specs in enumerate(plan):
        file = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for spec in shard_specs:
            t = owned(source.get(spec))
            tensors[spec.name] = t
            weight_map[spec.name] = file
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    hf = config_to_hf(config)
    hf.setdefault("torch_dtype", str(float_dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer and config.vocab_size == 256 + NUM_SPECIAL:  # byte-level vocabulary
        write_byte_level_tokenizer(out)
    # written last: marks a complete checkpoint of ours, the one kind `overwrite` may replace; it lists
    # the files written, so a later overwrite drops only those and keeps what the user added
    files = sorted(p.name for p in out.iterdir() if p.name != atomic_dir.PARTIAL_MARKER) + [MARKER_FILE]
    (out / MARKER_FILE).write_text(json.dumps({"format": MARKER_FORMAT, "seed": seed, "files": files}) + "\n")


MARKER_FILE, MARKER_FORMAT = "workbench-checkpoint.json", "k3-workbench-random-checkpoint"


def is_written_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint `write_checkpoint` wrote (its marker file is there)."""
    try:
        marker = parse_json((Path(path) / MARKER_FILE).read_bytes(), MARKER_FILE, InputError)
        return marker.get("format") == MARKER_FORMAT
    except (OSError, InputError, AttributeError):
        return False


# what a checkpoint whose marker lists no files (an older writer's) holds of ours
_OWN_NAMES = re.compile(r"^(config\.json|tiktoken\.model|tokenizer_config\.json|" + re.escape(INDEX_FILE)
                        + r"|" + re.escape(MARKER_FILE) + r"|model-\d{5}-of-\d{5}\.safetensors)$")


def _own_files(out: Path) -> Callable[[str], bool]:
    """Which entries of the checkpoint at `out` `write_checkpoint` wrote: those its marker lists."""
    try:
        files = parse_json((out / MARKER_FILE).read_bytes(), MARKER_FILE, InputError).get("files")
    except (OSError, InputError, AttributeError):
        files = None
    if isinstance(files, list) and all(isinstance(f, str) for f in files):
        return set(files).__contains__
    return lambda name: bool(_OWN_NAMES.match(name))


def check_checkpoint_target(out: Path, *, overwrite: bool = False) -> None:
    """Refuse, before any work, an output path that is a file, or a non-empty directory that is not ours."""
    out = Path(out)
    atomic_dir.recover(out, is_written_checkpoint)
    atomic_dir.require_ours(out, overwrite, is_written_checkpoint,
                            "a checkpoint written by `workbench checkpoint random`", InputError)
    if out.is_dir() and any(out.iterdir()):
        atomic_dir.require_replaceable(out, _own_files(out), InputError)
