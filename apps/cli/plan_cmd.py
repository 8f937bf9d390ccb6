"""`workbench plan`: will a model fit on N GPUs at a given context and batch? Bytes per GPU.

    workbench plan --preset k3.1-pro --gpus 8 --gpu-mem 288GiB --context 1M --batch 1

Prints weights by dtype, KDA state, MLA and indexer caches, activation and workspace estimates and
a runtime reserve per GPU, then the verdict (fits, or the shortfall and the smallest GPU count that
would fit); exits 1 when it does not fit. The maths lives in `engine.weights.plan`.
"""

from __future__ import annotations

import argparse
import json
import re

from engine.errors import InputError
from engine.weights.plan import format_plan, plan_memory, smallest_fitting
from engine.presets import PRESETS
from engine.weights.load import parse_model_path
from apps.cli.model_cmds import DTYPES

_BYTES = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}
_TOKENS = {"": 1, "K": 2 ** 10, "M": 2 ** 20}


def parse_bytes(text: str) -> int:
    """`288GiB`, `141GB`, `141 GB`, `1.5TiB` -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise InputError(f"cannot read a memory size from {text!r} (e.g. 288GiB or 141GB)")
    return int(float(m.group(1)) * _BYTES[(m.group(2) or "").upper()])


def parse_tokens(text: str) -> int:
    """`1M` = 1,048,576 tokens, `128K` = 131,072, or a plain count."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([KM]?)\s*", text, re.IGNORECASE)
    if m is None:
        raise InputError(f"cannot read a token count from {text!r} (e.g. 1M, 128K, 5000)")
    return int(m.group(1)) * _TOKENS[m.group(2).upper()]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-GPU memory plan: does the model fit on N GPUs?")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (its config.json) or preset:NAME[:VARIANT]")
    src.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--gpus", type=int, required=True, help="GPUs the model is split over (all nodes)")
    p.add_argument("--gpu-mem", required=True, type=parse_bytes, help="memory per GPU, e.g. 288GiB or 141GB")
    p.add_argument("--context", type=parse_tokens, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill step (the session's default)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and caches in memory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    config, _ = parse_model_path(args.model or f"preset:{args.preset}")
    context = args.context or config.max_position_embeddings
    plan = plan_memory(config, gpus=args.gpus, gpu_mem=args.gpu_mem, context=context, batch=args.batch,
                       chunk=args.prefill_chunk, dtype=DTYPES[args.dtype])
    hint = None if plan.fits else smallest_fitting(config, plan)
    if args.json:
        print(json.dumps({**plan.to_json(), "smallest_fitting_gpus": hint}, indent=1))
    else:
        print(format_plan(plan, args.model or f"preset {args.preset}", hint))
    return 0 if plan.fits else 1
