"""Build a model on the meta device and fill it from a checkpoint (or a seeded random source).

- `validate(config, files)`: every expected tensor present, nothing unexpected, shapes and dtypes
  as the config implies. All problems are reported at once, each naming file and tensor.
- `load_model(path, ...)`: the public entry point (`from engine import load_model`). Tensors are
  read lazily through memory maps; only the experts this process holds are read at all, and under
  tensor parallelism only this rank's rows/columns of split tensors (`engine.weights.shard`).
  Ranks of a parallel job first check they all load the same config and dtype.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Protocol, Sequence

import torch
from tqdm import tqdm

from engine.builtin import model_dir
from engine.config import ModelConfig
from engine.errors import CheckpointError, ConfigError
from engine.model import KimiForCausalLM
from engine.model_ref import parse_model_ref
from engine.parallel import comm
from engine.parallel.mesh import SINGLE, ParallelContext
from engine.runtime import RuntimeOptions
from engine.weights.meta import on_meta
from engine.weights.names import DENSE_MLP_ALIAS, TensorSpec, checkpoint_tensors, is_vision_tensor
from engine.weights.random_init import RandomSource
from engine.weights.safetensors_io import FLOAT_DTYPES, CheckpointFiles
from engine.weights.shard import shard_dim

PROGRESS_MIN_BYTES = 512 * 1024 * 1024
_SHOW_AT_MOST = 25


class TensorSource(Protocol):
    def get(self, spec: TensorSpec) -> torch.Tensor: ...

    def get_slice(self, spec: TensorSpec, dim: int, start: int, stop: int) -> torch.Tensor: ...


def _alias(name: str) -> str | None:
    """transformers writes the dense layer's MLP as `block_sparse_moe.{gate,up,down}_proj`."""
    old, new = DENSE_MLP_ALIAS
    return name.replace("." + old, "." + new, 1) if "." + old in name else None


def _shape_ok(spec: TensorSpec, shape: tuple[int, ...], config: ModelConfig) -> bool:
    if spec.init == "a_log":  # stored padded (K3) or as [1, 1, H, 1] (Kimi-Linear)
        n = 1
        for s in shape:
            n *= s
        return n >= config.kda_num_heads
    return shape == spec.shape


IMAGES_UNAVAILABLE = ("config.json has a vision_config but the checkpoint holds no vision_tower.* / mm_projector.* "
                      "tensors (a text-only export)")


def has_vision_tensors(config: ModelConfig, files: CheckpointFiles) -> bool:
    """Whether the checkpoint carries the vision tower. A config with a `vision_config` whose files
    hold no vision tensor at all is a text-only export (loads text-only); some but not all of them
    is a broken checkpoint (`resolve_names` lists the missing ones)."""
    return config.vision is not None and any(is_vision_tensor(name) for name in files.names())


def resolve_names(config: ModelConfig, files: CheckpointFiles) -> tuple[dict[str, str], list[str]]:
    """Map each expected tensor to its name in `files`; return (mapping, problems)."""
    mapping: dict[str, str] = {}
    problems: list[str] = []
    seen: set[str] = set()
    for spec in checkpoint_tensors(config, include_vision=has_vision_tensors(config, files)):
        name = spec.name
        if name not in files:
            alt = _alias(name)
            if alt is not None and alt in files:
                name = alt
            elif spec.optional:
                continue
            else:
                problems.append(f"missing tensor {spec.name} (expected {spec.kind} {list(spec.shape)})")
                continue
        seen.add(name)
        info = files.tensors[name]
        where = f"{info.file.name}: tensor {name}"
        if not _shape_ok(spec, info.shape, config):
            problems.append(f"{where} has shape {list(info.shape)} but config.json implies {list(spec.shape)}")
        elif spec.kind == "float" and info.dtype not in FLOAT_DTYPES:
            problems.append(f"{where} has dtype {info.dtype}; expected a float dtype")
        elif spec.kind != "float" and info.dtype != "U8":
            problems.append(f"{where} has dtype {info.dtype}; MXFP4 {spec.kind} tensors are U8")
        mapping[spec.name] = name
    for name in sorted(set(files.names()) - seen):
        problems.append(f"{files.tensors[name].file.name}: unexpected tensor {name} "
                        f"({files.tensors[name].dtype}{list(files.tensors[name].shape)})")
    return mapping, problems


