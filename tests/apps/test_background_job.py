"""`BackgroundJob`, the dashboard panels' one job on the model: its outcome, a user's error as its own
message, a bug as a line naming the exception's type, Stop between two runs, the model lock held
for exactly the job's length, and `run_now` (the lens) sorting errors the same way."""

from __future__ import annotations

import threading

import pytest

from apps.dashboard.components.background import BackgroundJob, Outcome, outcome_of
from engine.errors import InputError
from workbench.causal.stop import Cancelled, check_should_stop, stop_if_asked
from workbench.trace import TraceError


def _finish(job: BackgroundJob) -> Outcome:
    job.wait(10)
    outcome = job.poll()
    assert outcome is not None, "the job left no outcome"
    return outcome


def test_a_job_hands_its_value_over_once_and_frees_the_lock() -> None:
    lock = threading.Lock()
    job = BackgroundJob(lock, "test", "job failed")
    assert not job.running and job.poll() is None and not job.cancel()
    gate = threading.Event()
    assert job.start(lambda should_stop: gate.wait(10) and 42)
    assert job.running and lock.locked() and job.poll() is None  # still running: nothing to hand over
    with pytest.raises(RuntimeError, match="already running"):
        job.start(lambda should_stop: 0)
    gate.set()
    assert _finish(job) == Outcome("done", 42)
    assert not job.running and not lock.locked() and job.poll() is None  # handed over once


def test_a_held_lock_starts_nothing() -> None:
    lock = threading.Lock()
    job = BackgroundJob(lock, "test", "job failed")
    ran = []
    with lock:
        assert not job.start(lambda should_stop: ran.append(1))
        assert job.run_now(lambda: ran.append(1)) is None
    assert not job.running and not ran


@pytest.mark.parametrize("error, message", [
    (InputError("masks must be an integer in [4, 4096], got 2"), "error: masks must be an integer in [4, 4096], got 2"),
    (TraceError("/t: not a trace directory"), "error: /t: not a trace directory"),
    (OSError(28, "No space left on device"), "error: [Errno 28] No space left on device"),
    (KeyError("layer"), "error: job failed: KeyError: 'layer'"),          # a bug: its type named
    (ZeroDivisionError("division by zero"), "error: job failed: ZeroDivisionError: division by zero"),
])
def test_errors_are_sorted_into_a_users_message_or_a_bug_line(error: Exception, message: str) -> None:
    def work(should_stop=None):
        raise error

    lock = threading.Lock()
    job = BackgroundJob(lock, "test", "job failed")
    assert job.start(work)
    assert _finish(job) == Outcome("error", message=message)
    assert not lock.locked()
    assert job.run_now(work) == Outcome("error", message=message)
    assert outcome_of(work, "job failed").message == message


def test_cancel_stops_the_job_between_two_runs() -> None:
    lock = threading.Lock()
    job = BackgroundJob(lock, "test", "job failed")
    started, done = threading.Event(), []

    def sweep(should_stop):
        for run in range(1000):
            stop_if_asked(should_stop, "sweep", run, 1000)
            done.append(run)
            started.set()
            threading.Event().wait(0.002)  # one "run"
        return "finished"

    assert job.start(sweep)
    assert started.wait(10)
    assert job.cancel() and job.stopping
    outcome = _finish(job)
    assert outcome.kind == "cancelled" and outcome.value is None
    assert outcome.message == f"stopped: sweep cancelled after {len(done)} of 1,000 runs" and len(done) < 1000
    assert not job.running and not job.stopping and not lock.locked()
    # the flag is the job's own: the next job starts with it cleared
    assert job.start(lambda should_stop: should_stop())
    assert _finish(job) == Outcome("done", False)


def test_cancelled_words_and_a_bad_should_stop() -> None:
    exc = Cancelled("attribution", 1, 154, exact=False)
    assert str(exc) == "attribution cancelled after 1 of up to 154 runs" and (exc.done, exc.planned) == (1, 154)
    stop_if_asked(None, "x", 0, 1)
    stop_if_asked(lambda: False, "x", 0, 1)
    with pytest.raises(Cancelled, match="x cancelled after 0 of 1 runs"):
        stop_if_asked(lambda: True, "x", 0, 1)
    with pytest.raises(InputError, match="should_stop must be a callable"):
        check_should_stop(True)
    assert check_should_stop(None) is None
