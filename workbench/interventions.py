"""Interventions on a running session, from Python or a JSON spec (issue 30).

    with workbench.intervene(session, {"op": "dsa.hide", "segment": "report.txt", "layers": "all"}):
        answer = [t.text for t in session.generate(16, temperature=0)]

The spec is the engine's (`engine.interventions`), plus `"segment": NAME` wherever positions go: the
named segment's token range (for `kda.erase` / `kda.scale`, `at` is its last position). Segment names,
layers, heads and experts that do not exist are an InputError before anything runs. A session being
recorded gets the record of its interventions (`session.intervention_log`: which were active over which
positions) in its trace's session.json under "interventions".
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from engine.errors import InputError
from engine.io.files import parse_json, read_limited
from engine.interventions import Intervention, check_interventions, parse_interventions, to_json

# a spec is a short list of objects: anything larger is not one
MAX_SPEC_BYTES = 1 << 20
_AT_OPS = ("kda.erase", "kda.scale")


def load_intervention_spec(path: str | Path) -> list[Any]:
    """The JSON list in `path` (size checked before it is read); InputError naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InputError(f"{path}: cannot read the intervention spec ({exc.strerror or exc})") from None
    if size > MAX_SPEC_BYTES:
        raise InputError(f"{path}: {size} bytes is too large for an intervention spec (at most {MAX_SPEC_BYTES})")
    spec = parse_json(read_limited(path, "an intervention spec", InputError, MAX_SPEC_BYTES), str(path), InputError)
    if not isinstance(spec, list):
        raise InputError(f"{path}: an intervention spec is a JSON list of objects, got {type(spec).__name__}")
    return spec


def _segment_span(session: Any, name: Any, where: str) -> tuple[int, int]:
    found = [s for s in session.segments if s.name == name]
    if not found:
        names = sorted({s.name for s in session.segments})
        raise InputError(f"{where}: no segment named {name!r}; the session's segments are {names[:20]}")
    if len(found) > 1:
        raise InputError(f"{where}: {len(found)} segments are named {name!r} (ids {[s.id for s in found]}); "
                         "give positions instead")
    seg = found[0]
    if seg.end <= seg.start:
        raise InputError(f"{where}: segment {name!r} holds no tokens yet")
    return seg.start, seg.end


def resolve(session: Any, *interventions: Any) -> tuple[Intervention, ...]:
    """Engine interventions from any mix of: dataclasses, spec objects (dicts, with "segment" allowed),
    lists of them, JSON text, or a path to a JSON spec file. Checked against the session's model."""
    entries: list[Any] = []
    for item in interventions:
        if isinstance(item, Path) or (isinstance(item, str) and not item.lstrip().startswith("[")):
            entries += load_intervention_spec(item)
        elif isinstance(item, str):
            entries += parse_json(item, "intervention spec", InputError)
        elif isinstance(item, (list, tuple)):
            entries += list(item)
        else:
            entries.append(item)
    resolved: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, Mapping) and "segment" in entry:
            where = f"intervention {i} ({entry.get('op')})"
            if "positions" in entry or "at" in entry:
                raise InputError(f"{where}: give \"segment\" or positions, not both")
            start, end = _segment_span(session, entry["segment"], where)
            entry = {k: v for k, v in entry.items() if k != "segment"}
            if entry.get("op") in _AT_OPS:
                entry["at"] = end - 1
            else:
                entry["positions"] = [start, end]
        resolved.append(entry)
    items = parse_interventions(resolved)
    check_interventions(items, session.config)
    return items


def _publish(session: Any) -> None:
    """Write the session's intervention record into the trace of the recording watching it, if any."""
    for observer in session.observers:
        recorder = getattr(observer, "__self__", None)
        writer = getattr(recorder, "writer", None)
        if writer is not None and hasattr(writer, "update_session"):
            writer.update_session(interventions=list(session.intervention_log))


@contextmanager
def intervene(session: Any, *interventions: Any) -> Iterator[tuple[Intervention, ...]]:
    """Run the block with `interventions` active on `session` (see `resolve` for what they may be),
    then restore the ones active before. Everything is checked before anything runs (InputError).

    Yields:
        the resolved engine interventions.
    """
    items = resolve(session, *interventions)
    previous = session.interventions
    session.set_interventions(items)
    _publish(session)
    try:
        yield items
    finally:
        session.set_interventions(previous)
        _publish(session)


def spec_json(items: Sequence[Intervention]) -> list[dict]:
    """The spec objects of engine interventions (what a trace or a report shows)."""
    return [to_json(item) for item in items]
