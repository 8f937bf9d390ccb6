"""A session's state as tensors + JSON values, and its checked restoration (what `Session.state_dict`
/ `Session.load_state_dict` and so every snapshot go through).

`session_state_dict(session)` collects; `restore(state, model, ...)` checks every field (model and
weights identity, the token prefix and its hash, counts, segments, thumbnails, sampler state, each
layer's tensors against the config) and returns them as a `Restored` value, so nothing of a session
changes until the whole state has been accepted. `model_fingerprint` tells checkpoints apart.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch

from engine.cache import ModelState
from engine.errors import InputError
from engine.model import KimiForCausalLM
from engine.ops.integrity import state_digest
from engine.session.sampling import SamplingParams
from engine.session.segments import THUMBNAIL_TENSOR, Segment, segments_from_json, thumbnails_from_tensors
from engine.session.snapshot import prefix_hash
from engine.vision.thumbnail import encode_thumbnail

MAX_STEP = 2 ** 31 - 1  # forward steps are int32 in traces


def session_state_dict(session: Any, *, thumbnails: bool = True) -> dict[str, Any]:
    """The state of `session` (an `engine.session.Session`, not imported here: it imports this
    module; see `Session.state_dict`). The caller checks that no image is pending."""
    tensors: dict[str, torch.Tensor] = {
        "tokens": torch.tensor(session.tokens, dtype=torch.int64),
        "generator": session.generator.get_state(),
    }
    if session.last_logits is not None:
        tensors["last_logits"] = session.last_logits.float()
    tensors.update(session.state.to_tensors())
    if thumbnails:
        for seg_id, picture in sorted(session.image_thumbnails.items()):
            png = bytearray(encode_thumbnail(picture))
            tensors[f"{THUMBNAIL_TENSOR}{seg_id}"] = torch.frombuffer(png, dtype=torch.uint8)
    return {
        "tensors": tensors,
        "model": {"config_hash": session.config.fingerprint(), "weights_hash": model_fingerprint(session.model),
                  "variant": session.config.variant, "name": session.deployment.model},
        "tokens": len(session.tokens),
        "consumed": session.state.length,
        "prefix_sha256": prefix_hash(session.tokens),
        "step": session.step,
        "cache_dtype": str(session.dtype).removeprefix("torch."),
        "segments": [asdict(seg) for seg in session.segments],
        "sampling": session.sampling.to_json(),
        # snapshot format v1 calls the deployment record "record"
        "record": session.deployment.to_json(),
        # which interventions were active over which positions (`engine.session.intervention_log`)
        "interventions": list(getattr(session, "intervention_log", [])),
        # integrity: a restore or a fork must give back exactly this recurrent memory (checked in `restore`)
        "kda_digest": kda_digest(tensors),
    }


def kda_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """`engine.ops.integrity.state_digest` of the KDA layers' recurrent states and conv tails (`layers.{i}.recurrent`
    / `.conv`, always fp32, so a restore at another cache dtype keeps them bit for bit; MLA rows follow the
    cache dtype and are not in it)."""
    names = sorted(k for k in tensors if k.startswith("layers.") and k.endswith((".recurrent", ".conv")))
    return state_digest((name, tensors[name]) for name in names)


@dataclass
class Restored:
    """A state that passed every check, ready to become a session's fields."""

    layers: ModelState
    tokens: list[int]
    segments: list[Segment]
    thumbnails: dict
    step: int
    sampling: SamplingParams
    generator: torch.Tensor | None     # CPU generator state (already checked to load)
    last_logits: torch.Tensor | None   # a copy on the session's device
    previous_deployments: list[dict]


