"""`workbench attribute`: which spans of a document the answer came from (`workbench.attribute`).

    workbench attribute --model builtin:demo --prompt-file DOC --task find-fact --key K --value V --json OUT.json
    workbench attribute --model MODEL --prompt-file DOC --question Q --target T [--spans paragraphs] [--kda]

Prints the answer, the surrogate's LDS on held-out masks and the top spans with their effects, controls
and verdicts; `--json` writes the whole result (docs/attribution.md gives the schema): token positions
end exclusive as the trace numbers them, the spans ordered by effect, largest drop first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.errors import InputError
from engine.io.inputs import read_prompt_file

SPAN_CHOICES = ("sentences", "paragraphs", "segments")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attribute", help="which spans of the context the answer came from (random ablation masks "
                       "inside the model, a sparse surrogate with its held-out LDS, the top spans checked beside "
                       "same-size controls)")
    p.add_argument("--model", required=True, help="checkpoint directory or builtin:NAME")
    p.add_argument("--prompt-file", type=Path, required=True, metavar="DOC", help="the document (the context)")
    p.add_argument("--task", choices=("find-fact",), help="find-fact: ask for the value of --key in the trained "
                   "wording and score the expected value where the model writes it")
    p.add_argument("--key", metavar="NAME", help="find-fact: what the fact is about")
    p.add_argument("--value", metavar="VALUE", help="find-fact: the fact's value, written into the document in the "
                   "trained wording (without it, the sentence about --key is found in the document)")
    p.add_argument("--depth", type=float, default=0.5, help="find-fact with --value: where the fact goes (0..1)")
    p.add_argument("--restate", action=argparse.BooleanOptionalAction, default=True,
                   help="find-fact: also restate the fact at the end of its document, as the model's training did "
                        "(default); two copies share the answer, so hiding either alone moves it less")
    p.add_argument("--question", metavar="Q", help="free-form: the question asked after the document")
    p.add_argument("--target", metavar="T", help="free-form: the answer whose log-probability is measured")
    p.add_argument("--spans", choices=SPAN_CHOICES, default="sentences", help="how the context is cut (default: "
                   "sentences; image segments are always groups of patch rows)")
    p.add_argument("--kda", action="store_true", help="also suppress KDA writes over hidden spans (each mask re-runs "
                   "the context from its earliest hidden span: much slower)")
    p.add_argument("--masks", type=int, default=64, help="random ablation masks (64)")
    p.add_argument("--holdout", type=int, default=16, help="further masks (16): all are fitted, and each is "
                   "held out once for the LDS (5 folds)")
    p.add_argument("--top", type=int, default=8, help="spans checked exactly one by one (8)")
    p.add_argument("--controls", type=int, default=8, help="disjoint same-size random spans per checked span (8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the masks and controls (deterministic)")
    p.add_argument("--show", type=int, default=8, help="spans printed (8)")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write the result here")
    p.set_defaults(func=cmd_attribute)


def _question(args: argparse.Namespace) -> None:
    """Every misuse of the flags, before the model loads."""
    if args.task == "find-fact":
        if args.key is None:
            raise InputError("--task find-fact needs --key NAME (what the fact is about)")
        for flag in ("question", "target"):
            if getattr(args, flag) is not None:
                raise InputError(f"--task find-fact asks its own question and scores its expected value: drop --{flag}")
    else:
        for flag in ("key", "value"):
            if getattr(args, flag) is not None:
                raise InputError(f"--{flag} belongs to --task find-fact")
        if args.question is None or args.target is None:
            raise InputError("give --task find-fact --key K [--value V], or --question Q and --target T "
                             "(the answer whose log-probability is measured)")
        if not args.target.strip():
            raise InputError("--target is empty: give the answer whose log-probability is measured")
    if args.json is not None and args.json.is_dir():
        raise InputError(f"--json {args.json}: is a directory; give a file path")


def cmd_attribute(args: argparse.Namespace) -> int:
    _question(args)
    text = read_prompt_file(args.prompt_file)
    if not text.strip():
        raise InputError(f"--prompt-file {args.prompt_file}: the document is empty (nothing to attribute to)")
    import workbench
    from workbench.retrieval_text import answer_style_of
    from workbench.sessions import load_with_tokenizer, open_session
    from workbench.task_templates import append_task, fact_task

    model, tokenizer = load_with_tokenizer(args.model)
    session = open_session(model, tokenizer, model_name=args.model, progress=False)
    if args.task == "find-fact":
        task = fact_task([(args.prompt_file.name, text)], args.key, args.value, depth=args.depth,
                         style=answer_style_of(args.model), restate=args.restate)
        append_task(session, task, question=False)
        continuation, target = task, None
    else:
        session.append(text, name=args.prompt_file.name)
        continuation, target = args.question, args.target
    result = workbench.attribute(session, continuation=continuation, target=target, spans=args.spans, kda=args.kda,
                                 masks=args.masks, holdout=args.holdout, top=args.top, controls=args.controls,
                                 seed=args.seed)
    print(result.summary(args.show))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=1, ensure_ascii=False))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
