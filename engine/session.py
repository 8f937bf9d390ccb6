"""Sessions: a growing context (documents, chat turns) with chunked prefill and streaming decode.

The session owns the per-sequence state (`engine.cache.ModelState`) and is the only place that
moves positions forward. Consistency law: logits from chunked prefill + one-token decode equal the
full causal forward's logits at every position.

    session = Session(model, tokenizer)
    session.append(document_text, name="report.txt")        # raw text segment
    session.append("What is the planted fact?", role="user")  # chat message
    for tok in session.generate(max_new_tokens=64, temperature=0):
        print(tok.text, end="")
    session.save("snap/")                                    # safetensors + JSON
    again = Session.load("snap/", model, tokenizer)          # continues identically

Observers (`session.observers`) receive `(event, payload)` for progress and tokens, so the CLI,
recorders and the dashboard follow a session without the session knowing them.
"""

from __future__ import annotations

import copy
import hashlib
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm import tqdm

from engine.cache import KDAState, ModelState
from engine.decode_step import DecodeStep
from engine.deployment import DeploymentRecord
from engine.errors import InputError
from engine.model import KimiForCausalLM
from engine.sampling import SamplingParams, make_generator, sample
from engine.snapshot import prefix_hash, read_snapshot, write_snapshot
from engine.tokenizer import Message, Tokenizer

Observer = Callable[[str, dict], None]
PROGRESS_MIN_TOKENS = 8192


@dataclass
class Segment:
    """A labelled token range of the context: a document, a chat turn, generated text or an image."""

    id: int
    kind: str  # "document" | "turn" | "generated" | "image"
    name: str
    start: int
    end: int
    role: str | None = None
    modality: str = "text"


@dataclass
class GeneratedToken:
    id: int
    text: str
    position: int
    logprob: float