def restore(state: dict[str, Any], model: KimiForCausalLM, *, dtype: torch.dtype, device: torch.device,
            expect_tokens: Sequence[int] | None = None) -> Restored:
    """Check `state` (as `session_state_dict` gives it) against `model`; InputError names the first problem."""
    config = model.config
    recorded = state.get("model")
    recorded = recorded if isinstance(recorded, dict) else {}
    if recorded.get("config_hash") != config.fingerprint():
        raise InputError(f"snapshot belongs to a different model (config hash {recorded.get('config_hash')}); "
                         f"this model is {config.fingerprint()} ({config.variant})")
    if recorded.get("weights_hash") != model_fingerprint(model):
        raise InputError(f"snapshot was made with other weights of the same architecture (weights hash "
                         f"{recorded.get('weights_hash')}, this model {model_fingerprint(model)})")
    tensors = state.get("tensors", {})
    if "tokens" not in tensors:
        raise InputError("corrupt snapshot state (no token ids)")
    if tensors["tokens"].ndim != 1 or tensors["tokens"].dtype != torch.int64:
        raise InputError(f"corrupt snapshot state (token ids must be int64 [n], got "
                         f"{str(tensors['tokens'].dtype).removeprefix('torch.')} {list(tensors['tokens'].shape)})")
    # counted before listed: a list of Python ints takes ~36 bytes per token id
    claimed = state.get("tokens")
    if type(claimed) is not int or not 0 <= claimed <= config.max_position_embeddings:
        raise InputError(f"corrupt snapshot metadata (token count {claimed!r:.40} is not an integer in "
                         f"[0, {config.max_position_embeddings}], the model's max_position_embeddings)")
    if tensors["tokens"].numel() != claimed:
        raise InputError(f"corrupt snapshot state (it holds {tensors['tokens'].numel():,} token ids, its metadata "
                         f"says {claimed:,})")
    tokens = tensors["tokens"].tolist()
    if prefix_hash(tokens) != state.get("prefix_sha256") or len(tokens) != state.get("tokens"):
        raise InputError("token ids do not match the recorded prefix hash: corrupt snapshot")
    if expect_tokens is not None and list(expect_tokens) != tokens:
        raise InputError(f"snapshot holds the state of a different token prefix ({len(tokens)} tokens, "
                         f"sha256 {state['prefix_sha256'][:12]}); refusing to reuse it")
    consumed = state.get("consumed", -1)
    if type(consumed) is not int or not 0 <= consumed <= len(tokens):
        raise InputError(f"invalid consumed-token count {consumed!r:.40} (expected an integer in [0, {len(tokens)}])")
    segments = segments_from_json(state.get("segments", []), len(tokens))
    thumbnails = thumbnails_from_tensors(tensors, segments)
    step = state.get("step", 0)
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise InputError(f"invalid step {step!r:.40} (expected an integer in [0, {MAX_STEP}])")
    sampling = SamplingParams.from_json(state.get("sampling", {}))
    generator = tensors.get("generator")
    if generator is not None:
        generator = generator.cpu()
        try:
            torch.Generator(device="cpu").set_state(generator)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InputError(f"invalid sampler generator state ({str(exc).splitlines()[0][:80]})") from None
    try:
        layers = ModelState.from_tensors(tensors, config, consumed, dtype=dtype, device=device,
                                         kda_heads=model.parallel.split(config.kda_num_heads))
    except InputError as exc:
        raise InputError(f"{exc}: corrupt or foreign snapshot") from None
    # a tensor nothing reads is a sign of a foreign or tampered file, not something to carry silently
    known = {"tokens", "generator", "last_logits", *layers.to_tensors()}
    extra = sorted(k for k in tensors if k not in known and not k.startswith(THUMBNAIL_TENSOR))
    if extra:
        raise InputError(f"snapshot holds tensor(s) no session state has: {', '.join(extra[:3])[:120]}")
    recorded_digest = state.get("kda_digest")
    if recorded_digest is not None and recorded_digest != kda_digest(layers.to_tensors()):
        raise InputError(f"the restored KDA state differs from the one saved (digest {str(recorded_digest)[:16]:.16}, "
                         f"restored {kda_digest(layers.to_tensors())[:16]}): corrupt snapshot")
    last_logits = tensors["last_logits"].to(device, copy=True) if "last_logits" in tensors else None
    previous = [state["record"]] if isinstance(state.get("record"), dict) else []
    return Restored(layers, tokens, segments, thumbnails, step, sampling, generator, last_logits, previous)


def model_fingerprint(model: KimiForCausalLM) -> str:
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
