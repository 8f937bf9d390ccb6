"""`workbench export TRACE --format parquet|csv|jsonl|npz --out DIR`: a trace as plain files.

Bad input (no trace, not a trace, newer schema, corrupt or missing part, non-empty target without
--overwrite) raises a `TraceError`, which the CLI prints as one line before exiting with status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workbench.trace.errors import TraceError
from workbench.trace.export import FORMATS, export_trace, parse_layers
from workbench.trace.schema import TABLES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trace's tables as Parquet, CSV, JSON Lines or NumPy files")
    p.add_argument("trace", type=Path, help="trace directory (holds session.json)")
    p.add_argument("--format", required=True, choices=sorted(FORMATS), help="output format")
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
    tables = None
    if args.tables:
        tables = [t for item in args.tables for t in item.split(",") if t]
    manifest = export_trace(args.trace, args.out, args.format, layers=args.layers, tables=tables,
                            overwrite=args.overwrite,
                            progress=lambda name, rows: print(f"  {name}: {rows} rows"))
    rows = sum(t["rows"] for t in manifest["tables"].values())
    print(f"exported {len(manifest['tables'])} tables ({rows} rows) of {args.trace} to {args.out} as {args.format}")
    return 0
