"""The recording's own settings, carried by the tables a trace hands out, so statistics never guess them.

A statistic that depends on the DSA top-k, the heat-map bin width, the sink size or which layers are
DSA layers reads them from the table it is given: `Trace.table` puts them in the Arrow schema metadata
(key `k3wb.recorded`, JSON) and `Trace.df` in `DataFrame.attrs["k3wb.recorded"]`. A caller may still
pass a value explicitly (a table built by hand carries none); one that disagrees with the recording
is an error, since a wrong top-k silently moves every chance value (`recorded_setting`).

- `settings_of_session(session)`: the settings of a trace's session.json (model summary + policy).
- `with_settings(table, settings)` / `settings_of(frame)`: put them on / read them from a table or frame.
- `recorded_setting(frame, name, given, what)`: the value a statistic uses.
- `check_dsa_layers(frame, layers, what)`: explicit layer ids that are DSA layers of the recording.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pyarrow as pa

from engine.errors import InputError
from engine.io.files import parse_json

SETTINGS_KEY = "k3wb.recorded"

# what each setting is, for error messages
_MEANING = {"topk": "the DSA top-k", "dsa_bin_tokens": "the dsa_key_counts bin width (policy.dsa_bin_tokens)",
            "sink_tokens": "the sink size (policy.sink_tokens)", "dsa_layers": "the DSA layer ids",
            "num_experts": "the number of routed experts"}


def settings_of_session(session: dict) -> dict[str, Any]:
    """topk, dsa_bin_tokens, sink_tokens, dsa_layers, num_experts of a session.json (absent ones omitted).

    Reads the model summary `workbench.record` writes (`dsa_topk`, `layer_kinds`) and the one of synthetic
    traces (`summary.topk`, `summary.dsa_layers`)."""
    model = session.get("model") if isinstance(session.get("model"), dict) else {}
    summary = model.get("summary") if isinstance(model.get("summary"), dict) else {}
    policy = session.get("policy") if isinstance(session.get("policy"), dict) else {}
    out: dict[str, Any] = {}
    topk = model.get("dsa_topk", summary.get("topk"))
    if _is_int(topk) and topk > 0:
        out["topk"] = int(topk)
    kinds = model.get("layer_kinds")
    layers = [i for i, k in enumerate(kinds) if k == "dsa"] if isinstance(kinds, list) else summary.get("dsa_layers")
    if isinstance(layers, list) and all(_is_int(l) for l in layers):
        out["dsa_layers"] = [int(l) for l in layers]
    for name in ("dsa_bin_tokens", "sink_tokens"):
        value = policy.get(name, {"dsa_bin_tokens": 256, "sink_tokens": 4}[name])
        if _is_int(value) and value > 0:
            out[name] = int(value)
    experts = model.get("num_experts", summary.get("num_experts"))
    if _is_int(experts) and experts > 0:
        out["num_experts"] = int(experts)
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def with_settings(table: pa.Table, settings: dict[str, Any]) -> pa.Table:
    """`table` with the recording's settings in its schema metadata (its other metadata kept)."""
    meta = dict(table.schema.metadata or {})
    meta[SETTINGS_KEY.encode()] = json.dumps(settings, sort_keys=True).encode()
    return table.replace_schema_metadata(meta)


def settings_of(frame: Any) -> dict[str, Any]:
    """The settings a table or frame from a trace carries ({} for one built by hand)."""
    if isinstance(frame, pa.Table):
        raw = (frame.schema.metadata or {}).get(SETTINGS_KEY.encode())
        try:
            value = parse_json(raw, "the recording settings in a table's metadata", InputError) if raw else {}
        except InputError:
            return {}
        return value if isinstance(value, dict) else {}
    if isinstance(frame, pd.DataFrame):
        value = frame.attrs.get(SETTINGS_KEY)
        return value if isinstance(value, dict) else {}
    return {}


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
