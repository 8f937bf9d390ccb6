"""Stopping a long sweep between two of its runs: `Cancelled`, and `stop_if_asked`, which a sweep calls
before each run.

An attribution at 128K tokens or a what-if rerun with KDA controls runs for minutes, one continuation
after another. The caller (the dashboard's Stop) passes `should_stop`, a callable the sweep asks before
each run, never inside a forward: a run that started finishes, so every session and kept fork stays in a
consistent state. A stopped sweep raises `Cancelled` instead of returning a partial result: a surrogate
fitted on the first masks, or a verdict beside half its controls, would look like a finished one.
"""

from __future__ import annotations

from typing import Callable

# asked before each run of a sweep: True stops the sweep there (None: never asked)
ShouldStop = Callable[[], bool]


class Cancelled(Exception):
    """A sweep stopped between two runs because its caller asked it to; nothing of it was returned.

    Attributes:
        what: the sweep, in words ("attribution", "what-if rerun").
        done: runs finished before it stopped.
        planned: runs it would have made (at most, when `exact` is False: some are skipped as they come).
    """

    def __init__(self, what: str, done: int, planned: int, exact: bool = True) -> None:
        self.what, self.done, self.planned, self.exact = what, done, planned, exact
        super().__init__(f"{what} cancelled after {done:,} of {'' if exact else 'up to '}{planned:,} runs")


def stop_if_asked(should_stop: ShouldStop | None, what: str, done: int, planned: int, exact: bool = True) -> None:
    """Raise `Cancelled` when `should_stop` says so (called between runs, before the next one starts)."""
    if should_stop is not None and should_stop():
        raise Cancelled(what, done, planned, exact)


def check_should_stop(should_stop: object) -> ShouldStop | None:
    """`should_stop` as given, or an InputError naming it when it is neither None nor callable."""
    from engine.errors import InputError

    if should_stop is not None and not callable(should_stop):
        raise InputError(f"should_stop must be a callable returning True to stop (or None), got {should_stop!r:.40}")
    return should_stop  # type: ignore[return-value]
