"""Interventions on a running session, from Python or a JSON spec.

    with workbench.intervene(session, {"op": "dsa.hide", "segment": "report.txt", "layers": "all"}):
        answer = [t.text for t in session.generate(16, temperature=0)]

The spec is the engine's (`engine.interventions`), plus `"segment": NAME` wherever positions go: the
named segment's token range (for `kda.erase` / `kda.scale`, `at` is its last position). Segment names,
layers, heads and experts that do not exist are an InputError before anything runs. A session being
recorded gets the record of its interventions (`session.intervention_log`: which were active over which
positions) in its trace's session.json under "interventions".
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from engine.errors import InputError
from engine.session.sampling import SamplingParams
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
        if isinstance(item, Path) or (isinstance(item, str) and not item.lstrip().startswith(("[", "{"))):
            entries += load_intervention_spec(item)
        elif isinstance(item, str):  # JSON text: a list of spec objects, or one
            parsed = parse_json(item, "intervention spec", InputError)
            entries += parsed if isinstance(parsed, list) else [parsed]
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


@contextmanager
def intervene(session: Any, *interventions: Any) -> Iterator[tuple[Intervention, ...]]:
    """Run the block with `interventions` active on `session` (see `resolve` for what they may be),
    then restore the ones active before. Everything is checked before anything runs (InputError).

    Yields:
        the resolved engine interventions.
    """
    items = resolve(session, *interventions)
    previous = session.interventions
    session.set_interventions(items)  # a recording watching the session writes the log (its own event)
    try:
        yield items
    finally:
        session.set_interventions(previous)


def spec_json(items: Sequence[Intervention]) -> list[dict]:
    """The spec objects of engine interventions (what a trace or a report shows)."""
    return [to_json(item) for item in items]


# ---- the arguments of the experiments built on interventions (`effects`, `attribution`) ----------------
# Checked at their entry, before anything is prefilled or forked: each bad value is one InputError line
# naming the argument, never an IndexError from a tensor or a ValueError from numpy.
MAX_SEED = (1 << 63) - 1
MAX_CONTROLS = 1000  # each control is a scored continuation: more is hours, not precision


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_token_ids(session: Any, ids: Any, what: str) -> list[int]:
    """`ids` as a list of the model's token ids (ints in [0, vocab)); InputError naming `what` otherwise."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # a numpy array or a tensor of ids
        ids = ids.tolist()
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence):
        raise InputError(f"{what} must be text or a list of token ids, got {type(ids).__name__}")
    vocab = session.config.vocab_size
    limit = session.config.max_position_embeddings
    if len(ids) > limit:
        raise InputError(f"{what} holds {len(ids)} tokens; the model's context limit is {limit}")
    bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab]
    if bad:
        raise InputError(f"{what}: token ids must be integers in [0, {vocab}); got {_shown(bad[:5])}")
    return [int(t) for t in ids]


def check_seed(seed: Any, what: str = "seed") -> int:
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise InputError(f"{what} must be an integer in [0, 2**63), got {_shown(seed)}")
    return int(seed)


def check_positions(span: object, what: str, *, limit: int, inclusive: bool = False, bound: str = "") -> tuple[int, int]:
    """`span` as (start, end) token positions, 0 <= start < end <= `limit` (start <= end when `inclusive`);
    else InputError naming `what` and the limit (`bound`: what it is, e.g. "the context"). A span may come
    from a command line, a session.json or a caller's list: two integers (not bools, not text) or nothing."""
    pair = tuple(span) if isinstance(span, (tuple, list)) else ()
    if (len(pair) != 2 or not all(_is_int(v) for v in pair) or not 0 <= pair[0] <= pair[1] <= limit
            or (pair[0] == pair[1] and not inclusive)):
        order = "START <= END" if inclusive else "START < END"
        named = f" ({bound})" if bound else ""
        raise InputError(f"{what} must be two token positions with 0 <= {order} <= {limit}{named}, got {span!r:.60}")
    return int(pair[0]), int(pair[1])


