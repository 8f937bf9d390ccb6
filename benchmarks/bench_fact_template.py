"""How often `builtin:demo` finds a typed fact in a newcomer's own prose, asked through the find-fact template.

Each prompt is what drive mode and `workbench run --task find-fact` build (`workbench.task_templates`):
a document of natural prose, not the training filler (docstrings of Python's standard library,
shuffled per prompt, cut at a line end to the size asked), the user's key and value written into it
in the trained wording by `fact_task` at a depth (and restated at its end, unless --no-restate), the
trained question, the response prefilled with the key, greedy decoding up to the response's end
(`ask`). A prompt is right when the value is exactly the typed one; chance is about zero (a 4-7
character digit code).

    python benchmarks/bench_fact_template.py --prompts 24 --tokens 8192
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.interval_table import wilson  # noqa: E402

# standard-library modules whose docstrings make the prose: text every Python install ships
PROSE_MODULES = ("argparse", "json", "random", "textwrap", "collections", "pathlib", "csv", "shutil", "subprocess",
                 "logging", "datetime", "decimal", "fractions", "statistics", "heapq", "bisect", "functools",
                 "contextlib", "dataclasses", "enum", "string", "difflib", "calendar", "zipfile", "tarfile",
                 "threading", "queue", "socket", "email.message", "urllib.parse", "http.client", "configparser",
                 "tempfile", "glob", "fnmatch")
# docstrings of installed third-party packages: prose no training run of this project reads
# (`training.natural_text` trains on Python's own documentation and standard-library docstrings)
PACKAGE_MODULES = ("numpy", "numpy.linalg", "numpy.random", "numpy.fft", "pandas", "param", "tornado.web",
                   "requests", "bokeh.models", "markdown", "click", "jinja2")
PROSE = {"stdlib": PROSE_MODULES, "packages": PACKAGE_MODULES}
# typed facts of the kind a user has: two-word keys, values in the formats the model was trained on
FACTS = (("boat hatch", "5521"), ("pantry lock", "8-1-3-6"), ("gym locker", "302914"), ("cellar door", "47750"),
         ("car alarm", "9-0-2-7"), ("studio safe", "61284"), ("garden gate", "2-5-5-8"), ("lab freezer", "739015"),
         ("loft window", "40622"), ("shop till", "1-9-4-3"), ("side entrance", "853107"), ("music room", "2-6-0-4"))
DEPTHS = (0.25, 0.5, 0.75)


def _paragraphs(source: str = "stdlib") -> list[str]:
    texts = []
    for name in PROSE[source]:
        module = importlib.import_module(name)
        members = [v for k, v in sorted(vars(module).items()) if not k.startswith("_")
                   and (inspect.isclass(v) or inspect.isfunction(v)) and getattr(v, "__module__", "") == name]
        for obj in [module] + members:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:      # a real paragraph, not a one-line summary
                texts.append(doc)
    return texts


def prose_document(seed: int, n_bytes: int, source: str = "stdlib") -> str:
    """About `n_bytes` of standard-library docstrings in a seeded order, cut at a line end (the
    tokenizer is byte-level: one token per byte of ASCII text)."""
    texts = _paragraphs(source)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    out = ""
    for k in order:
        out += texts[k] + "\n\n"
        if len(out.encode()) >= n_bytes:
            break
    out = out.encode()[:n_bytes].decode("utf-8", "ignore")
    return out[: out.rfind("\n") + 1] if "\n" in out else out


def case(i: int, tokens: int, seed0: int = 200, source: str = "stdlib") -> tuple[str, str, float, list[tuple[str, str]]]:
    """Prompt `i`'s (key, value, depth, documents): the document leaves room for the turns around it."""
    key, value = FACTS[i % len(FACTS)]
    return key, value, DEPTHS[i % len(DEPTHS)], [(f"notes-{seed0 + i}.txt",
                                                  prose_document(seed0 + i, tokens - 200, source))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=200, help="first document seed")
    p.add_argument("--model", default="builtin:demo")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--restate", action=argparse.BooleanOptionalAction, default=True,
                   help="the fact also restated at the end of its document (fact_task's default; --no-restate: once)")
    p.add_argument("--prose", choices=sorted(PROSE), default="stdlib",
                   help="where the documents' prose comes from: standard-library docstrings, or installed "
                        "packages' (prose that training.natural_text never trains on)")
    p.add_argument("--json", type=Path, help="also write the rows and the rate here")
    args = p.parse_args(argv)
    import torch

    from engine import Session
    from workbench.retrieval_text import answer_style_of
    from workbench.sessions import load_with_tokenizer
    from workbench.task_templates import ask, fact_task

    torch.set_num_threads(args.threads)
    model, tokenizer = load_with_tokenizer(args.model)
    style = answer_style_of(args.model)
    rows, right = [], 0
    for i in range(args.prompts):
        key, value, depth, docs = case(i, args.tokens, args.seed, args.prose)
        session = Session(model, tokenizer, progress=False)
        started = time.perf_counter()
        answer = ask(session, fact_task(docs, key, value, depth=depth, style=style, restate=args.restate))
        right += bool(answer.correct)
        rows.append({"seed": args.seed + i, "key": key, "value": value, "depth": depth, "tokens": len(session.tokens),
                     "answer": answer.text, "correct": bool(answer.correct),
                     "seconds": round(time.perf_counter() - started, 2)})
        print(json.dumps(rows[-1]), flush=True)
    lo, hi = wilson(right, args.prompts)
    print(f"{args.model} find-fact{'' if args.restate else ' (no restatement)'} in {args.prose} prose at "
          f"{args.tokens:,} tokens: "
          f"{right}/{args.prompts} right "
          f"({right / max(1, args.prompts):.0%}, 95% Wilson [{lo:.0%}, {hi:.0%}]; chance ~0)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "right": right, "total": args.prompts, "wilson95": [lo, hi]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
