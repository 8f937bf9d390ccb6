"""Opening a recorded session: the wiring every entry point shares (`workbench run`, `workbench demo`,
the dashboard's drive mode).

    with recorded_session("preset:demo", "traces/run1", prefill_chunk=1024) as run:
        run.session.append(document, name="doc")
        for tok in run.session.generate(32):
            ...

The steps, in order: load the model (`engine.load_model`, or the caller's cached loader) -> its
tokenizer, or an error naming the model -> a `Session` (fresh, or continued from a snapshot) ->
`workbench.record(...)` into the trace. With `trace=None` nothing is recorded and the block gets
the plain session, so an entry point has one code path whether or not it records.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

from engine import load_model
from engine.errors import InputError
from engine.session import GeneratedToken, Session
from engine.session.sampling import SamplingParams
from engine.session.answer import Answer, generate_answer
from engine.tokenizer import Tokenizer
from workbench.interventions import intervene
from workbench.recorders import RecordPolicy, Recorder, record
from workbench.signals import families_from_spec
Loader = Callable[..., tuple[Any, Tokenizer]]


@dataclass(frozen=True)
class AnswerText:
    """A piece of the answer's shown text, as it is read."""

    text: str


@dataclass(frozen=True)
class AnswerThinking:
    """A piece of the text the model wrote inside `think` (not part of the answer)."""

    text: str


@dataclass(frozen=True)
class AnswerToken:
    """One generated token, before it is read (raw streaming, timing)."""

    token: GeneratedToken


AnswerEvent = AnswerText | AnswerThinking | AnswerToken


@dataclass
class RecordedSession:
    """What `recorded_session` opens.

    Attributes:
        session: the `engine.session.Session` (append, generate, save, ...).
        recorder: the attached `Recorder` (its `writer` takes extra session metadata); None when
            nothing is recorded (`trace=None`).
    """

    session: Session
    recorder: Recorder | None

    def answer(self, params: SamplingParams | None = None, *, interventions: Sequence[Any] = (),
               stop_strings: Sequence[str] = (), on_event: Callable[[AnswerEvent], None] | None = None,
               keep_going: Callable[[GeneratedToken], bool] | None = None, **overrides: Any) -> Answer:
        """Generate one answer (`engine.session.answer.generate_answer`: until the chat response ends)
        with `interventions` active for it (`workbench.intervene`: checked before anything runs) and
        each piece handed to `on_event` as a typed event. Sampling as `Session.generate` takes it."""
        emit = on_event or (lambda event: None)
        # none given: whatever is active on the session stays as it is (an empty intervene would clear it)
        with intervene(self.session, *interventions) if interventions else contextlib.nullcontext():
            return generate_answer(self.session, params, stop_strings=stop_strings, keep_going=keep_going,
                                   on_text=lambda text: emit(AnswerText(text)),
                                   on_thinking=lambda text: emit(AnswerThinking(text)),
                                   on_token=(lambda token: emit(AnswerToken(token))) if on_event else None,
                                   **overrides)


def open_session(model: Any, tokenizer: Tokenizer | None, *, model_name: str, prefill_chunk: int = 2048,
                 progress: bool | None = None, snapshot: str | Path | None = None) -> Session:
    """A `Session` on an already loaded model (fresh, or continued from `snapshot`): how every front door
    gets one (the server's conversations, drive mode's cached models), never by building it itself."""
    options = dict(prefill_chunk=prefill_chunk, model_name=model_name, progress=progress)
    if snapshot is not None:
        return Session.load(snapshot, model, tokenizer, **options)
    return Session(model, tokenizer, **options)


def builtin_models() -> list[str]:
    """The shipped checkpoints that are installed (`builtin:NAME`), the default model first."""
    from engine.builtin import NAMES, ROOT

    return [f"builtin:{n}" for n in NAMES if (ROOT / n / "config.json").is_file()]


def load_with_tokenizer(model_ref: str | Path, **load_options: Any) -> tuple[Any, Tokenizer]:
    """(model, tokenizer) of a checkpoint directory, `builtin:NAME` or `preset:NAME[:VARIANT]`; raises InputError when the
    model has no tokenizer files. `load_options` go to `engine.load_model` (dtype, seed, device, parallel, ...)."""
    model = load_model(model_ref, **load_options)
    tokenizer = Tokenizer.for_model(model_ref, model.config.vocab_size)
    if tokenizer is None:
        raise InputError(f"{model_ref}: no tokenizer files (tiktoken.model) found next to the model")
    return model, tokenizer


@contextlib.contextmanager
def recorded_session(model_ref: str | Path, trace: str | Path | None, *, snapshot: str | Path | None = None,
                     prefill_chunk: int = 2048, progress: bool | None = None,
                     policy: "str | RecordPolicy | dict | None" = "default", families: Collection[str] | None = None,
                     overwrite: bool = False, loader: Loader = load_with_tokenizer,
                     **load_options: Any) -> Iterator[RecordedSession]:
    """Load `model_ref`, open a session on it and record it into `trace` for the duration of the block.

    Args:
        model_ref: checkpoint directory, `builtin:demo` or `preset:NAME[:VARIANT]` (also the session's model name).
        trace: trace directory to record into; None records nothing.
        snapshot: continue this saved session (`Session.load`) instead of starting empty.
        prefill_chunk / progress: passed to the `Session`.
        policy / overwrite: passed to `workbench.record` (`overwrite` replaces an existing trace).
        families: signal families to record (names from `workbench.signals.registered()`); None: all of them.
        loader: `(model_ref, **load_options) -> (model, tokenizer)`; the default loads afresh, the
            dashboard passes its per-process cache.
        load_options: keyword arguments of `engine.load_model` (dtype, seed, device, parallel, ...).

    Yields:
        a `RecordedSession`; leaving the block (normally or by an exception) closes the trace.
    """
    if families is not None:  # checked before the model loads (the recorder checks again, by the same rule)
        if isinstance(families, str) or not families:
            raise InputError(f"families: a non-empty list of signal families (or None for all); got {families!r:.80}")
        families_from_spec(",".join(map(str, families)))
    model, tokenizer = loader(model_ref, **load_options)
    session = open_session(model, tokenizer, model_name=str(model_ref), prefill_chunk=prefill_chunk,
                           progress=progress, snapshot=snapshot)
    if trace is None:
        yield RecordedSession(session, None)
        return
    with record(session, trace=trace, policy=policy, overwrite=overwrite, signals=families) as recorder:
        yield RecordedSession(session, recorder)
