"""`workbench conformance`: does a deployment (vLLM, SGLang, `workbench serve`) compute the model?

    workbench conformance --endpoint http://HOST:PORT/v1 --model CHECKPOINT [--prompts FILE | --suite long-context]
                          [--json OUT.json] [--parquet OUT.parquet] [--record deployment-record.jsonl]

Prints the verdict table (one line per prompt) and the verdict in words; writes OUT.json, the
self-describing Parquet file and a line in the deployment record when asked (the record defaults to
`deployment-record.jsonl` beside OUT.json); exits 0 when the endpoint conforms, 1 when it diverges or
failed (`workbench.conformance` and docs/conformance.md document the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from apps.cli.model_cmds import DTYPES
from engine.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conformance", help="check that an OpenAI-compatible deployment computes the model "
                                          "(per-token log-probabilities against this engine)")
    p.add_argument("--endpoint", required=True, help="the deployment's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the checkpoint it serves: directory, builtin:NAME or preset:NAME")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", type=Path, help="JSON list of prompts: strings or OpenAI message lists")
    src.add_argument("--suite", choices=["long-context"], help="built-in prompts that trigger known failure classes")
    p.add_argument("--served-model-name", help="the `model` field the endpoint expects (default: --model)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens asked per prompt (default 16)")
    p.add_argument("--tolerance", type=float, default=None, help="nats two log-probabilities may differ by "
                   "(default 0.1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", type=Path, dest="json_out", help="write the report here")
    p.add_argument("--parquet", type=Path, help="write the per-prompt table here (default: OUT.json's name with "
                   ".parquet, when --json is given)")
    p.add_argument("--record", type=Path, help="append the run's line to this deployment record (JSON Lines; "
                   "default: deployment-record.jsonl beside OUT.json, when --json is given)")
    p.add_argument("--no-captures", action="store_true", help="do not ask for routed experts / indexer top-k "
                   "(for a server that refuses those fields): no layer is named")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="this engine's compute dtype")
    p.set_defaults(func=cmd_conformance)


def cmd_conformance(args: argparse.Namespace) -> int:
    from engine.deployment import DEPLOYMENT_LOG
    from workbench.conformance import (DEFAULT_TOLERANCE, conformance, long_context_suite, read_prompts, record_line,
                                       verdict_table, write_parquet)
    from workbench.sessions import load_with_tokenizer
    from workbench.task_templates import card_of

    if not 1 <= args.max_tokens <= 4096:
        raise InputError(f"--max-tokens must be in [1, 4096], got {args.max_tokens}")
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    model, tokenizer = load_with_tokenizer(args.model, dtype=DTYPES[args.dtype])
    if prompts is None:
        prompts = long_context_suite(tokenizer) if args.suite else ["What is the capital of France?"]
    report = conformance(args.endpoint, model, tokenizer, prompts, model_id=args.served_model_name or str(args.model),
                         max_tokens=args.max_tokens, timeout=args.timeout, api_key=os.environ.get("K3WB_API_KEY"),
                         tolerance=DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance,
                         open_response=bool(card_of(args.model).tasks), captures=not args.no_captures)
    print(verdict_table(report))
    parquet, record = args.parquet, args.record
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report.to_json(), indent=1))
        print(f"report written to {args.json_out}", file=sys.stderr)
        parquet = parquet or args.json_out.with_suffix(".parquet")
        record = record or args.json_out.parent / DEPLOYMENT_LOG
    if parquet is not None:
        write_parquet(report, parquet)
        print(f"table written to {parquet}", file=sys.stderr)
    if record is not None:
        record_line(report, record)
        print(f"deployment record: a line added to {record}", file=sys.stderr)
    return 0 if report.verdict == "conforms" else 1
