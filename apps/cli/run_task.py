"""`workbench run --task`: ask a model trained on task templates (`builtin:demo`) a question it can answer.

`--task find-fact` puts the user's fact into the prompt file (the user's own document) in the
trained wording and asks the trained question with the key prefilled; `--task picture` asks the
trained question about `--image`. Both decode greedily up to the end of the response
(`workbench.task_templates`, the same templates the dashboard's drive mode builds). A free-form
prompt on such a model gets the card's one-line notice on stderr first, and its answer as generated.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from apps.dashboard.picture_note import picture_note
from engine.errors import InputError
from workbench.retrieval_text import answer_style_of
from workbench.task_templates import PICTURE_ATTRIBUTES, TASKS, ModelCard, TaskAnswer, TaskPrompt, ask, card_of, \
    fact_task, picture_task


def add_task_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=TASKS, default="free-form",
                   help="free-form (default): the prompt as given; find-fact: find the value of --key in the prompt "
                        "file (your document), asked in the model's trained wording; picture: ask --ask about "
                        "--image. Templates decode greedily up to the end of the response")
    p.add_argument("--key", metavar="NAME", help="find-fact: what the fact is about, e.g. \"greenhouse alarm\"")
    p.add_argument("--value", metavar="VALUE", help="find-fact: the fact's value (a code or number, e.g. 3-8-2-5), "
                   "written into the document in the trained wording; without it, the sentence about --key is "
                   "found in the document and rewritten in that wording")
    p.add_argument("--depth", type=float, default=0.5, help="find-fact with --value: where the fact goes in the "
                   "document, 0 (start) to 1 (end), at a sentence end (default 0.5)")
    p.add_argument("--restate", action=argparse.BooleanOptionalAction, default=True,
                   help="find-fact: also restate the fact at the end of its document, as the model's training "
                        "did (default; finds it more often, see docs/cli.md); --no-restate writes it once")
    p.add_argument("--ask", choices=PICTURE_ATTRIBUTES, metavar="ATTRIBUTE",
                   help=f"picture: what to ask about the picture ({', '.join(PICTURE_ATTRIBUTES)})")


def prepare_task(args: argparse.Namespace, prompt: str | None) -> TaskPrompt | None:
    """The templated question `args` ask for (None for a free-form prompt), built before the model
    loads so that bad input costs nothing; every misuse is an InputError naming the flag."""
    if args.task == "free-form":
        for flag in ("key", "value", "ask"):
            if getattr(args, flag) is not None:
                raise InputError(f"--{flag} belongs to a task template: add --task "
                                 f"{'picture' if flag == 'ask' else 'find-fact'}")
        return None
    for flag, given in (("--messages", args.messages), ("--load", args.load), ("--system", args.system),
                        ("--intervene", args.intervene)):
        if given is not None:
            raise InputError(f"--task {args.task} builds its own conversation: drop {flag}")
    if args.chat:
        raise InputError(f"--task {args.task} builds its own conversation: drop --chat")
    if args.task == "picture":
        if args.ask is None:
            raise InputError("--task picture needs --ask (colour, shape, position or digit)")
        if not args.image:
            raise InputError("--task picture needs --image FILE")
        if prompt is not None or args.key is not None or args.value is not None:
            raise InputError("--task picture asks about --image only: drop --prompt/--prompt-file, --key and --value")
        return picture_task(args.ask)
    if args.ask is not None or args.image:
        raise InputError("--task find-fact reads text only: drop --ask and --image")
    if args.key is None:
        raise InputError("--task find-fact needs --key NAME (what the fact is about, e.g. \"greenhouse alarm\")")
    if prompt is None and args.value is None:
        raise InputError("--task find-fact needs --prompt-file DOC (your document) or --value VALUE")
    name = args.prompt_file.name if args.prompt_file is not None else "prompt"
    documents = [(name, prompt)] if prompt is not None else []
    return fact_task(documents, args.key, args.value, depth=args.depth, style=answer_style_of(args.model),
                     restate=args.restate)


def resolve_card_defaults(args: argparse.Namespace) -> ModelCard:
    """Fill `--temperature` and `--max-new-tokens` left unset from the model's card (greedy and 48
    tokens for builtin:demo; 1.0 and 128 where the card says nothing)."""
    card = card_of(args.model)
    if args.temperature is None:
        args.temperature = card.temperature
    if args.max_new_tokens is None:
        args.max_new_tokens = card.max_new_tokens
    return card


def free_form_notice(card: ModelCard) -> str | None:
    """The card's notice and the template hint, for a free-form prompt on a model trained on templates
    (None for models that take any prompt)."""
    if not card.tasks or not card.notice:
        return None
    hint = (f"try: workbench run --model {card.model} --task find-fact --key \"...\" --value \"...\" --prompt-file DOC"
            if "find-fact" in card.tasks else f"try: workbench run --model {card.model} --task {card.tasks[0]}")
    return f"note: {card.notice}\n{hint}"


def print_task_answer(answer: TaskAnswer, task: TaskPrompt, out: TextIO) -> None:
    """The answer on `out` (`greenhouse alarm: 3-8-2-5`); whether it holds the typed value on stderr."""
    out.write(answer.text + "\n")
    out.flush()
    if not answer.closed:
        print(f"note: the response did not end within {answer.generated} tokens", file=sys.stderr)
    if task.expected is not None:
        verdict = "right" if answer.correct else f"wrong (the fact says {task.expected})"
        print(f"answer: {answer.value or '(none)'} - {verdict}", file=sys.stderr)


def picture_notes(paths: list) -> list[str]:
    """The drive panel's note about trained pictures, for each picture of a picture question (its size
    read from the header; a file Pillow cannot read gets the plain note and fails later, as before)."""
    notes = []
    for path in paths:
        try:
            from PIL import Image

            with Image.open(path) as image:
                size = image.size
        except Exception:  # the image is checked, and refused with its own message, when it is appended
            size = None
        notes.append(picture_note(path.name, size))
    return notes


def run_task(session, task: TaskPrompt, args: argparse.Namespace, out: TextIO, notes: bool = True) -> TaskAnswer:
    if notes and task.task == "picture":  # before the answer, as the dashboard shows it beside the question
        for line in picture_notes(list(args.image)):
            print(line, file=sys.stderr, flush=True)
    answer = ask(session, task, max_new_tokens=args.max_new_tokens, images=args.image or None,
                 image_names=[path.name for path in args.image] or None)
    print_task_answer(answer, task, out)
    return answer
