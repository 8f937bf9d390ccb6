"""Task templates: questions a small trained model answers, built from a newcomer's own text.

A model trained only on generated tasks (`builtin:demo`: find a fact in documents, say what a
64 x 64 picture shows) answers in its trained format and nonsense outside it. A template puts the
user's input into that format: the fact is written in the trained wording inside the user's own
documents, the question is the trained question, the response is prefilled with the restated key
(`key: `) and decoded greedily up to the response's `<|close|>`, as `workbench demo` does.

What a checkpoint says about prompting it (`card_of`) lives in two small files beside its weights:
`generation_config.json` (Hugging Face's convention: `do_sample`, `temperature`, `max_new_tokens`)
and `prompting.json` (`tasks`: the templates it was trained on; `notice`: one line on what it can
and cannot answer). A checkpoint without them takes any prompt at temperature 1.

The CLI (`workbench run --task`) and the dashboard's drive mode both build their prompts here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engine.errors import InputError
# the checkpoint's prompting card is read by the engine, beside the model reference it belongs to
from engine.model_card import CARD_TASKS, ModelCard, card_files, card_of
from workbench.retrieval_text import TRAIN, answer_prefix, answer_style_of, response_value

TASKS = CARD_TASKS  # what a prompting card may name (`engine.model_card`)
PICTURE_ATTRIBUTES = ("colour", "shape", "position", "digit")

# The trained picture questions per picture kind (`workbench.shape_pictures`), and the system lines
# of picture conversations. `training.image_tasks` samples from these very tuples: their order is
# part of the training data stream, so append, never reorder.
PICTURE_QUESTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "shape": {
        "colour": ("What colour is the shape?", "Which colour is the shape in the image?",
                   "What colour is the shape in the picture?"),
        "shape": ("What shape is drawn?", "Which shape is in the picture?", "What shape do you see in the image?"),
        "position": ("Where is the shape?", "Where in the image is the shape?",
                     "In which part of the picture is the shape?"),
    },
    "digit": {
        "digit": ("Which digit is drawn?", "What digit is shown in the image?", "Which number is in the picture?"),
        "colour": ("What colour is the digit?", "Which colour is the digit drawn in?"),
    },
}
PICTURE_SYSTEMS = ("You are a helpful assistant.", "You answer questions about pictures briefly.",
                   "Look at the image and answer in a few words.")

# the fact template and its question: the pair `workbench demo` plants and asks (TRAIN's needle 4)
FACT_TEMPLATE = 4
MAX_FIELD_CHARS = 80
# ---------------------------------------------------------------------------------------------------
# finding a fact in the user's own text

@dataclass(frozen=True)
class FoundFact:
    """A fact sentence found in the user's own text."""

    document: int             # index into documents
    start: int                # character span of the sentence in that document
    end: int
    key: str                  # e.g. "greenhouse alarm" (editable by the user)
    value: str                # e.g. "3-8-2-5"
    sentence: str


# a sentence: up to a terminal mark followed by white space (or the text's end); dashes and dots
# inside values ("3-8-2-5", "v1.2") stay inside since they are not followed by a space
_SENTENCE = re.compile(r"(?:[^\n.!?]|[.!?](?!\s|$))*(?:[.!?]+(?=\s|$)|\n|$)")
_LINK = re.compile(r"\s*(?:\b(?:is|was|reads|read|are|were)\b|:|=)\s*(?:(?:now|still|set to|equal to)\s+)?")
_VALUE = re.compile(r"\d(?:[\d]|[- ](?=\d))*")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9'-]*")
_PREPOSITIONS = {"for", "of", "to", "in", "at", "on", "from", "behind", "inside", "into", "near", "by", "with"}
_DROP = {"the", "a", "an", "this", "that", "these", "those", "my", "our", "your", "his", "her", "its", "their",
         "new", "current", "and", "or", "remember", "note", "please", "so", "then", "now", "also"}
# nouns that only say "a value": the trained wording already says "the code that opens the {k}"
_CARRIERS = {"code", "codes", "number", "password", "passcode", "passcodes", "pin", "combination", "value", "id",
             "key", "digits", "passphrase", "num", "no"}
_MAX_KEY_WORDS = 4
_PHRASE_CHARS = 160


