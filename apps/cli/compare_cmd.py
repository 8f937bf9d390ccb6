"""`workbench compare`: the same input K3.1-style (sparse DSA) and with some DSA layers forced dense (K3),
both recorded, compared layer by layer (`workbench.compare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from apps.cli.model_cmds import DTYPES
from apps.cli.run_cmd import read_prompt
from engine.errors import InputError
from workbench.compare import check_comparison_target, compare_runs, parse_layers
from workbench.sessions import load_with_tokenizer
from workbench.trace import check_trace_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="run one prompt sparse and with some DSA layers dense; compare the traces")
    p.add_argument("--model", required=True, help="checkpoint directory or preset:NAME[:VARIANT]")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 text file")
    p.add_argument("--dense-layers", required=True, help="DSA layers run B reads densely: comma list, or `all`")
    p.add_argument("--trace-a", type=Path, required=True, help="trace of the sparse run (A)")
    p.add_argument("--trace-b", type=Path, required=True, help="trace of the run with the dense layers (B)")
    p.add_argument("--out", type=Path, help="comparison directory (default: TRACE_B's parent / A_vs_B)")
    p.add_argument("--policy", default=None, help="recording policy (default: default, every 16th prefill query kept)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--weights-seed", type=int, default=0, help="weights seed for preset: models")
    p.add_argument("--overwrite", action="store_true", help="replace traces / a comparison written before (files you "
                   "added there are kept; nothing else is ever replaced)")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    if not prompt:
        raise InputError("the prompt is empty")
    if args.prefill_chunk < 1:
        raise InputError("--prefill-chunk must be >= 1")
    if args.trace_a.resolve() == args.trace_b.resolve():
        raise InputError("--trace-a and --trace-b must be different directories")
    out = args.out or args.trace_b.parent / f"{args.trace_a.name}_vs_{args.trace_b.name}"
    for trace in (args.trace_a, args.trace_b):  # every output checked before the model is loaded
        check_trace_target(trace, overwrite=args.overwrite)
    check_comparison_target(out, overwrite=args.overwrite, traces=(args.trace_a, args.trace_b))
    model, tokenizer = load_with_tokenizer(args.model, dtype=DTYPES[args.dtype], seed=args.weights_seed)
    cfg = model.config
    dense = parse_layers(args.dense_layers, [i for i in range(cfg.num_hidden_layers) if cfg.is_dsa_layer(i)])
    result = compare_runs(model, tokenizer, prompt, dense_layers=dense, trace_a=args.trace_a, trace_b=args.trace_b,
                          out=out, policy=args.policy, prefill_chunk=args.prefill_chunk, overwrite=args.overwrite)
    print(result.summary())
    print(f"comparison written to {out} (layers.parquet, kl.parquet, reads.parquet, summary.json)", file=sys.stderr)
    return 0
