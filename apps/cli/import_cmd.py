"""`workbench import vllm|sglang RESPONSES --model CHECKPOINT_OR_CONFIG --out TRACE`: a served conversation as a trace.

RESPONSES is a JSON file (one response or a list) or JSON Lines, saved from a vLLM or SGLang server
launched with `--enable-return-routed-experts` (SGLang also `--enable-return-indexer-topk`), one
conversation per file, in order. Bad input (a shape or layer count the config does not allow, token
ids outside the vocabulary, truncated base64, a dtype too narrow for the ids) raises an `InputError`,
which the CLI prints as one line before exiting with status 2; no trace is left behind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workbench.captures import ENGINES, import_capture


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="write a trace from saved vLLM / SGLang responses (routed experts, indexer "
                                      "top-k)")
    p.add_argument("engine", choices=ENGINES, help="which server saved the responses")
    p.add_argument("responses", type=Path, help="JSON or JSON Lines file of saved responses (one conversation)")
    p.add_argument("--model", required=True, help="the model the server ran: checkpoint directory, config.json, "
                                                  "builtin:NAME or preset:NAME (layer and expert counts, tokenizer)")
    p.add_argument("--out", required=True, type=Path, help="trace directory to write (absent or empty)")
    p.add_argument("--policy", default="default", help="which raw rows to keep: default, all, or a policy JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace a trace an earlier `workbench import` wrote")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    capture = import_capture(args.engine, args.responses, args.model, args.out, policy=args.policy,
                             overwrite=args.overwrite)
    maps = ", ".join(f"{family}: {m['axis']} -> layers {m['layers']}" for family, m in capture["layer_map"].items())
    print(f"imported {capture['records']} {args.engine} response(s) from {args.responses} into {args.out} ({maps})")
    for what, why in capture["absent"].items():
        print(f"  absent: {what}: {why}")
    return 0
