"""A conformance run's outputs: the verdict table, the Parquet file, the deployment record's line.

The Parquet file holds one row per prompt and describes itself as the trace tables do: each column's
description in its field metadata and again in the file's key-value metadata (`k3wb.column.<name>`),
plus the run's verdict, endpoint, model and date (`k3wb.conformance.*`), so pandas, polars or DuckDB
read it with no project code:

    SELECT kind, verdict, first_divergent_layer, first_divergent_position, max_logprob_diff
    FROM 'conformance.parquet'
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.deployment import ConformanceLine, append_line
from workbench.conformance.check import ConformanceReport

_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("index", pa.int64(), "the prompt's place in the run (0-based)"),
    ("prompt", pa.string(), "the prompt, shortened to 80 characters"),
    ("kind", pa.string(), "single | repeat | follow-up (restores a cached prefix) | concurrent (sent at once)"),
    ("verdict", pa.string(), "conforms | diverges | error (the endpoint refused or failed: not a divergence)"),
    ("prompt_tokens", pa.int64(), "prompt tokens (the endpoint's ids when it returned them)"),
    ("generated", pa.int64(), "generated tokens compared"),
    ("cached_tokens", pa.int64(), "prefix the endpoint reported reusing (null when it does not say)"),
    ("max_logprob_diff", pa.float64(), "largest |log p there - log p here| over the generated tokens, nats"),
    ("first_divergent_position", pa.int64(), "sequence position (prompt + generated, 0-based) of the first "
     "divergent forward; null when none"),
    ("first_divergent_layer", pa.int64(), "first layer whose routes or DSA selections diverged (not inside a tie); "
     "null when none or no captures"),
    ("first_divergent_token", pa.int64(), "first generated token whose log-probability diverged; null when none"),
    ("compared_rows", pa.int64(), "(position, layer) rows of routes and selections compared"),
    ("ties", pa.int64(), "rows that differed only inside the engine's tie band (not divergences)"),
    ("seconds", pa.float64(), "the endpoint's answer and this comparison, wall-clock seconds"),
    ("detail", pa.string(), "what diverged, or the endpoint's error"),
)


def report_table(report: ConformanceReport) -> pa.Table:
    rows: dict[str, list[Any]] = {name: [] for name, _, _ in _COLUMNS}
    for i, r in enumerate(report.prompts):
        values = {"index": i, **{name: getattr(r, name) for name, _, _ in _COLUMNS if name != "index"}}
        for name in rows:
            rows[name].append(values[name])
    notes = {"k3wb.table": "conformance", "k3wb.row": "one prompt sent to an endpoint, compared with this engine",
             "k3wb.conformance.verdict": report.verdict, "k3wb.conformance.endpoint": report.endpoint,
             "k3wb.conformance.model": report.model, "k3wb.conformance.date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                            time.gmtime()),
             "k3wb.conformance.first_divergent_layer": json.dumps(report.first_divergent_layer),
             "k3wb.conformance.first_divergent_position": json.dumps(report.first_divergent_position)}
    notes.update({f"k3wb.column.{name}": doc for name, _, doc in _COLUMNS})
    schema = pa.schema([pa.field(name, kind, nullable=True, metadata={b"description": doc.encode()})
                        for name, kind, doc in _COLUMNS], metadata={k.encode(): v.encode() for k, v in notes.items()})
    return pa.table(rows, schema=schema)


def write_parquet(report: ConformanceReport, path: str | Path) -> Path:
    """The report as a self-describing Parquet file, written to a temporary name and renamed into place."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(report_table(report), temporary)
    os.replace(temporary, path)
    return path


def record_line(report: ConformanceReport, path: str | Path) -> ConformanceLine:
    """Append the run's line to the deployment record at `path` (`engine.deployment.append_line`)."""
    line = ConformanceLine(endpoint=report.endpoint, model=report.model, verdict=report.verdict,
                           max_logprob_diff=report.max_logprob_diff,
                           first_divergent_layer=report.first_divergent_layer,
                           first_divergent_position=report.first_divergent_position, prompts=len(report.prompts),
                           errors=sum(r.verdict == "error" for r in report.prompts))
    append_line(path, line)
    return line


def verdict_table(report: ConformanceReport) -> str:
    """The printed table: one line per prompt, then the verdict in words."""
    head = f"{'#':>3} {'kind':10} {'verdict':8} {'prompt':>6} {'gen':>4} {'cached':>6} {'max|dlogp|':>10} " \
           f"{'layer':>5} {'pos':>6} {'ties':>5} {'s':>6}  detail"
    lines = [head]
    for i, r in enumerate(report.prompts):
        def num(v: Any) -> str:
            return "-" if v is None else str(v)
        diff = "-" if r.max_logprob_diff is None else f"{r.max_logprob_diff:.2e}"
        lines.append(f"{i:>3} {r.kind:10} {r.verdict:8} {r.prompt_tokens:>6} {r.generated:>4} "
                     f"{num(r.cached_tokens):>6} {diff:>10} {num(r.first_divergent_layer):>5} "
                     f"{num(r.first_divergent_position):>6} {r.ties:>5} {r.seconds:>6.2f}  {r.detail}".rstrip())
    if report.verdict == "conforms":
        words = f"the endpoint computes the model on these {len(report.prompts)} prompts"
        ties = sum(r.ties for r in report.prompts)
        if ties:
            words += f" ({ties} capture rows differed only inside a tie)"
    elif report.verdict == "diverges":
        layer = report.first_divergent_layer
        words = (f"the endpoint does not compute the model: first divergence at position "
                 f"{report.first_divergent_position}" + (f", layer {layer}" if layer is not None else
                                                         " (no layer named: the captures agree or were not returned)"))
    else:
        words = "the endpoint failed or refused requests; no verdict on what it computes"
    lines.append(f"verdict: {report.verdict}: {words}")
    return "\n".join(lines)


__all__ = ["record_line", "report_table", "verdict_table", "write_parquet"]