def key_of(phrase: str) -> str:
    """The key of a noun phrase, by one rule: split it at its prepositions and read the parts from the
    last to the first (English compounds put the owner first: "alarm code for the greenhouse" ->
    "greenhouse alarm code"), keep the content words (articles, determiners and prepositions
    dropped), then drop the carrier nouns that only say "a value" (code, number, password, ...)
    unless nothing else is left; at most the last four words, lower case."""
    words = [w.lower() for w in _WORD.findall(phrase)]
    parts: list[list[str]] = [[]]
    for w in words:
        if w in _PREPOSITIONS:
            parts.append([])
        elif w not in _DROP:
            parts[-1].append(w)
    ordered = [w for part in reversed(parts) for w in part]
    content = [w for w in ordered if w not in _CARRIERS] or ordered
    return " ".join(content[-_MAX_KEY_WORDS:])


def find_facts(documents: Sequence[tuple[str, str]], limit: int = 20) -> list[FoundFact]:
    """Sentences of `documents` ((name, text) pairs) that link a short noun phrase ("is", "was",
    "reads", ":", "=") to a value of at least three digits (digits with optional single dashes or
    spaces between them), in document order, at most `limit`. The key is `key_of(phrase)`; the
    phrase is the last clause before the link (after a comma), at most eight words."""
    found: list[FoundFact] = []
    for d, (_, text) in enumerate(documents):
        for m in _SENTENCE.finditer(text):
            sentence = m.group(0)
            if not sentence.strip():
                continue
            fact = _fact_in(sentence)
            if fact is None:
                continue
            key, value = fact
            lead = len(sentence) - len(sentence.lstrip())
            body = sentence.strip()
            found.append(FoundFact(d, m.start() + lead, m.start() + lead + len(body), key, value, body))
            if len(found) >= limit:
                return found
    return found


def _fact_in(sentence: str) -> tuple[str, str] | None:
    for link in _LINK.finditer(sentence):
        value = _VALUE.match(sentence, link.end())
        if value is None or sum(c.isdigit() for c in value.group(0)) < 3:
            continue
        after = sentence[value.end():value.end() + 1]
        if after and (after.isalpha() or after.isdigit()):
            continue      # "is 300km", "is 1234abc": not a code
        # a bounded look back: a phrase is a few words, and a long text without sentence ends must not
        # cost a scan of everything before each link
        clause = re.split(r"[,;(]", sentence[max(0, link.start() - _PHRASE_CHARS): link.start()])[-1]
        phrase_words = _WORD.findall(clause)[-8:]
        key = key_of(" ".join(phrase_words))
        if key:
            return key, value.group(0).strip()
    return None


# ---------------------------------------------------------------------------------------------------
# templated prompts

@dataclass(frozen=True)
class TaskPrompt:
    """Everything a session needs to ask one templated question."""

    task: str                               # "find-fact" | "picture"
    system: str                             # the trained system line
    documents: list[tuple[str, str]]        # the user's documents, the fact in the trained wording
    question: str                           # the trained question wording
    prefix: str                             # the response's prefilled start ("greenhouse alarm: ")
    expected: str | None                    # the value the answer should hold (None when unknown)
    fact: tuple[int, int, int] | None       # (document, char start, char end) of the fact as sent
    style: str = "key"                      # the answer style (`workbench.retrieval_text.answer_parts`)
    restated: tuple[int, int, int] | None = None   # (document, char start, char end) of the fact's restatement


