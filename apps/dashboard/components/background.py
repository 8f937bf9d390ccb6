"""One job on the model at a time, off the page's event loop: `BackgroundJob`.

Drive mode's What-if rerun and Attribute run for seconds to minutes; the Bokeh event loop must keep
drawing meanwhile, and the model must never run two jobs at once (a session, a rerun, an attribution,
the lens: they share the server's one model lock). A `BackgroundJob` is what each panel keeps for that:

- `start(work)` takes the model lock without waiting (False when something else holds it: the panel says
  so in words), then runs `work(should_stop)` on a daemon thread and releases the lock when it ends;
- `poll()`, from the panel's periodic callback, hands over the `Outcome` once: "done" with what `work`
  returned, "cancelled" after a Stop, or "error" with the status line to show: a user's error (bad input,
  an unreadable trace, a full disk: `user_errors()`) as its plain message, anything else as a bug line that
  names the exception's type, so the server stays up and the user still learns that it failed;
- `cancel()` sets the stop flag `work` reads through `should_stop` between two of its runs (a sweep
  raises `workbench.causal.stop.Cancelled` there; a run in progress always finishes);
- `run_now(work)` is the same lock and the same sorting of errors for a short job run on the event
  loop itself (the lens: well under a second).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    from workbench.causal.stop import ShouldStop


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user can cause, shown as their own message (anything else is a bug, shown with its
    type). Imported when a job ends: the lens is on every drive page, and the trace store's imports
    (pyarrow) have no place in its first paint."""
    from engine import EngineError
    from workbench.trace import TraceError

    return (EngineError, TraceError, OSError, ValueError)


@dataclass(frozen=True)
class Outcome:
    """How a job ended: `kind` "done" (`value` is what it returned), "cancelled" or "error"; `message` is the
    status line for the latter two ("stopped: ..." / "error: ...")."""

    kind: Literal["done", "cancelled", "error"]
    value: Any = None
    message: str = ""


def outcome_of(work: Callable[[], Any], failure: str) -> Outcome:
    """Run `work` and sort how it ended; `failure` opens a bug's line ("rerun failed")."""
    from workbench.causal.stop import Cancelled

    try:
        return Outcome("done", work())
    except Cancelled as exc:
        return Outcome("cancelled", message=f"stopped: {exc}")
    except user_errors() as exc:
        return Outcome("error", message=f"error: {exc}")
    except Exception as exc:  # a bug: still tell the user, and keep the server alive
        return Outcome("error", message=f"error: {failure}: {type(exc).__name__}: {exc}")


class BackgroundJob:
    """A panel's job on the model: one at a time, on a worker thread, under the server's model lock."""

    def __init__(self, lock: threading.Lock, name: str, failure: str) -> None:
        self._lock = lock          # the server's model lock: never two jobs on the model at once
        self._name = name          # the worker thread's name (seen in stack dumps)
        self._failure = failure    # a bug's line starts "error: {failure}: ..."
        self._thread: threading.Thread | None = None
        self._outcome: Outcome | None = None
        self._stop = threading.Event()
        self._running = False
        self._started = 0.0

    @property
    def running(self) -> bool:
        """A job was started and `poll()` has not yet handed its outcome over."""
        return self._running

    @property
    def stopping(self) -> bool:
        """`cancel()` was asked while the job runs (it ends after its current run)."""
        return self._running and self._stop.is_set()

    @property
    def elapsed(self) -> float:
        """Seconds since the running job started (0 when none runs)."""
        return time.monotonic() - self._started if self._running else 0.0

    def start(self, work: Callable[[ShouldStop], Any]) -> bool:
        """Run `work(should_stop)` on a worker thread; False, starting nothing, when the model lock is held.
        RuntimeError when this job is still running (a panel refuses that in words before asking)."""
        if self._running:
            raise RuntimeError(f"{self._name}: a job is already running")
        if not self._lock.acquire(blocking=False):
            return False
        self._stop.clear()
        self._outcome = None
        self._thread = threading.Thread(target=self._work, args=(work,), name=self._name, daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._lock.release()
            raise
        self._running = True
        self._started = time.monotonic()
        return True

    def _work(self, work: Callable[[ShouldStop], Any]) -> None:
        outcome = Outcome("error", message=f"error: {self._failure}: its thread ended without a result")
        try:
            outcome = outcome_of(lambda: work(self._stop.is_set), self._failure)
        finally:
            # the lock goes first: a panel that sees the outcome may start the next job at once
            self._lock.release()
            self._outcome = outcome

    def run_now(self, work: Callable[[], Any]) -> Outcome | None:
        """Run a short `work()` on the caller's thread under the model lock; None when the lock is held."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return outcome_of(work, self._failure)
        finally:
            self._lock.release()

    def cancel(self) -> bool:
        """Ask the running job to stop between two of its runs (False when none runs)."""
        if not self._running:
            return False
        self._stop.set()
        return True

    def poll(self) -> Outcome | None:
        """The finished job's outcome, handed over once (event loop); None while it runs or when none ran."""
        outcome = self._outcome
        if outcome is None:
            return None
        self._outcome = None
        self._running = False
        return outcome

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the worker thread to end (tests, scripts); `poll()` still hands the outcome over."""
        if self._thread is not None:
            self._thread.join(timeout)
