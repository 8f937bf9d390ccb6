"""Sessions: a growing context (documents, chat turns) with chunked prefill and streaming decode.

The session owns the per-sequence state (`engine.cache.ModelState`) and is the only place that
moves positions forward. Consistency law: logits from chunked prefill + one-token decode equal the
full causal forward's logits at every position.

    session = Session(model, tokenizer)
    session.append(document_text, name="report.txt")        # raw text segment
    session.append("What is the planted fact?", role="user")  # chat message
    session.append(image="chart.png", role="user")            # an image in a user turn (tower runs now)
    for tok in session.generate(max_new_tokens=64, temperature=0):
        print(tok.text, end="")
    session.save("snap/")                                    # safetensors + JSON
    again = Session.load("snap/", model, tokenizer)          # continues identically

Images (spec section 8): `append(image=...)` and `append_message(role, text, images=[...])`; the
media tokens and what a segment records are described in `engine.session.images`.

Observers (`session.observers`) receive `(event, payload)` for progress and tokens, so the CLI,
recorders and the dashboard follow a session without the session knowing them.

The model calls themselves (one forward over a span of positions, the chunked prefill loop with its
progress and logits buffer) are `engine.session.prefill`'s; `Session` checks the arguments and calls them.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from engine.deployment import DeploymentRecord
from engine.errors import InputError
from engine.model import KimiForCausalLM
from engine.session.arguments import check_names, check_types, token_ids
from engine.session.sampling import SamplingParams, make_generator, sample
from engine.session.segments import Segment
from engine.session.intervention_log import activate as activate_interventions
from engine.session.state import restore, session_state_dict
from engine.session.snapshot import read_snapshot, write_snapshot
from engine.tokenizer import Message, Tokenizer
from engine.session.transcript import TranscriptMessage, append_rendered, parse_messages, render_messages
from engine.vision import ImageSource
from engine.session.images import PreparedImage, image_record, prepare_image
from engine.session.prefill import run_forward, run_prefill

Observer = Callable[[str, dict], None]


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
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r:.40}")
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
        # the interventions the model applies to this session's forward calls, and the record of them
        self._interventions: Any = None  # engine.interventions.InterventionPlan
        self.intervention_log: list[dict] = []
        # what the caller says about this run for its records (e.g. the task asked and where its fact is):
        # JSON-able fields, announced to observers by `annotate` (a recording writes them into session.json)
        self.annotations: dict[str, Any] = {}
        # images appended but not yet prefilled: (first position, projector outputs [n, hidden])
        self._pending_images: list[tuple[int, torch.Tensor]] = []
        # segment id -> RGB thumbnail (longest side <= THUMBNAIL_PX); snapshots carry it as a PNG
        self.image_thumbnails: dict[int, Any] = {}
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
               image: ImageSource | None = None, name: str | None = None, kind: str | None = None) -> Segment:
        """Add a segment to the context (not yet run through the model; see `prefill`).

        Args:
            text: plain text, encoded with no special tokens allowed (no chat-structure injection).
            role: make it a chat message (`user`, `system`, `assistant`, `tool`) in the K3 format.
            ids: token ids instead of text.
            image: a picture (PIL image, path or encoded bytes): an "image" segment holding its media
                tokens, one position per merged patch; the tower runs now (ImageError for a bad image,
                InputError for a model without vision weights, both before anything changes).
            name: label shown by the inspector (a file name, "question", ...).
            kind: segment kind (default: "turn" for chat messages, "image" for images, "document" otherwise).
        """
        if sum(x is not None for x in (text, ids, image)) != 1:
            raise InputError("append needs exactly one of text=, ids= or image=")
        check_types(text=(text, str), role=(role, str), name=(name, str), kind=(kind, str))
        check_names(name)
        if image is not None:
            return self._append_image(image, role=role, name=name, kind=kind)
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
            new = token_ids(ids)
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

    def append_message(self, role: str, text: str | None = None, *, images: Sequence[ImageSource] = (),
                       image_names: Sequence[str | None] | None = None, name: str | None = None) -> list[Segment]:
        """One chat message holding `images` (in order) and then `text` (spec sections 8-9):
        `<|open|>message role="R"<|sep|>` image spans, text `<|close|>message<|sep|><|end_of_msg|>`.

        Every image is preprocessed and run through the tower before anything changes (a bad one
        raises ImageError naming it, and the session is as it was). Returns the segments, one per
        image (kind "image") and one for the text (kind "turn", named `name` or "prompt"), all with
        `role`; the opening tag lies in the first, the closing tag in the last.
        """
        if text is None and not images:
            raise InputError("a message needs text or at least one image")
        check_types(role=(role, str), text=(text, str), name=(name, str))
        if text is not None and not text:
            raise InputError("empty text: nothing to append")
        if self.tokenizer is None:
            raise InputError("chat messages need a tokenizer")
        names = list(image_names) if image_names is not None else [None] * len(images)
        if len(names) != len(images):
            raise InputError(f"{len(images)} image(s) but {len(names)} image name(s)")
        check_names(name, *(n for n in names if isinstance(n, str)))
        head, tail = self.tokenizer.message_frame(role)  # checks the role before the tower runs
        # every image is checked (and the length limit) before any tower runs or anything is committed
        parts: list[tuple[str, Any]] = [("image", self._prepare_image(im, label)) for im, label in zip(images, names)]
        if text is not None:
            parts.append(("text", self._encode(text)))
        lengths = [len(part.ids) if kind == "image" else len(part) for kind, part in parts]
        total = len(self.tokens) + len(head) + len(tail) + sum(lengths)
        limit = self.config.max_position_embeddings
        if total > limit:
            raise InputError(f"context would hold {total} tokens with this message; the model's limit is {limit}")
        for kind, part in parts:
            if kind == "image":
                self._run_tower(part)
        out = []
        for i, (kind, part) in enumerate(parts):
            before = head if i == 0 else []
            after = tail if i == len(parts) - 1 else []
            if kind == "image":
                out.append(self._commit_image(part, before, after, role=role, kind=None))
            else:
                ids = before + part + after
                self.model.check_input_ids(torch.tensor([ids]))
                out.append(self._add_segment(ids, kind="turn", name=name or "prompt", role=role))
        return out

    def append_messages(self, messages: "Sequence[dict] | Sequence[TranscriptMessage]", *,
                        image_root: str | Path | None = None, add_generation_prompt: bool = False) -> list[Segment]:
        """A conversation in the OpenAI messages format (`engine.session.transcript`): one segment per message,
        plus one per image. Every message is checked and every image preprocessed before anything
        changes (InputError naming the message and field). Local image paths must lie inside
        `image_root` (none allowed without it); `data:` URLs always work."""
        if messages and all(isinstance(m, TranscriptMessage) for m in messages):
            parsed = list(messages)
        else:
            parsed = parse_messages(messages, image_root=Path(image_root) if image_root is not None else None)
        chat = render_messages(self.model, self.tokenizer, parsed, add_generation_prompt=add_generation_prompt,
                               start=len(self.tokens))
        return append_rendered(self, chat)

    def _add_segment(self, ids: list[int], *, kind: str, name: str, role: str | None, modality: str = "text",
                     image: dict | None = None) -> Segment:
        start = len(self.tokens)
        self.tokens.extend(ids)
        seg = Segment(id=len(self.segments), kind=kind, name=name, start=start, end=len(self.tokens), role=role,
                      modality=modality, image=image)
        self.segments.append(seg)
        self._emit("segment", segment=seg)
        return seg

    def _append_image(self, image: ImageSource, *, role: str | None, name: str | None,
                      kind: str | None) -> Segment:
        prepared = self._prepare_image(image, name)
        head: list[int] = []
        tail: list[int] = []
        if role is not None:  # the image alone is a whole chat message
            assert self.tokenizer is not None
            head, tail = self.tokenizer.message_frame(role)
        total = len(self.tokens) + len(head) + len(tail) + len(prepared.ids)
        limit = self.config.max_position_embeddings
        if total > limit:
            raise InputError(f"context would hold {total} tokens with this image; the model's limit is {limit}")
        self._run_tower(prepared)
        return self._commit_image(prepared, head, tail, role=role, kind=kind)

    def _prepare_image(self, image: ImageSource, name: str | None) -> PreparedImage:
        """Preprocess `image` into its media ids; changes nothing (ImageError / InputError first)."""
        return prepare_image(self.model, self.tokenizer, image, name)

    def _run_tower(self, prepared: PreparedImage) -> None:
        with torch.inference_mode():
            prepared.embeds = self.model.encode_images([prepared.processed])[0]  # [rows * cols, hidden]

    def _commit_image(self, prepared: PreparedImage, head: list[int], tail: list[int], *, role: str | None,
                      kind: str | None) -> Segment:
        """Append a prepared image (with the chat tags `head` before and `tail` after it) as one segment."""
        processed = prepared.processed
        assert prepared.embeds is not None, "the tower runs before an image is committed"
        first = len(self.tokens) + len(head) + prepared.pad_at
        info = image_record(prepared, first)
        self._pending_images.append((first, prepared.embeds))
        if processed.thumbnail is not None:
            self.image_thumbnails[len(self.segments)] = processed.thumbnail
        return self._add_segment(head + prepared.ids + tail, kind=kind or "image",
                                 name=prepared.label or f"image {len(self.segments)}", role=role,
                                 modality="image", image=info)

    def annotate(self, **fields: Any) -> None:
        """Add JSON-able `fields` to this run's `annotations` and announce them to observers (event
        "annotations"): how a caller hands a recording what it knows about the run, without looking for
        the recording."""
        self.annotations.update(fields)
        self._emit("annotations", fields=dict(fields))

    # ---- interventions (engine.interventions) -----------------------------------------------
    def set_interventions(self, spec: Any) -> None:
        """Make `spec` (a JSON list, its text, or `engine.interventions` dataclasses; [] = none) the
        interventions of every later forward call of this session, replacing the current ones. Layers,
        heads, experts and positions are checked against the model first (InputError, nothing changes);
        `intervention_log` records each with the positions consumed while it was active; observers get an
        "interventions" event (a recording writes the log into its trace)."""
        self._interventions = activate_interventions(self, spec)
        self._emit("interventions", log=self.intervention_log)

    @property
    def interventions(self) -> tuple:
        """The active interventions (dataclasses of `engine.interventions`)."""
        return () if self._interventions is None else self._interventions.items

    # ---- running the model (engine.session.prefill) -----------------------------------------
    def _forward(self, ids: list[int], phase: str, all_logits: bool) -> torch.Tensor:
        """Run `ids` at positions [length, length + n); returns logits [n or 1, V] fp32."""
        return run_forward(self, ids, phase, all_logits)

    def prefill(self, *, return_logits: bool = False, until: int | None = None) -> torch.Tensor | None:
        """Consume every pending token, `prefill_chunk` at a time (bounded memory at any length).
        `until`: stop at that position instead (a branch point: `fork()` there, then run each branch on).

        Returns the logits [pending, V] when `return_logits`, else the last position's [V]
        (None when nothing was pending and nothing was ever run).
        """
        end = len(self.tokens) if until is None else until
        if isinstance(end, bool) or not isinstance(end, int) or not self.state.length <= end <= len(self.tokens):
            raise InputError(f"until={until!r:.40} must be a position in [{self.state.length}, {len(self.tokens)}]")
        if end == self.state.length:
            return None if return_logits else self.last_logits
        return run_prefill(self, end, return_logits)

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
        check_types(params=(params, SamplingParams))
        unknown = sorted(map(str, set(overrides) - {f.name for f in fields(SamplingParams)}))
        if unknown:  # checked before anything changes: a bad call leaves the session's sampler as it was
            raise InputError(f"unknown sampling parameter(s) {', '.join(unknown)[:120]}")
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
            # a chat message ends in its text (a "turn") or, for a message of images only, in an image
            add_generation_prompt = (last is not None and last.kind in ("turn", "image")
                                     and last.role not in (None, "assistant"))
        if add_generation_prompt:
            if self.tokenizer is None:
                raise InputError("a generation prompt needs a tokenizer")
            prompt = self.tokenizer.chat_prompt([], add_generation_prompt=True)
            self.append(ids=prompt, name="assistant", kind="turn", role="assistant")
        self._stop = False
        requested = time.perf_counter()
        self.prefill()
        stops = set(p.stop_ids)
        eos = self.config.special_token_id("eos_token_id")  # an eos outside the vocabulary is never sampled
        if eos is not None:
            stops.add(eos)
        if p.max_new_tokens == 0:
            return
        seg = Segment(id=len(self.segments), kind="generated", name="generated", start=len(self.tokens),
                      end=len(self.tokens), role="assistant")
        self.segments.append(seg)
        try:
            yield from self._decode_loop(seg, p, stops, requested)
        finally:  # also when the caller stops iterating: listeners hold every step that ran
            self.deliver_probes()

    def deliver_probes(self) -> None:
        """Hand listeners the decode steps' probe emissions still held on the tape (`engine.decode.probe_tape`).
        Generation calls it when it ends and every other forward before it runs; a listener that wants
        them sooner calls `ProbePoint.deliver` (as a recorder's flush does)."""
        step = getattr(self.model, "_decode_step", None)
        if step is not None:
            step.deliver()

    def _decode_loop(self, seg: Segment, p: SamplingParams, stops: set[int],
                     requested: float) -> Iterator[GeneratedToken]:
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
        hash, segments, sampling, step, deployment record). `engine.session.snapshot` writes it to disk.

        Image segments are kept (their `image` dict, with the pixel hash) but never their pixels:
        an image must be prefilled before a snapshot is taken (InputError otherwise). Their
        thumbnails go along as PNG bytes (`thumbnails.<segment id>`, uint8), so viewers of a
        resumed session still draw the picture."""
        return self._state_dict()

    def _state_dict(self, *, pending_images_ok: bool = False, thumbnails: bool = True) -> dict[str, Any]:
        if self._pending_images and not pending_images_ok:
            raise InputError(f"{len(self._pending_images)} image(s) are appended but not prefilled; snapshots hold no "
                             "pixels: run prefill() first")
        return session_state_dict(self, thumbnails=thumbnails)

    def load_state_dict(self, state: dict[str, Any], *, expect_tokens: Sequence[int] | None = None) -> None:
        """Continue from `state` (as `state_dict()` gives it); tensors are copied onto this session's device.

        Refuses (InputError) a state of another model or other weights, a token prefix other than
        `expect_tokens`, and any tensor whose name or shape the config does not imply: restoring
        KDA state for the wrong prefix silently produces garbage, so it is never allowed. Every
        check runs before any field changes (`engine.session.state.restore`).
        """
        r = restore(state, self.model, dtype=self.dtype, device=self.device, expect_tokens=expect_tokens)
        self.state, self.tokens, self.segments = r.layers, r.tokens, r.segments
        self._pending_images, self.image_thumbnails = [], r.thumbnails
        self.step, self.sampling = r.step, r.sampling
        if r.generator is not None:
            self.generator.set_state(r.generator)
        self.last_logits = r.last_logits
        # the deployment record describes a run (this process, this hardware): a restored session starts a new one
        self.previous_deployments = r.previous_deployments

    def fork(self) -> "Session":
        """An independent copy (same model) that continues from exactly this point."""
        other = type(self)(self.model, self.tokenizer, prefill_chunk=self.prefill_chunk,
                           model_name=self.deployment.model, progress=self.progress)
        other.load_state_dict(self._state_dict(pending_images_ok=True, thumbnails=False))
        other._pending_images = list(self._pending_images)  # embeddings are never modified: share them
        other.image_thumbnails = dict(self.image_thumbnails)
        # a branch continues this run: it inherits the record so far and the sampling filters
        other.deployment = copy.deepcopy(self.deployment)
        other.previous_deployments = copy.deepcopy(self.previous_deployments)
        other.suppressed_ids = self.suppressed_ids
        other._interventions = self._interventions  # a plan is never modified: share it
        other.intervention_log = copy.deepcopy(self.intervention_log)
        other.annotations = copy.deepcopy(self.annotations)
        return other

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write a snapshot (`snapshot.json` + `state.safetensors`) atomically; see `engine.session.snapshot`."""
        if not isinstance(path, (str, os.PathLike)):
            raise InputError(f"path= must be a str or path, got {type(path).__name__}")
        return write_snapshot(Path(path), self.state_dict(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path, model: KimiForCausalLM, tokenizer: Tokenizer | None = None, *,
             expect_tokens: Sequence[int] | None = None, **kwargs) -> "Session":
        """Restore a snapshot; refuses a different model, or `expect_tokens` other than its prefix."""
        if not isinstance(path, (str, os.PathLike)):
            raise InputError(f"path= must be a str or path, got {type(path).__name__}")
        state = read_snapshot(Path(path))
        session = cls(model, tokenizer, **kwargs)
        try:
            session.load_state_dict(state, expect_tokens=expect_tokens)
        except InputError as exc:
            raise InputError(f"{path}: {exc}") from None
        return session
