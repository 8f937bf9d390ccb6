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
from typing import Any, Callable, Collection, Iterator

from engine import load_model
from engine.errors import InputError
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.recorders import RecordPolicy, Recorder, record
from workbench.signals import families_from_spec
Loader = Callable[..., tuple[Any, Tokenizer]]


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
    options = dict(prefill_chunk=prefill_chunk, model_name=str(model_ref), progress=progress)
    if snapshot is not None:
        session = Session.load(snapshot, model, tokenizer, **options)
    else:
        session = Session(model, tokenizer, **options)
    if trace is None:
        yield RecordedSession(session, None)
        return
    with record(session, trace=trace, policy=policy, overwrite=overwrite, signals=families) as recorder:
        yield RecordedSession(session, recorder)