class Session:
    """One sequence: its tokens, segments, model state, sampler and deployment record."""

    def __init__(self, model: KimiForCausalLM, tokenizer: Tokenizer | None = None, *, prefill_chunk: int = 2048,
                 model_name: str = "", progress: bool | None = None) -> None:
        if prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.progress = progress
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.state = model.empty_state(1, dtype=self.dtype, device=self.device)
        self.tokens: list[int] = []
        self.segments: list[Segment] = []
        self.last_logits: torch.Tensor | None = None  # [V] fp32 after the last consumed token
        self.step = 0  # forward calls so far (prefill chunks and decode steps)
        self.sampling = SamplingParams()
        self.generator = make_generator(None)
        # reserved placeholder tokens are never sampled (a trained model gives them ~0 probability;
        # random demo weights would not); set to an empty set to sample the raw distribution
        self.suppressed_ids: frozenset[int] = tokenizer.reserved_ids if tokenizer is not None else frozenset()
        self._suppress_key: tuple | None = None
        self._suppress_index: torch.Tensor | None = None
        self.observers: list[Observer] = []
        self._stop = False
        self.previous_deployments: list[dict] = []  # records of earlier runs this session was restored from
        self.deployment = DeploymentRecord(model=model_name or "unnamed", config_hash=self.config.fingerprint(),
                                       variant=self.config.variant, precision=str(self.dtype).removeprefix("torch."),
                                       device=str(self.device))

    # ---- context ----------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens already consumed into the state."""
        return self.state.length

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.state.length

    def _emit(self, event: str, **payload) -> None:
        for observer in self.observers:
            observer(event, payload)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("this session has no tokenizer: append token ids (ids=...) instead of text")
        return self.tokenizer.encode(text)

    def append(self, text: str | None = None, *, role: str | None = None, ids: Sequence[int] | None = None,
               name: str | None = None, kind: str | None = None) -> Segment:
        """Add a segment to the context (not yet run through the model; see `prefill`).

        Args:
            text: plain text, encoded with no special tokens allowed (no chat-structure injection).
            role: make it a chat message (`user`, `system`, `assistant`, `tool`) in the K3 format.
            ids: token ids instead of text.
            name: label shown by the inspector (a file name, "question", ...).
            kind: segment kind (default: "turn" for chat messages, "document" otherwise).
        """
        if (text is None) == (ids is None):
            raise InputError("append needs exactly one of text= or ids=")
        if text is not None:
            if not text:
                raise InputError("empty text: nothing to append")
            if role is not None:
                if self.tokenizer is None:
                    raise InputError("chat messages need a tokenizer")
                new = self.tokenizer.chat_prompt([Message(role, text)], add_generation_prompt=False)
            else:
                new = self._encode(text)
        else:
            new = [int(i) for i in ids]  # type: ignore[union-attr]
            if not new:
                raise InputError("empty token list: nothing to append")
        self.model.check_input_ids(torch.tensor([new]))
        limit = self.config.max_position_embeddings
        if len(self.tokens) + len(new) > limit:
            raise InputError(f"context would hold {len(self.tokens) + len(new)} tokens; the model's limit is {limit}")
        start = len(self.tokens)
        self.tokens.extend(new)
        seg = Segment(id=len(self.segments), kind=kind or ("turn" if role else "document"),
                      name=name or (role or f"segment {len(self.segments)}"), start=start, end=len(self.tokens),
                      role=role)
        self.segments.append(seg)
        self._emit("segment", segment=seg)
        return seg

    # ---- running the model ------------------------------------------------------------------
    def _forward(self, ids: list[int], phase: str, all_logits: bool) -> torch.Tensor:
        """Run `ids` at positions [length, length + n); returns logits [n or 1, V] fp32."""
        kda = [s for s in self.state.layers if isinstance(s, KDAState)]
        saved = [(s.recurrent, s.conv) for s in kda]  # layers rebind, never mutate: cheap rollback
        self.model.probe_context.begin(step=self.step, phase=phase)
        try:
            with torch.inference_mode():
                step = DecodeStep.of(self.model) if phase == "decode" and len(ids) == 1 else None
                mode = "off" if step is None else step.mode(self.device)
                if step is not None and mode != "off":
                    logits = step(ids, self.state, self.device, compiled=mode == "compiled")[0].float()
                else:
                    x = torch.tensor([ids], dtype=torch.long, device=self.device)
                    logits = self.model(x, self.state, last_only=not all_logits)[0].float()
        except BaseException:
            for s, (rec, conv) in zip(kda, saved):
                s.recurrent, s.conv = rec, conv
            raise
        finally:
            self.model.probe_context.end()
        self.state.length += len(ids)
        self.step += 1
        self.last_logits = logits[-1]
        self._emit("step", step=self.step - 1, phase=phase, start=self.state.length - len(ids), count=len(ids))
        return logits

    def prefill(self, *, return_logits: bool = False) -> torch.Tensor | None:
        """Consume every pending token, `prefill_chunk` at a time (bounded memory at any length).

        Returns the logits [pending, V] when `return_logits`, else the last position's [V]
        (None when nothing was pending and nothing was ever run).
        """
        total = self.pending
        if total == 0:
            return None if return_logits else self.last_logits
        collected = []
        show = self.progress if self.progress is not None else total >= PROGRESS_MIN_TOKENS
        bar = tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, disable=not show, smoothing=0.1)
        started = time.perf_counter()
        done = 0
        with bar:
            while self.pending:
                if self._stop:
                    break
                chunk = self.tokens[self.state.length: self.state.length + self.prefill_chunk]
                logits = self._forward(chunk, "prefill", return_logits)
                if return_logits:
                    collected.append(logits)
                done += len(chunk)
                bar.update(len(chunk))
                elapsed = time.perf_counter() - started
                self._emit("prefill_progress", done=done, total=total, elapsed=elapsed)
        self.deployment.note_prefill(done, time.perf_counter() - started)
        return torch.cat(collected) if return_logits else self.last_logits

    def feed(self, ids: Sequence[int], *, name: str = "forced") -> torch.Tensor:
        """Append `ids` and run them now (teacher forcing); returns their logits [n, V]."""
        self.prefill()
        self.append(ids=ids, name=name, kind="document")
        return self.prefill(return_logits=True)  # type: ignore[return-value]

    def request_stop(self) -> None:
        """Ask a running prefill/generate (in another thread) to stop after the current step."""
        self._stop = True

    def generate(self, max_new_tokens: int | None = None, *, params: SamplingParams | None = None,
                 add_generation_prompt: bool | None = None, **overrides) -> Iterator[GeneratedToken]:
        """Stream sampled tokens.

        Pending context is prefilled first (TTFT includes it). Stops at `max_new_tokens`, on a stop
        id (the model's end-of-message token plus `params.stop_ids`; the stop token is yielded), at
        the context limit, or on `request_stop()`. `max_new_tokens=0` only prefills.

        Args:
            params: full sampling parameters (default: the session's, i.e. the model card's).
            add_generation_prompt: open an assistant turn first; default: when the last segment is a
                chat message from someone other than the assistant.
            overrides: individual SamplingParams fields (temperature=0, seed=1, ...).
        """
        base = params or self.sampling
        if max_new_tokens is not None:
            overrides["max_new_tokens"] = max_new_tokens
        p = SamplingParams(**{**asdict(base), **overrides}) if overrides else base
        if p is not self.sampling or p.seed is not None:
            self.sampling = p
            self.generator = make_generator(p.seed)
        if not self.tokens:
            raise InputError("the session is empty: append a prompt first")
        last = self.segments[-1] if self.segments else None
        if add_generation_prompt is None:
            add_generation_prompt = last is not None and last.kind == "turn" and last.role not in (None, "assistant")
        if add_generation_prompt:
            if self.tokenizer is None:
                raise InputError("a generation prompt needs a tokenizer")
            prompt = self.tokenizer.chat_prompt([], add_generation_prompt=True)
            self.append(ids=prompt, name="assistant", kind="turn", role="assistant")
        self._stop = False
        requested = time.perf_counter()
        self.prefill()
        stops = set(p.stop_ids)
        if self.config.eos_token_id is not None:
            stops.add(self.config.eos_token_id)
        if p.max_new_tokens == 0:
            return
        seg = Segment(id=len(self.segments), kind="generated", name="generated", start=len(self.tokens),
                      end=len(self.tokens), role="assistant")
        self.segments.append(seg)
        for i in range(p.max_new_tokens):
            if self._stop or len(self.tokens) >= self.config.max_position_embeddings:
                break
            assert self.last_logits is not None
            logits = self._suppress(self.last_logits)
            token = sample(logits, p, self.generator)
            logprob = float(torch.log_softmax(logits, -1)[token])
            position = len(self.tokens)
            self.tokens.append(token)
            seg.end = len(self.tokens)
            if i == 0:
                self.deployment.note_first_token(time.perf_counter() - requested)
            self.deployment.note_output_token()
            text = self.tokenizer.piece(token) if self.tokenizer else ""
            out = GeneratedToken(token, text, position, logprob)
            self._emit("token", token=out)
            yield out
            if token in stops or i + 1 == p.max_new_tokens:
                break
            t0 = time.perf_counter()
            self._forward([token], "decode", False)
            self.deployment.note_decode_step(time.perf_counter() - t0)

    def _suppress(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.suppressed_ids:
            return logits
        key = (self.suppressed_ids, logits.device)
        if self._suppress_key != key:  # rebuilt only when the set or device changes
            index = torch.tensor(sorted(self.suppressed_ids), device=logits.device)
            self._suppress_key, self._suppress_index = key, index[index < logits.shape[-1]]
        return logits.index_fill(-1, self._suppress_index, float("-inf"))

    def text(self, start: int = 0, end: int | None = None) -> str:
        if self.tokenizer is None:
            raise InputError("this session has no tokenizer")
        return self.tokenizer.decode(self.tokens[start:end])

    # ---- branching and snapshots --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a continuation needs: `tensors` (token ids, sampler RNG, last logits, every
        layer's state; the tensors themselves, not copies) and JSON values (model identity, prefix
        hash, segments, sampling, step, deployment record). `engine.snapshot` writes it to disk."""
        tensors: dict[str, torch.Tensor] = {
            "tokens": torch.tensor(self.tokens, dtype=torch.int64),
            "generator": self.generator.get_state(),
        }
        if self.last_logits is not None:
            tensors["last_logits"] = self.last_logits.float()
        tensors.update(self.state.to_tensors())
        return {
            "tensors": tensors,
            "model": {"config_hash": self.config.fingerprint(), "weights_hash": model_fingerprint(self.model),
                      "variant": self.config.variant, "name": self.deployment.model},
            "tokens": len(self.tokens),
            "consumed": self.state.length,
            "prefix_sha256": prefix_hash(self.tokens),
            "step": self.step,
            "cache_dtype": str(self.dtype).removeprefix("torch."),
            "segments": [asdict(seg) for seg in self.segments],
            "sampling": self.sampling.to_json(),
            # snapshot format v1 calls the deployment record "record"
            "record": self.deployment.to_json(),
        }

    def load_state_dict(self, state: dict[str, Any], *, expect_tokens: Sequence[int] | None = None) -> None:
        """Continue from `state` (as `state_dict()` gives it); tensors are copied onto this session's device.

        Refuses (InputError) a state of another model or other weights, a token prefix other than
        `expect_tokens`, and any tensor whose name or shape the config does not imply: restoring
        KDA state for the wrong prefix silently produces garbage, so it is never allowed.
        """
        config, model = self.config, self.model
        recorded = state.get("model", {})
        if recorded.get("config_hash") != config.fingerprint():
            raise InputError(f"snapshot belongs to a different model (config hash {recorded.get('config_hash')}); "
                             f"this model is {config.fingerprint()} ({config.variant})")
        if recorded.get("weights_hash") != model_fingerprint(model):
            raise InputError(f"snapshot was made with other weights of the same architecture (weights hash "
                             f"{recorded.get('weights_hash')}, this model {model_fingerprint(model)})")
        tensors = state.get("tensors", {})
        if "tokens" not in tensors:
            raise InputError("corrupt snapshot state (no token ids)")
        tokens = tensors["tokens"].tolist()
        if prefix_hash(tokens) != state.get("prefix_sha256") or len(tokens) != state.get("tokens"):
            raise InputError("token ids do not match the recorded prefix hash: corrupt snapshot")
        if expect_tokens is not None and list(expect_tokens) != tokens:
            raise InputError(f"snapshot holds the state of a different token prefix ({len(tokens)} tokens, "
                             f"sha256 {state['prefix_sha256'][:12]}); refusing to reuse it")
        consumed = int(state.get("consumed", -1))
        if not 0 <= consumed <= len(tokens):
            raise InputError(f"invalid consumed-token count {consumed}")
        try:
            layers = ModelState.from_tensors(tensors, config, consumed, dtype=self.dtype, device=self.device,
                                             kda_heads=model.parallel.split(config.kda_num_heads))
        except InputError as exc:
            raise InputError(f"{exc}: corrupt or foreign snapshot") from None
        self.state = layers
        self.tokens = tokens
        self.segments = [Segment(**seg) for seg in state.get("segments", [])]
        self.step = int(state.get("step", 0))
        self.sampling = SamplingParams.from_json(state.get("sampling", {}))
        if "generator" in tensors:
            self.generator.set_state(tensors["generator"].cpu())
        self.last_logits = tensors["last_logits"].to(self.device, copy=True) if "last_logits" in tensors else None
        # the deployment record describes a run (this process, this hardware): a restored session starts a new one
        self.previous_deployments = [state["record"]] if state.get("record") else []

    def fork(self) -> "Session":
        """An independent copy (same model) that continues from exactly this point."""
        other = type(self)(self.model, self.tokenizer, prefill_chunk=self.prefill_chunk,
                           model_name=self.deployment.model, progress=self.progress)
        other.load_state_dict(self.state_dict())
        # a branch continues this run: it inherits the record so far and the sampling filters
        other.deployment = copy.deepcopy(self.deployment)
        other.previous_deployments = copy.deepcopy(self.previous_deployments)
        other.suppressed_ids = self.suppressed_ids
        return other

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write a snapshot (`snapshot.json` + `state.safetensors`) atomically; see `engine.snapshot`."""
        return write_snapshot(Path(path), self.state_dict(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path, model: KimiForCausalLM, tokenizer: Tokenizer | None = None, *,
             expect_tokens: Sequence[int] | None = None, **kwargs) -> "Session":
        """Restore a snapshot; refuses a different model, or `expect_tokens` other than its prefix."""
        state = read_snapshot(Path(path))
        session = cls(model, tokenizer, **kwargs)
        try:
            session.load_state_dict(state, expect_tokens=expect_tokens)
        except InputError as exc:
            raise InputError(f"{path}: {exc}") from None
        return session


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
