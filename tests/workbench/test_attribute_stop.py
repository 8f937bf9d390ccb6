"""`workbench.attribute(..., should_stop=...)` on preset:tiny: asked before every run (and before the plain
answer), a True stops it between two runs with `Cancelled` ("after N of up to M runs"), and the session
it stopped on attributes afterwards exactly as a fresh one does (nothing half-done is left in it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import workbench
from engine.errors import InputError
from engine.session import Session
from workbench.causal.stop import Cancelled
from workbench.sessions import load_with_tokenizer

TEXT = " ".join(["The ferry leaves at nine.", "Gulls circle the harbour wall.", "The vault code is 4-7-1-9.",
                 "Rain fell all afternoon.", "A dog slept by the door.", "The bakery closes at six."] * 3)
COUNTS = dict(masks=8, holdout=2, top=1, controls=2)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_with_tokenizer("preset:tiny")


def _session(tiny) -> Session:
    model, tokenizer = tiny
    session = Session(model, tokenizer, progress=False)
    session.append(TEXT, name="notes.txt")
    return session


def _attribute(session: Session, should_stop=None):
    return workbench.attribute(session, continuation="What is the vault code?", target=" 4-7-1-9", **COUNTS,
                               should_stop=should_stop)


def test_should_stop_is_asked_before_every_run_and_stops_after_the_first(tiny) -> None:
    asked: list[int] = []

    def never() -> bool:
        asked.append(1)
        return False

    full = _attribute(_session(tiny), never)
    assert full.runs > 2 and len(asked) == full.runs + 1  # before each run, and before the plain answer

    session = _session(tiny)
    answers = iter([False, True])  # go on before the plain run, stop before the next one
    with pytest.raises(Cancelled, match=r"^attribution cancelled after 1 of up to \d+ runs$") as stopped:
        _attribute(session, lambda: next(answers))
    assert stopped.value.done == 1 and stopped.value.planned >= full.runs
    # the session it stopped on is whole: attributing on it again measures what a fresh session measures
    again = _attribute(session)
    assert again.runs == full.runs
    assert np.array_equal(again.mask_logprobs, full.mask_logprobs)
    assert [(s.start, s.effect) for s in again.spans] == [(s.start, s.effect) for s in full.spans]


def test_a_should_stop_that_is_not_callable_is_refused_before_anything_runs(tiny) -> None:
    session = _session(tiny)
    with pytest.raises(InputError, match="should_stop must be a callable"):
        _attribute(session, should_stop=True)
    assert session.length == 0