def validate(config: ModelConfig, files: CheckpointFiles) -> list[str]:
    """All mismatches between a checkpoint's tensors and its config (empty list = valid)."""
    return resolve_names(config, files)[1]


def _problem_report(root: Path, problems: list[str]) -> str:
    shown = "\n".join(f"  - {p}" for p in problems[:_SHOW_AT_MOST])
    more = f"\n  ... and {len(problems) - _SHOW_AT_MOST} more" if len(problems) > _SHOW_AT_MOST else ""
    return f"checkpoint {root} does not match its config.json ({len(problems)} problems):\n{shown}{more}"


class CheckpointSource:
    """Reads each expected tensor from the files, checking values the header cannot show."""

    def __init__(self, files: CheckpointFiles, mapping: dict[str, str]) -> None:
        self.files, self.mapping = files, mapping

    def get(self, spec: TensorSpec) -> torch.Tensor:
        name = self.mapping[spec.name]
        t = self.files.get(name)
        if spec.kind == "scale" and bool((t == 0xFF).any()):
            where = (t == 0xFF).nonzero()[0].tolist()
            raise CheckpointError(f"{self.files.tensors[name].file}: tensor {name}: E8M0 scale byte 0xFF (NaN) "
                                  f"at {where}; the checkpoint is corrupt")
        return t

    def get_slice(self, spec: TensorSpec, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.files.get_slice(self.mapping[spec.name], dim, start, stop)

    def read_into(self, spec: TensorSpec, dest: torch.Tensor) -> int:
        """Read a whole float tensor straight into `dest` (`CheckpointFiles.read_into`) and return the
        file bytes read; 0 when it cannot be (not float, another device, a layout that needs
        reshaping), and the caller copies instead."""
        name = self.mapping[spec.name]
        info = self.files.tensors[name]
        if (spec.kind != "float" or info.dtype not in FLOAT_DTYPES or dest.device.type != "cpu"
                or not dest.is_contiguous() or dest.numel() * _itemsize(info.dtype) != info.nbytes):
            return 0
        self.files.read_into(name, dest)
        return info.nbytes


def _itemsize(code: str) -> int:
    from engine.weights.safetensors_io import DTYPES

    return torch.empty((), dtype=DTYPES[code]).element_size()


def _read(source: TensorSource, spec: TensorSpec, config: ModelConfig, parallel: ParallelContext) -> torch.Tensor:
    """This rank's part of `spec`: the whole tensor, or the rows/columns the shard table gives it."""
    if spec.init == "a_log":  # stored padded (or [1, 1, H, 1]): split its [num_heads] view
        start, stop = parallel.local_range(config.kda_num_heads)
        return source.get(spec).reshape(-1)[start:stop]
    dim = shard_dim(spec) if parallel.world > 1 else None
    if dim is None:
        return source.get(spec)
    start, stop = parallel.local_range(spec.shape[dim])
    return source.get_slice(spec, dim, start, stop)


def _target(model: torch.nn.Module, path: str) -> torch.Tensor:
    module_path, _, leaf = path.rpartition(".")
    module = model.get_submodule(module_path)
    t = getattr(module, leaf, None)
    if not isinstance(t, torch.Tensor):
        raise KeyError(path)
    return t


def fill(model: KimiForCausalLM, source: TensorSource, dtype: torch.dtype, *, progress: bool | None = None,
         total_bytes: int = 0) -> None:
    """Copy every tensor from `source` into `model` (already materialised with to_empty): the text
    model, and the vision tower when the model holds one (`model.vision`, replicated on every rank).

    Routed experts other than the model's `expert_ids` and, under tensor parallelism, other
    ranks' slices of split tensors are never read.
    """
    config = model.config
    filled: set[str] = set()
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights", file=sys.stderr,
               disable=not (progress if progress is not None else total_bytes >= PROGRESS_MIN_BYTES))
    slots: dict[str, dict[int, int]] = {}
    with torch.no_grad(), bar:
        for spec in checkpoint_tensors(config, include_vision=model.vision is not None):
            assert spec.target is not None
            dest = _target(model, spec.target)
            if spec.expert is not None:
                experts_path = spec.target.rsplit(".", 1)[0]
                if experts_path not in slots:
                    ids = model.get_submodule(experts_path).expert_ids
                    slots[experts_path] = {e: i for i, e in enumerate(ids)}
                slot = slots[experts_path].get(spec.expert)
                if slot is None:
                    continue  # held by another rank: never read
                dest = dest[slot]
            if spec.optional and isinstance(source, CheckpointSource) and spec.name not in source.mapping:
                dest.zero_()
            elif (isinstance(source, CheckpointSource) and model.parallel.world == 1 and spec.init != "a_log"
                  and (nbytes := source.read_into(spec, dest))):
                bar.update(nbytes)  # read from the file straight into the parameter
            else:
                t = _read(source, spec, config, model.parallel)
                bar.update(t.numel() * t.element_size())
                dest.copy_(t if spec.kind != "float" else t.to(dtype))
            filled.add(spec.target)
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    unfilled = expected - filled
    if unfilled:
        raise RuntimeError(f"internal: model tensors not covered by the checkpoint table: {sorted(unfilled)[:5]}")


