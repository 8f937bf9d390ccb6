"""`workbench questions TRACE`: the six questions of the spec (section 6) answered from one trace, and which
memory the answer depended on where the trace holds measured effects (`effects.parquet`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.errors import InputError
from workbench.questions import MAX_POSITION, QUESTIONS, ask_all, needle_readers
from workbench.trace import open_trace


def _span(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        start, end = (int(v) for v in text.split(":"))
    except ValueError:
        raise InputError(f"a span is START:END (token positions), got {text!r}") from None
    if not 0 <= start < end <= MAX_POSITION:
        raise InputError(f"span {text!r}: need 0 <= START < END <= {MAX_POSITION}")
    return start, end


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("questions", help="answer the inspector questions from a trace (figures beside chance; which memory "
                       "the answer depended on where effects were measured)")
    p.add_argument("trace", type=Path, help="trace directory")
    p.add_argument("--needle", help="needle key positions START:END (default: a demo trace's planted needle, or the fact "
                   "a task template recorded in the trace)")
    p.add_argument("--answer", help="query positions START:END of the answer (default: the last generated segment)")
    p.add_argument("--only", choices=sorted(QUESTIONS), help="answer one question")
    p.set_defaults(func=cmd_questions)


def cmd_questions(args: argparse.Namespace) -> int:
    trace = open_trace(args.trace)
    answers = ask_all(trace) if args.only is None else {args.only: QUESTIONS[args.only](trace)}
    if args.needle or args.answer:
        answer = _span(args.answer)
        answers["needle"] = needle_readers(trace, _span(args.needle), (answer[0], answer[1] - 1) if answer else None)
    for a in answers.values():
        print(a.line)
    return 0
