"""Per-sequence running: a growing context, its prefill and decode, and everything saved or read with it.

- `session.py`: `Session` (append text, images and messages; prefill; streaming decode; fork).
- `prefill.py`: the session's forward calls and its chunked prefill loop (progress, the logits buffer).
- `state.py` / `snapshot.py`: the model state of a session, and snapshots of it on disk.
- `segments.py`: named position ranges (documents, images, turns); `images.py`: images in a session.
- `sampling.py`: the sampler; `chat_response.py`: the response text inside the chat scaffold.
- `transcript.py`: OpenAI-format messages as tokens and segments; `batch.py`: several sessions at once.
- `intervention_log.py`: the interventions a session has set, and the record kept with it.

`from engine.session import Session` loads only what it names (this package imports nothing eagerly,
so `engine.session.segments` stays importable without torch).
"""

from __future__ import annotations

from engine.lazy import lazy_attributes

_EXPORTS = {
    "Session": "engine.session.session", "GeneratedToken": "engine.session.session",
    "Segment": "engine.session.segments",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())