def parse_model_path(path: str | Path) -> tuple[ModelConfig, str | None]:
    """`preset:NAME[:VARIANT]` -> (config, None); a directory or `builtin:NAME` -> (its config, dir)."""
    ref = parse_model_ref(path)
    config = ref.config()
    return config, None if ref.is_preset else str(model_dir(ref.text))


def _check_same_model(config: ModelConfig, dtype: torch.dtype, seed: int | None, parallel: ParallelContext) -> None:
    """Every rank must load the same config, dtype (and random seed); all of them raise when one differs."""
    mine = f"config {config.fingerprint()} dtype {str(dtype).removeprefix('torch.')}"
    if seed is not None:
        mine += f" seed {seed}"
    everyone = comm.gather_strings(mine, parallel)
    if len(set(everyone)) > 1:
        listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
        raise ConfigError(f"ranks disagree on the model to load ({listing})")


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, runtime: RuntimeOptions | None = None, expert_ids: Sequence[int] | None = None,
               progress: bool | None = None, parallel: ParallelContext = SINGLE) -> KimiForCausalLM:
    """Load a checkpoint directory, `builtin:NAME` (a shipped one) or `preset:NAME[:VARIANT]` with random weights (`seed`).

    Args:
        path: checkpoint directory (config.json + safetensors) or `preset:tiny`, `preset:demo:k3`, ...
        device: where the weights live.
        dtype: compute dtype of all float weights (MXFP4 experts stay packed).
        seed: random-weight seed for presets.
        runtime: switches shared by all layers (default `RuntimeOptions()`).
        expert_ids: global ids of the routed experts to hold (default: all, or this rank's range).
        progress: force the progress bar on/off (default: on for loads over 512 MB).
        parallel: this process's place in a tensor/expert-parallel job (`engine.parallel`);
            each rank then reads only its slices and experts.

    Returns:
        a `KimiForCausalLM` in eval mode with `.config` set.
    """
    config, root = parse_model_path(path)
    if parallel.communicates:
        _check_same_model(config, dtype, seed if root is None else None, parallel)
    if config.num_experts and expert_ids is not None:
        bad = [e for e in expert_ids if not 0 <= e < config.num_experts]
        if bad:
            raise ConfigError(f"expert ids {bad[:5]} outside [0, {config.num_experts})")
    source: TensorSource
    total = 0
    with_vision = True
    if root is None:
        source = RandomSource(config, seed)
    else:
        files = CheckpointFiles.open(root)
        mapping, problems = resolve_names(config, files)
        if problems:
            raise CheckpointError(_problem_report(Path(root), problems))
        source = CheckpointSource(files, mapping)
        total = files.total_bytes
        with_vision = has_vision_tensors(config, files)
        if config.vision is not None and not with_vision and parallel.rank == 0:
            print(f"{root}: {IMAGES_UNAVAILABLE}: loading the text model; images are unavailable", file=sys.stderr)
    with on_meta():
        # floats in the compute dtype (MXFP4 experts stay uint8); fill only copies values in
        model = KimiForCausalLM(config, runtime, expert_ids, parallel, with_vision=with_vision).to(dtype)
    model.to_empty(device=device)
    fill(model, source, dtype, progress=progress, total_bytes=total)
    model.eval()
    model.requires_grad_(False)
    return model
