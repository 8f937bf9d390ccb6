"""Session snapshots in open formats: `snapshot.json` + `state.safetensors` (no pickle).

A snapshot records the exact token prefix its state belongs to (ids and a SHA-256 of them) and the
model's config fingerprint. Loading refuses a different model, a prefix other than the one the
caller expects, and any tensor whose shape the config does not imply: restoring KDA state for the
wrong prefix silently produces garbage (other engines' bugs), so it is never allowed.

Layout of `state.safetensors`: `tokens` int64 [n]; `generator` uint8 (sampler RNG state);
`last_logits` fp32 [V]; per layer `layers.{i}.recurrent` / `.conv` (KDA) or `.latent` / `.k_rope`
/ `.index_keys` (MLA, rows [0, consumed) only).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.cache import KDAState, MLACache, ModelState
from engine.errors import InputError
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.model import KimiForCausalLM
    from engine.session import Session
    from engine.tokenizer import Tokenizer

FORMAT = "k3-workbench-snapshot"
VERSION = 1


def model_fingerprint(model: "KimiForCausalLM") -> str:
    """Config hash + a hash of strided samples of every weight: tells two checkpoints of one
    config apart (e.g. different seeds) without reading every byte. Cached on the model."""
    cached = getattr(model, "_snapshot_fingerprint", None)
    if cached is not None:
        return cached
    h = hashlib.sha256(model.config.fingerprint().encode())
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            h.update(name.encode())
            h.update(flat[::step][:64].float().cpu().numpy().tobytes())
    model._snapshot_fingerprint = h.hexdigest()[:16]  # type: ignore[attr-defined]
    return model._snapshot_fingerprint  # type: ignore[attr-defined]


def prefix_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()).hexdigest()


def _state_tensors(session: "Session") -> dict[str, torch.Tensor]:
    n = session.state.length
    out: dict[str, torch.Tensor] = {
        "tokens": torch.tensor(session.tokens, dtype=torch.int64),
        "generator": session.generator.get_state(),
    }
    if session.last_logits is not None:
        out["last_logits"] = session.last_logits.float().cpu()
    for i, layer in enumerate(session.state.layers):
        if isinstance(layer, KDAState):
            out[f"layers.{i}.recurrent"] = layer.recurrent
            out[f"layers.{i}.conv"] = layer.conv
        else:
            out[f"layers.{i}.latent"] = layer.latent[:, :n]
            out[f"layers.{i}.k_rope"] = layer.k_rope[:, :n]
            if layer.index_keys is not None:
                out[f"layers.{i}.index_keys"] = layer.index_keys[:, :n]
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def save_session(session: "Session", path: Path, *, overwrite: bool = False) -> Path:
    """Write the snapshot atomically (a temporary directory renamed into place)."""
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise InputError(f"{path} exists and is not empty (pass overwrite=True to replace it)")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"config_hash": session.config.fingerprint(), "weights_hash": model_fingerprint(session.model),
                  "variant": session.config.variant, "name": session.record.model},
        "tokens": len(session.tokens),
        "consumed": session.state.length,
        "prefix_sha256": prefix_hash(session.tokens),
        "step": session.step,
        "cache_dtype": str(session.dtype).removeprefix("torch."),
        "segments": [asdict(s) for s in session.segments],
        "sampling": session.sampling.to_json(),
        "record": session.record.to_json(),
    }
    save_file(_state_tensors(session), str(tmp / "state.safetensors"), metadata={"format": FORMAT})
    (tmp / "snapshot.json").write_text(json.dumps(meta, indent=1))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], path: Path) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise InputError(f"{path}: tensor {name} has shape {list(tensor.shape)}, the model implies {list(shape)}: "
                         "corrupt or foreign snapshot")


def load_session(cls: type, path: Path, model: "KimiForCausalLM", tokenizer: "Tokenizer | None", *,
                 expect_tokens: Sequence[int] | None = None, **session_kwargs) -> "Session":
    meta_file, state_file = path / "snapshot.json", path / "state.safetensors"
    if not meta_file.exists() or not state_file.exists():
        raise InputError(f"{path}: not a snapshot (needs snapshot.json and state.safetensors)")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{meta_file}: corrupt snapshot metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{meta_file}: not a K3 Workbench snapshot")
    if meta.get("version") != VERSION:
        raise InputError(f"{meta_file}: snapshot version {meta.get('version')} is not supported (this engine reads "
                         f"version {VERSION})")
    config = model.config
    recorded = meta.get("model", {})
    if recorded.get("config_hash") != config.fingerprint():
        raise InputError(f"{path}: snapshot belongs to a different model (config hash {recorded.get('config_hash')}); "
                         f"this model is {config.fingerprint()} ({config.variant})")
    if recorded.get("weights_hash") != model_fingerprint(model):
        raise InputError(f"{path}: snapshot was made with other weights of the same architecture (weights hash "
                         f"{recorded.get('weights_hash')}, this model {model_fingerprint(model)})")
    try:
        tensors = load_file(str(state_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"{state_file}: corrupt snapshot state ({exc})") from None
    if "tokens" not in tensors:
        raise InputError(f"{state_file}: corrupt snapshot state (no token ids)")
    tokens = tensors["tokens"].tolist()
    if prefix_hash(tokens) != meta.get("prefix_sha256") or len(tokens) != meta.get("tokens"):
        raise InputError(f"{path}: token ids do not match the recorded prefix hash: corrupt snapshot")
    if expect_tokens is not None and list(expect_tokens) != tokens:
        raise InputError(f"{path}: snapshot holds the state of a different token prefix ({len(tokens)} tokens, "
                         f"sha256 {meta['prefix_sha256'][:12]}); refusing to reuse it")
    consumed = int(meta.get("consumed", -1))
    if not 0 <= consumed <= len(tokens):
        raise InputError(f"{meta_file}: invalid consumed-token count {consumed}")

    session = cls(model, tokenizer, **session_kwargs)
    dtype, device = session.dtype, session.device
    layers = []
    for i in range(config.num_hidden_layers):
        if config.is_kda_layer(i):
            parts = {}
            for name, (shape, dt) in KDAState.shapes(config, 1).items():
                key = f"layers.{i}.{name}"
                if key not in tensors:
                    raise InputError(f"{state_file}: missing tensor {key}: corrupt or foreign snapshot")
                _expect_shape(key, tensors[key], shape, state_file)
                parts[name] = tensors[key].to(device=device, dtype=dt)
            layers.append(KDAState(**parts))
        else:
            cache = MLACache.empty(config, i, 1, max(256, consumed), dtype, device)
            for name, (shape, _) in MLACache.shapes(config, i, 1, consumed).items():
                key = f"layers.{i}.{name}"
                if key not in tensors:
                    raise InputError(f"{state_file}: missing tensor {key}: corrupt or foreign snapshot")
                _expect_shape(key, tensors[key], shape, state_file)
                getattr(cache, name)[:, :consumed] = tensors[key].to(device=device, dtype=dtype)
            layers.append(cache)
    session.state = ModelState(layers=layers, length=consumed)
    session.tokens = tokens
    from engine.session import Segment

    session.segments = [Segment(**s) for s in meta.get("segments", [])]
    session.step = int(meta.get("step", 0))
    session.sampling = SamplingParams.from_json(meta.get("sampling", {}))
    if "generator" in tensors:
        session.generator.set_state(tensors["generator"])
    if "last_logits" in tensors:
        session.last_logits = tensors["last_logits"].to(device)
    # the record describes a run (this process, this hardware): a restored session starts a new one
    session.previous_records = [meta["record"]] if meta.get("record") else []
    return session


def clone_session(session: "Session") -> "Session":
    """Deep copy of everything but the model (shared) and observers (not inherited)."""
    other = type(session).__new__(type(session))
    for key, value in vars(session).items():
        if key in ("model", "tokenizer", "config"):
            setattr(other, key, value)
        elif key == "observers":
            other.observers = []
        elif key == "generator":
            g = torch.Generator(device="cpu")
            g.set_state(value.get_state())
            other.generator = g
        else:
            setattr(other, key, copy.deepcopy(value))
    return other