def _check_field(text: str | None, what: str) -> str:
    if not isinstance(text, str):
        raise InputError(f"the fact's {what} must be text, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise InputError(f"the fact's {what} is empty")
    if "\n" in text or "\r" in text:
        raise InputError(f"the fact's {what} must be one line: {text[:40]!r}")
    if len(text) > MAX_FIELD_CHARS:
        raise InputError(f"the fact's {what} is {len(text)} characters; at most {MAX_FIELD_CHARS} "
                         f"(a short name such as 'greenhouse alarm')")
    if "<|" in text:
        raise InputError(f"the fact's {what} holds a chat control token: {text[:40]!r}")
    return text


def _check_value(value: str | None) -> str:
    value = _check_field(value, "value")
    if not any(c.isdigit() for c in value):
        raise InputError(f"the fact's value {value!r} holds no digit: the model was trained to find codes and "
                         "numbers (such as 3-8-2-5)")
    return value


def fact_sentence(key: str, value: str) -> str:
    """The fact in the trained wording (`workbench demo`'s needle template): 'The code that opens the
    {key} is {value}. '."""
    return TRAIN.needles[FACT_TEMPLATE].format(k=key, v=value)


def fact_question(key: str) -> str:
    """The trained question about the fact of `key`."""
    return TRAIN.needle_questions[FACT_TEMPLATE].format(k=key)


def _matches(fact: FoundFact, key: str) -> bool:
    words = set(key_of(key).split()) or set(key.lower().split())
    text = set(fact.key.split()) | {w.lower() for w in _WORD.findall(fact.sentence)}
    return words <= text


def fact_task(documents: Sequence[tuple[str, str]], key: str, value: str | None = None, *,
              found: FoundFact | None = None, depth: float = 0.5, style: str = "key",
              restate: bool = True) -> TaskPrompt:
    """A find-the-fact question on the user's own `documents` ((name, text) pairs).

    - `value` typed (and no `found`): the fact sentence in the trained wording is inserted at the
      sentence end nearest `depth` (0 = start, 1 = end) of the longest document, or is a one-line
      document of its own when there are none.
    - `found` (from `find_facts`): that sentence is replaced in place by the trained wording, with
      `key` (the user may have edited it) and `value` or the found value; the other text is untouched.
    - neither: the first fact `find_facts` finds whose sentence holds every word of `key` is
      replaced as with `found`; none is an InputError naming the key.
    - `restate` (default): the fact is also written once more at the end of its document (unless it
      already ends it), as the model's training restated facts; `benchmarks/bench_fact_template.py
      --no-restate` measures the difference (docs/cli.md).

    The question is the trained one about `key`; the response is prefilled with `answer_prefix(style,
    key)`. Bad input (empty, multi-line or over-long key or value, a value without digits, a depth
    outside [0, 1], a `found` that does not point into `documents`) is an InputError naming it.
    """
    key = _check_field(key, "key")
    if not isinstance(depth, (int, float)) or isinstance(depth, bool) or not 0.0 <= depth <= 1.0:
        raise InputError(f"the fact's depth must be a number in [0, 1], got {depth!r}")
    docs = [(str(name), str(text)) for name, text in documents]
    if found is None and value is None:
        hits = [f for f in find_facts(docs, limit=1000) if _matches(f, key)]
        if not hits:
            raise InputError(f"no fact about {key!r} was found in the documents (a sentence such as "
                             f"'the {key} is 3-8-2-5'); type its value (--value) to insert it")
        found = hits[0]
    if found is not None:
        if not 0 <= found.document < len(docs) or not 0 <= found.start < found.end <= len(docs[found.document][1]):
            raise InputError("the picked fact does not point into the documents")
        value = _check_value(value if value is not None else found.value)
        sentence = fact_sentence(key, value).rstrip()
        name, text = docs[found.document]
        docs[found.document] = (name, text[:found.start] + sentence + text[found.end:])
        at = (found.document, found.start, found.start + len(sentence))
    else:
        value = _check_value(value)
        sentence = fact_sentence(key, value)
        if not docs:
            docs = [("fact.txt", sentence.rstrip())]
            at = (0, 0, len(sentence.rstrip()))
        else:
            d = max(range(len(docs)), key=lambda i: len(docs[i][1]))
            name, text = docs[d]
            cut = _sentence_end_near(text, depth)
            if cut > 0 and not text[cut - 1].isspace():
                sentence = " " + sentence
            docs[d] = (name, text[:cut] + sentence + text[cut:])
            start = cut + (1 if sentence.startswith(" ") else 0)
            at = (d, start, start + len(sentence.strip()))
    restated = None
    if restate:
        d = at[0]
        name, text = docs[d]
        if text[at[2]:].strip():      # the fact does not end its document already
            join = "" if text.endswith("\n") else "\n"
            start = len(text) + len(join)
            docs[d] = (name, text + join + fact_sentence(key, value))
            restated = (d, start, start + len(fact_sentence(key, value).rstrip()))
    return TaskPrompt("find-fact", TRAIN.systems[0], docs, fact_question(key), answer_prefix(style, key), value,
                      at, style, restated)


def _sentence_end_near(text: str, depth: float) -> int:
    """Character offset just after the sentence end (". ", "! ", "? " or a newline) nearest `depth`
    of `text` (0 and len(text) are ends too), so the fact never lands inside a sentence."""
    target = int(depth * len(text))
    ends = [0, len(text)] + [m.end() for m in re.finditer(r"[.!?]\s+|\n+", text)]
    return min(ends, key=lambda e: (abs(e - target), e))


def picture_task(attribute: str, kind: str | None = None) -> TaskPrompt:
    """The trained question about a picture's `attribute` (colour, shape, position or digit), with the
    response prefilled `attribute: `. `kind` ("shape" or "digit") picks the wording of a colour
    question; default: "digit" for the digit, "shape" otherwise."""
    if attribute not in PICTURE_ATTRIBUTES:
        raise InputError(f"a picture question asks one of {', '.join(PICTURE_ATTRIBUTES)}; got {str(attribute)[:40]!r}")
    kind = kind or ("digit" if attribute == "digit" else "shape")
    questions = PICTURE_QUESTIONS.get(kind, {})
    if attribute not in questions:
        raise InputError(f"a {kind} picture has no trained {attribute} question "
                         f"(it has: {', '.join(questions) or 'none'})")
    return TaskPrompt("picture", PICTURE_SYSTEMS[0], [], questions[attribute][0], answer_prefix("key", attribute),
                      None, None)


# ---------------------------------------------------------------------------------------------------
# asking

@dataclass
class TaskAnswer:
    """A templated question's answer."""

    text: str                # the prefix and the generated response text (without `<|close|>`)
    value: str | None        # the value in it (`workbench.retrieval_text.response_value`)
    correct: bool | None     # the value is the expected one and the response ended (None: nothing expected)
    generated: int           # tokens generated
    first_position: int      # position of the first generated token
    closed: bool = False     # the response ended with `<|close|>` within the token budget
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # `task_spans`: where the fact is, in tokens


def ask(session, task: TaskPrompt, *, max_new_tokens: int = 48, images: Sequence | None = None,
        image_names: Sequence[str | None] | None = None, temperature: float = 0.0) -> TaskAnswer:
    """Ask `task` on `session` (may be recording): `append_task`, then `answer_task`. Greedy by
    default, the way the model answers in its trained format. The session keeps the open turn (the
    next question should start a new session or close it first)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    spans = append_task(session, task, images=images, image_names=image_names)
    found = answer_task(session, task, max_new_tokens=max_new_tokens, temperature=temperature)
    return dataclasses.replace(found, spans=spans)


def append_task(session, task: TaskPrompt, *, images: Sequence | None = None,
                image_names: Sequence[str | None] | None = None, question: bool = True) -> dict[str, tuple[int, int]]:
    """The task's prompt into `session`: the system turn, the documents (one segment each, named),
    the question as a user turn (a picture question: the images and the question in one user
    message, as training laid it out). Bad input is an InputError before anything is appended.
    `question=False` (a find-fact task): the context only, for `workbench.effects` / `check_span`,
    whose branches append the question themselves (`continuation=task`).

    Returns `task_spans`: where the fact and its restatement are, in token positions (end exclusive);
    a recorded session also gets them in its trace's session.json under "task", so `workbench
    questions` finds the needle and the what-if panel offers "the fact" without positions typed."""
    if task.task not in TASKS[1:]:
        raise InputError(f"unknown task {task.task!r}; templates: {', '.join(TASKS[1:])}")
    if session.tokenizer is None:
        raise InputError("a templated question needs a model with tokenizer files")
    if task.task == "picture" and not images:
        raise InputError("a picture question needs a picture")
    if task.task == "picture" and not question:
        raise InputError("a picture question carries its picture: it is appended with its question")
    session.append(task.system, role="system", name="system")
    segments = [session.append(text, name=name) for name, text in task.documents]
    spans = task_spans(session.tokenizer, task, [(int(seg.start), session.tokens[seg.start:seg.end]) for seg in segments])
    _publish_task(session, task, {**recorded_spans(session), **spans})
    if task.task == "picture":
        session.append_message("user", task.question, images=list(images), image_names=image_names, name="question")
    elif question:
        session.append(task.question, role="user", name="question")
    return spans


FACT = "the fact"
def recorded_spans(session: Any) -> dict[str, tuple[int, int]]:
    """The spans `append_task` recorded on `session` ("the fact", "restatement 1"), by label; {} when none
    (a fork carries its parent's). `workbench.check_span` and `workbench.attribution` take these labels as
    names of what to hide."""
    task = getattr(session, "annotations", {}).get("task")
    spans = task.get("spans") if isinstance(task, dict) else None
    if not isinstance(spans, dict):
        return {}
    return {label: (int(span[0]), int(span[1])) for label, span in spans.items()}


def task_spans(tokenizer: Any, task: TaskPrompt, documents: Sequence[tuple[int, Sequence[int]]]
               ) -> dict[str, tuple[int, int]]:
    """Token spans (start, end exclusive) of the fact ("the fact") and its restatement ("restatement 1"),
    given each document's first position and token ids as appended: the tokens that hold any of the
    sentence's characters (a sentence that starts inside a token starts at that token)."""
    out: dict[str, tuple[int, int]] = {}
    for label, where in ((FACT, task.fact), ("restatement 1", task.restated)):
        if where is None or not 0 <= where[0] < len(documents):
            continue
        start, ids = documents[where[0]]
        text = task.documents[where[0]][1]
        span = _token_span(tokenizer, ids, len(text[:where[1]].encode()), len(text[:where[2]].encode()))
        if span is not None:
            out[label] = (start + span[0], start + span[1])
    return out


def _token_span(tokenizer: Any, ids: Sequence[int], byte_start: int, byte_end: int) -> tuple[int, int] | None:
    """The tokens of `ids` that hold any byte of [byte_start, byte_end) of their decoding."""
    first = last = None
    at = 0
    for i, token in enumerate(ids):
        size = len(tokenizer.encoding.decode_single_token_bytes(int(token)))
        if at + size > byte_start and at < byte_end:
            first = i if first is None else first
            last = i
        at += size
        if at >= byte_end:
            break
    return None if first is None else (first, last + 1)


def _publish_task(session: Any, task: TaskPrompt, spans: dict[str, tuple[int, int]]) -> None:
    """Say on `session` which task was asked and where its fact is (`Session.annotate`: a recording watching
    it writes them into its trace's session.json under "task"; `recorded_spans` reads them back)."""
    session.annotate(task={"task": task.task, "question": task.question, "expected": task.expected,
                           "spans": {label: list(span) for label, span in spans.items()}})


def answer_task(session, task: TaskPrompt, *, max_new_tokens: int = 48, temperature: float = 0.0) -> TaskAnswer:
    """Open the assistant turn with the task's prefilled response start and generate up to the
    response's `<|close|>` (or `max_new_tokens`); the value judged against `task.expected`."""
    tokenizer = session.tokenizer
    session.append(ids=tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(task.prefix),
                   name="answer prefix", kind="turn", role="assistant")
    from engine.session.answer import generate_answer

    first = len(session.tokens)
    answer = generate_answer(session, max_new_tokens=max_new_tokens, temperature=temperature,
                             add_generation_prompt=False, stop_ids=(tokenizer.close_id,))
    # the format requires the response's own `<|close|>`: an end of message without it is not a closed answer
    closed = bool(answer.ids) and answer.ids[-1] == tokenizer.close_id
    text = task.prefix + answer.text
    value = response_value(text, task.style) or None
    correct = None if task.expected is None else bool(closed and value == task.expected)
    first = answer.first_position if answer.first_position is not None else first
    return TaskAnswer(text, value, correct, answer.generated, first, closed)


def answer_style(model: str | Path) -> str:
    """The answer style to template a question for `model` with (`answer_style_of`)."""
    return answer_style_of(model)


__all__ = ["TASKS", "PICTURE_ATTRIBUTES", "PICTURE_QUESTIONS", "PICTURE_SYSTEMS", "ModelCard", "card_of",
           "card_files", "FoundFact", "find_facts", "key_of", "TaskPrompt", "fact_task", "fact_sentence",
           "fact_question", "picture_task", "TaskAnswer", "ask", "append_task", "answer_task", "answer_style",
           "FACT", "task_spans", "recorded_spans"]
