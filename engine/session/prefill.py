"""Running a session's tokens through the model: one forward call, and chunked prefill.

- `run_forward(session, ids, phase, all_logits)`: positions [length, length + n) through the model (the
  compiled decode step for a lone decode token, the layers otherwise), under the session's interventions
  and its pending images; KDA states roll back when the call fails, and only a call that finished moves
  the length, the step count and `last_logits` forward (then observers get a "step" event).
- `run_prefill(session, end, return_logits)`: every pending token up to `end`, `prefill_chunk` at a
  time (bounded memory at any length), with a progress bar for a long prefill, "prefill_progress"
  events after each chunk, and the chunks' logits written into one buffer when the caller asks for them.

`engine.session.session.Session` is the public face that calls these (its `prefill`, `feed` and
decode loop); they read and move forward only the fields `RunningSession` names.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

import torch
from tqdm import tqdm

from engine.cache import KDAState, ModelState
from engine.decode.step import DecodeStep
from engine.deployment import DeploymentRecord
from engine.model import KimiForCausalLM
from engine.session.images import pending_image_inputs

# a prefill this long can take seconds on a CPU, and a user should not wait in silence: its bar is shown
# once the prefill has run PROGRESS_DELAY_S, so a fast one prints nothing
PROGRESS_MIN_TOKENS = 2048
PROGRESS_DELAY_S = 2.0


class RunningSession(Protocol):
    """The fields of a session (`engine.session.session.Session`) the forward and prefill loops use."""

    model: KimiForCausalLM
    state: ModelState
    tokens: list[int]
    device: torch.device
    step: int
    last_logits: torch.Tensor | None  # [V] fp32 after the last consumed token
    prefill_chunk: int
    progress: bool | None  # None: a bar only for a long prefill that is still running after a delay
    deployment: DeploymentRecord
    _pending_images: list[tuple[int, torch.Tensor]]  # (first position, projector rows [n, hidden])
    _interventions: Any  # engine.interventions.InterventionPlan | None
    _stop: bool

    def _emit(self, event: str, **payload: Any) -> None: ...

    def deliver_probes(self) -> None: ...


def run_forward(session: RunningSession, ids: list[int], phase: str, all_logits: bool) -> torch.Tensor:
    """Run `ids` at positions [length, length + n); returns logits [n or 1, V] fp32."""
    model, state = session.model, session.state
    kda = [s for s in state.layers if isinstance(s, KDAState)]
    saved = [(s.recurrent, s.conv) for s in kda]  # layers rebind, never mutate: cheap rollback
    model.probe_context.begin(step=session.step, phase=phase)
    plan = session._interventions  # none for a call it cannot reach: the layers then skip every rule check
    start = state.length
    model.runtime.interventions = plan if plan is not None and plan.acts_on(start, start + len(ids)) else None
    try:
        with torch.inference_mode():
            image_embeds, image_mask = pending_image_inputs(session._pending_images, start, len(ids), session.device)
            step = DecodeStep.of(model) if phase == "decode" and len(ids) == 1 and image_embeds is None else None
            mode = "off" if step is None else step.mode(session.device)
            if step is not None and mode != "off":
                logits = step(ids, state, session.device, compiled=mode == "compiled")[0].float()
            else:
                session.deliver_probes()  # earlier decode steps' emissions reach listeners before these
                x = torch.tensor([ids], dtype=torch.long, device=session.device)
                logits = model(x, state, last_only=not all_logits, image_embeds=image_embeds,
                               image_mask=image_mask)[0].float()
    except BaseException:
        for s, (rec, conv) in zip(kda, saved):
            s.recurrent, s.conv = rec, conv
        raise
    finally:
        model.probe_context.end()
        model.runtime.interventions = None
    state.length += len(ids)
    # images whose every position is now in the state are never needed again
    session._pending_images = [(f, e) for f, e in session._pending_images if f + len(e) > state.length]
    session.step += 1
    # a copy when more rows came back: a view would keep every position's logits alive with the session
    session.last_logits = logits[-1].clone() if logits.shape[0] > 1 else logits[-1]
    session._emit("step", step=session.step - 1, phase=phase, start=start, count=len(ids))
    return logits


def run_prefill(session: RunningSession, end: int, return_logits: bool) -> torch.Tensor | None:
    """Consume the pending tokens up to position `end` (> the session's length), `prefill_chunk` at a
    time, until then or until a stop request. Returns the logits [consumed, V] when `return_logits`,
    else the last position's [V]."""
    total = end - session.state.length
    # the logits of every pending position, written chunk by chunk into one buffer: collecting the
    # chunks and concatenating them held the logits twice (a 4K x 8K prefill: 128 MB more at its peak)
    collected: torch.Tensor | None = None
    show = session.progress if session.progress is not None else total >= PROGRESS_MIN_TOKENS
    bar = tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, disable=not show, smoothing=0.1,
               delay=PROGRESS_DELAY_S if session.progress is None else 0.0)
    started = time.perf_counter()
    done = 0
    with bar:
        while session.state.length < end:
            if session._stop:
                break
            chunk = session.tokens[session.state.length: min(end, session.state.length + session.prefill_chunk)]
            logits = run_forward(session, chunk, "prefill", return_logits)
            if return_logits:
                if collected is None and len(chunk) == total:
                    collected = logits  # one chunk: no buffer, no copy
                else:
                    if collected is None:
                        collected = logits.new_empty((total, *logits.shape[1:]))
                    collected[done: done + len(chunk)] = logits
                del logits
            done += len(chunk)
            bar.update(len(chunk))
            elapsed = time.perf_counter() - started
            session._emit("prefill_progress", done=done, total=total, elapsed=elapsed)
    session.deployment.note_prefill(done, time.perf_counter() - started)
    if return_logits:
        assert collected is not None
        return collected if done == total else collected[:done]  # a stop request ends it early
    return session.last_logits
