"""What a trace's tables carry about the recording that made them (part of the trace format).

A statistic that depends on the DSA top-k, the heat-map bin width, the sink size or which layers are
DSA layers reads them from the table it is given: `Trace.table` puts them in the Arrow schema metadata
(key `k3wb.recorded`, JSON) and `Trace.df` in `DataFrame.attrs["k3wb.recorded"]`
(`workbench.analysis.recorded` turns them into the values statistics use).

- `settings_of_session(session)`: the settings of a trace's session.json (model summary + policy).
- `with_settings(table, settings)` / `settings_of(frame)`: put them on / read them from a table or frame.

This module sits below both the trace store (which writes the key) and the analysis functions (which
read it), so neither imports the other for it.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pyarrow as pa

from engine.errors import InputError
from engine.io.files import parse_json

SETTINGS_KEY = "k3wb.recorded"

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
