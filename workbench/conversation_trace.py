"""One trace per conversation, recorded request after request (what `workbench serve` keeps per client chat).

    conv = ConversationTrace(session, "traces/serve/conv-0001", policy="default")
    with conv.turn("chatcmpl-1") as turn:       # listens to the model only inside the block
        session.append_messages(...)
        list(session.generate(32))
        turn["finish_reason"] = "stop"
    ...                                         # other conversations may use the model here
    with conv.turn("chatcmpl-7"):
        ...
    conv.close()                                # status "complete"

Between turns the recorder lets go of the model's probe points (one model serves many
conversations, one request at a time) and the trace stays open with status "recording", so
`workbench dashboard --trace DIR` follows it live across turns. `session.json` lists the turns it
holds under `requests`: `{id, turn, start, end, ...}` (token positions of the turn, and whatever the
caller added to the turn's dict: reused prefix, finish reason, timings).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Collection, Iterator

from engine.session import Session
from workbench.recorders import RecordPolicy, Recorder, record


class ConversationTrace:
    """A trace that stays open across a conversation's requests (see the module docstring)."""

    def __init__(self, session: Session, trace: str | Path, *, policy: "str | RecordPolicy | dict | None" = "default",
                 families: Collection[str] | None = None, info: dict[str, Any] | None = None) -> None:
        self.session = session
        self.path = Path(trace)
        self.requests: list[dict[str, Any]] = []
        self._block = record(session, trace=trace, policy=policy, signals=families)
        self.recorder: Recorder = self._block.__enter__()
        self._open = True
        try:
            if info and self.recorder.writer is not None:
                self.recorder.writer.update_session(**info)
            self.recorder.pause()
        except BaseException:
            self.close("failed")
            raise

    @property
    def open(self) -> bool:
        return self._open

    @contextlib.contextmanager
    def turn(self, request_id: str) -> Iterator[dict[str, Any]]:
        """Record one request of the conversation; yields the dict listed in `session.json` `requests`."""
        if not self._open:
            raise RuntimeError(f"the trace {self.path} is closed")
        entry: dict[str, Any] = {"id": request_id, "turn": len(self.requests) + 1, "start": len(self.session.tokens)}
        self.recorder.resume()
        try:
            yield entry
        finally:
            entry["end"] = len(self.session.tokens)
            self.requests.append(entry)
            try:
                self.recorder.pause()
            finally:
                if self.recorder.writer is not None:
                    self.recorder.writer.update_session(requests=list(self.requests))

    def close(self, status: str = "complete") -> None:
        """Close the trace for good ("complete", or "failed" after an error that ended the conversation)."""
        if not self._open:
            return
        self._open = False
        if status == "complete":
            self._block.__exit__(None, None, None)
        else:
            error = RuntimeError(f"conversation ended: {status}")
            with contextlib.suppress(RuntimeError):
                self._block.__exit__(RuntimeError, error, None)