def check_continuation(session: Any, continuation: Any, role: Any = "user") -> None:
    """A continuation is None, text (a `role` turn: the model needs a tokenizer), a `TaskPrompt`, a function
    of the branch, or token ids."""
    if not isinstance(role, str):
        raise InputError(f"role must be a chat role name (text), got {_shown(role)}")
    if isinstance(continuation, str) or hasattr(continuation, "question"):  # text or a TaskPrompt
        if session.tokenizer is None:
            raise InputError("a text continuation needs a model with tokenizer files; give token ids instead")
        if isinstance(continuation, str):
            session.tokenizer.message_frame(role)  # an unknown role is refused here, before anything runs
        return
    if continuation is None or callable(continuation):
        return
    check_token_ids(session, continuation, "continuation")


def check_effects_args(session: Any, *, continuation: Any, record_to: Any, max_new_tokens: Any, temperature: Any,
                       seed: Any, role: Any = "user") -> None:
    """`workbench.effects`' arguments beyond the interventions: the sampling ones by the sampler's own rules,
    checked here before the context is prefilled rather than at the first sampled token."""
    SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    check_continuation(session, continuation, role)
    if record_to is not None and (isinstance(record_to, (str, bytes, Path)) or not isinstance(record_to, Sequence)
                                  or len(record_to) != 2
                                  or not all(isinstance(p, (str, Path)) and str(p) for p in record_to)):
        raise InputError(f"record_to must be a pair of trace paths (plain, intervened), got {_shown(record_to)}")


def check_span_items(session: Any, segments: Any) -> None:
    """`attribution`'s segments: a list of segment names or (label, start, end) spans of positions."""
    if isinstance(segments, (str, bytes, Mapping)) or not isinstance(segments, Sequence):
        raise InputError(f"segments must be a list of segment names or (label, start, end) spans, got "
                         f"{_shown(segments)}")
    length = len(session.tokens)
    for item in segments:
        if isinstance(item, str):
            continue
        if (isinstance(item, (str, bytes, Mapping)) or not isinstance(item, Sequence) or len(item) != 3
                or not isinstance(item[0], (str, int)) or isinstance(item[0], bool)
                or not all(_is_int(v) for v in item[1:])):
            raise InputError(f"segments: each is a segment name or a (label, start, end) span of integer positions, "
                             f"got {_shown(item)}")
        if not 0 <= item[1] < item[2] <= length:
            raise InputError(f"span {item[0]!r}: [{item[1]}, {item[2]}) is not inside the context's {length} tokens")


def check_attribution_args(session: Any, segments: Any, *, continuation: Any, target: Any, controls: Any,
                           seed: Any, experts: Any, evidence: Any, flags: Mapping[str, Any], role: Any = "user") -> None:
    """`workbench.attribution`'s arguments (the checks its own body does not make)."""
    check_span_items(session, segments)
    check_continuation(session, continuation, role)
    if target is None:
        raise InputError("attribution needs a target: the answer (text or token ids) whose log-probability is measured")
    if not _is_int(controls) or not 1 <= controls <= MAX_CONTROLS:
        raise InputError(f"controls must be an integer in [1, {MAX_CONTROLS}], got {_shown(controls)}")
    check_seed(seed)
    config = session.config
    most = config.num_experts - config.num_experts_per_token
    if experts is not None and (not _is_int(experts) or not 1 <= experts <= most):
        raise InputError(f"experts must be None or an integer in [1, {most}] (a token must keep "
                         f"{config.num_experts_per_token} of the {config.num_experts} experts), got {_shown(experts)}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InputError(f"{name} must be True or False, got {_shown(value)}")
    if isinstance(evidence, (str, bytes, Mapping)) or not isinstance(evidence, Sequence):
        raise InputError(f"evidence must be a list of (start, end) spans, got {_shown(evidence)}")
    for span in evidence:
        if (isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2
                or not all(_is_int(v) and 0 <= v <= MAX_SEED for v in span) or not span[0] < span[1]):
            raise InputError(f"evidence: each span is (start, end) with 0 <= start < end, got {_shown(span)}")
