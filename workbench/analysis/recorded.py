"""The recording's own settings as statistics use them, so they never guess them.

A table from `Trace.table` / `Trace.df` carries the recording's settings (the trace format's
`workbench.recorded_settings`). A caller may still pass a value explicitly (a table built by hand
carries none); one that disagrees with the recording is an error, since a wrong top-k silently moves
every chance value (`recorded_setting`).

- `recorded_setting(frame, name, given, what)`: the value a statistic uses.
- `check_dsa_layers(frame, layers, what)`: explicit layer ids that are DSA layers of the recording.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InputError
from workbench.recorded_settings import settings_of

# what each setting is, for error messages
_MEANING = {"topk": "the DSA top-k", "dsa_bin_tokens": "the dsa_key_counts bin width (policy.dsa_bin_tokens)",
            "sink_tokens": "the sink size (policy.sink_tokens)", "dsa_layers": "the DSA layer ids",
            "num_experts": "the number of routed experts"}


def recorded_setting(frame: Any, name: str, given: Any, what: str, param: str | None = None) -> Any:
    """The value of setting `name` for a statistic `what` computed on `frame`.

    The recorded one when `frame` carries it (an explicit `given`, the caller's argument `param`, must then
    equal it); else `given`; InputError when they disagree or when neither is there."""
    name_given = param or name
    recorded = settings_of(frame).get(name)
    if recorded is not None and given is not None and _normal(given) != _normal(recorded):
        raise InputError(f"{what}: {name_given}={given!r} disagrees with the trace, which recorded "
                         f"{_MEANING[name]} = {recorded!r}; leave {name_given} out to use the recorded value")
    value = recorded if recorded is not None else given
    if value is None:
        raise InputError(f"{what}: {_MEANING[name]} is unknown: pass {name_given}=..., or a table from "
                         "trace.table(...) / trace.df(...), which carries it")
    return value


def _normal(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return int(value)


def check_dsa_layers(frame: Any, layers: Any, what: str) -> None:
    """InputError when `layers` (explicit ids) names a layer the recording does not call a DSA layer (a
    row index or a KDA layer id passed by mistake would otherwise count nothing, silently)."""
    recorded = settings_of(frame).get("dsa_layers")
    if layers is None or recorded is None:
        return
    foreign = sorted(set(int(l) for l in layers) - set(recorded))
    if foreign:
        raise InputError(f"{what}: layers {foreign} are not DSA layers of this trace (its DSA layers are "
                         f"{recorded}); leave layers out to use them all")

