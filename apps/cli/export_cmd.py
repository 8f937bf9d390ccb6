"""`workbench export TRACE --format parquet|csv|jsonl|npz --out DIR`: a trace as plain files.

Bad input (no trace, not a trace, newer schema, corrupt or missing part, non-empty target without
--overwrite) raises a `TraceError`, which the CLI prints as one line before exiting with status 2.

`--format vllm|sglang --model M` writes instead `DIR/responses.jsonl`: the trace's routes and
selections as the responses that server would have returned, one per generated answer (what
`workbench import` reads; the trace must hold every route, i.e. be recorded with policy "all").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from workbench.trace.errors import TraceError
from engine.io import atomic_dir
from workbench.captures import ENGINES, export_responses, load_capture_model
from workbench.trace import TraceError, open_trace
from workbench.trace.export import FORMATS, export_trace, parse_layers
from workbench.trace.schema import TABLES

RESPONSES_FILE = "responses.jsonl"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trace's tables as Parquet, CSV, JSON Lines or NumPy files")
    p.add_argument("trace", type=Path, help="trace directory (holds session.json)")
    p.add_argument("--format", required=True, choices=sorted(FORMATS) + list(ENGINES),
                   help="output format (vllm / sglang: the responses that server would return, for `workbench import`)")
    p.add_argument("--model", help="vllm / sglang formats: the model of the trace (checkpoint, config.json or preset:NAME)")
    p.add_argument("--out", required=True, type=Path, help="output directory (must be absent or empty)")
    p.add_argument("--layers", type=_layers, help="layers to keep in signal tables, e.g. 0,3,5-7")
    p.add_argument("--tables", nargs="+", metavar="TABLE",
                   help=f"tables to export (default: all): {', '.join(TABLES)}; commas also separate")
    p.add_argument("--overwrite", action="store_true", help="replace a previous export in --out")
    p.set_defaults(func=cmd_export)


def _layers(text: str) -> list[int]:
    try:
        return parse_layers(text)
    except TraceError as exc:  # argparse shows an ArgumentTypeError's own words (a ValueError only as "invalid")
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_export(args: argparse.Namespace) -> int:
    if args.format in ENGINES:
        return _export_responses(args)
    tables = None
    if args.tables:
        tables = [t for item in args.tables for t in item.split(",") if t]
    manifest = export_trace(args.trace, args.out, args.format, layers=args.layers, tables=tables,
                            overwrite=args.overwrite,
                            progress=lambda name, rows: print(f"  {name}: {rows} rows"))
    rows = sum(t["rows"] for t in manifest["tables"].values())
    print(f"exported {len(manifest['tables'])} tables ({rows} rows) of {args.trace} to {args.out} as {args.format}")
    return 0


def _export_responses(args: argparse.Namespace) -> int:
    if not args.model:
        raise TraceError(f"--format {args.format} needs --model (the layer and expert counts of the trace's model)")
    out = Path(args.out)
    atomic_dir.require_ours(out, args.overwrite, lambda p: {e.name for e in p.iterdir()} == {RESPONSES_FILE},
                            f"a {RESPONSES_FILE} export", TraceError)
    config, _ = load_capture_model(args.model)
    check_trace_model(args.trace, config.summary(), args.model)
    records = export_responses(args.trace, config, args.format)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RESPONSES_FILE}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        os.replace(tmp, out / RESPONSES_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"exported {len(records)} {args.format} response(s) of {args.trace} to {out / RESPONSES_FILE}")
    return 0


# what the exported arrays are sized by: a model that differs in any of them is not the trace's model
SHAPE_FIELDS = ("layers", "layer_kinds", "num_experts", "experts_per_token", "dsa_topk", "vocab_size")


def check_trace_model(trace: Path, summary: dict, model: str) -> None:
    """TraceError naming the first field in which `--model` differs from the model the trace recorded (its
    routes and selections would be laid out in arrays of the wrong shape, or silently cut to fit)."""
    recorded = open_trace(trace).session.get("model")
    if not isinstance(recorded, dict):
        return  # an older trace without its model's summary: the exporter's own checks apply
    for field in SHAPE_FIELDS:
        if field in recorded and recorded[field] != summary.get(field):
            raise TraceError(f"{trace}: recorded with a model whose {field} is {recorded[field]!r:.80}; --model "
                             f"{model} has {summary.get(field)!r:.80} (give the model the trace was recorded with"
                             f"{', ' + repr(recorded['checkpoint']) if isinstance(recorded.get('checkpoint'), str) else ''})")
