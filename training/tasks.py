"""Retrieval tasks generated on the fly (never stored), in the K3 chat format of spec section 9.

Every sample is one long document with facts planted at random depths in filler text, followed by
one to three question turns, each answered by the assistant:

- needle: a passcode sentence ("The code that opens the {k} is {v}."), asked for by its key;
- associative recall: several key-value facts, one (or more) asked for;
- variable tracking: `Let A3 be 512. ... Then K7 takes the value of A3.`, the last name asked for;
- copying: a quoted span, asked to be quoted exactly.

Two layouts, as sessions build them: the document as plain text after a system turn, then the
question as a user turn (what `workbench demo` does), or document and question in one user message.
The assistant turn is `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` (the generation
prompt) + `<|close|>think<|sep|><|open|>response<|sep|>{answer}<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>`.

The tokenizer is byte-level, so pieces encoded separately concatenate to exactly the ids of the
whole text: that is how each fact's token span is known (for evaluation and read statistics).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.tokenizer import Message, Tokenizer, parse_answer
from workbench.retrieval_text import (HELD_OUT, TRAIN, World, answer_parts, filler, response_value,
                                      value_string)

# loss weights: the answer's value, a value restated in the document (retrievable from its first
# mention), the answer's restated key and the fixed assistant scaffold, everything else (the filler)
W_ANSWER, W_RESTATED, W_KEY, W_SCAFFOLD, W_CONTEXT = 1.0, 0.9, 0.5, 0.3, 0.05
# From this step on the restated key weighs W_KEY_LATE: by then values are retrieved well but copying
# a key never seen (a pseudo-word, or a held-out name) from the question lags behind (measured on
# the run's states at step 650: key-copy loss 0.76 on training keys, 4.9 on held-out ones).
KEY_WEIGHT_STEP, W_KEY_LATE = 700, 0.95
DRILL_SHARE = 0.4   # share of training rows that are recall drills (`build(drill=True)`)
PSEUDO_KEY_SHARE = 0.6   # share of training keys with one or both words a `pseudo_word`


@dataclass
class Fact:
    text: str
    question: str
    answer: str
    kind: str = ""               # needle | kv | var | quote
    key: str = ""                # what the question names (echoed before the value in the answer)
    after: "Fact | None" = None   # a fact that must come earlier (variable tracking, restatements)
    restated: bool = False       # a later mention of an earlier fact: its value is weighted W_RESTATED
    start: int = -1              # token span in the sample, filled in by `build`
    end: int = -1


@dataclass
class Sample:
    ids: list[int]
    weights: list[float]
    facts: list[Fact] = field(default_factory=list)
    prompt_len: int = 0          # tokens up to and including the first generation prompt
    answer: str = ""             # first question's answer (the value)
    response: str = ""           # first question's whole response text (`key: value`, or the quoted span)
    prefill: str = ""            # the part of `response` a demo prefills (`key: `, or the key)
    # (query row, key position) pairs: the row whose next token is a copy of the token at the key
    # position (an answer's value, or a restated value, and the same token in the fact it came from)
    copies: list[tuple[int, int]] = field(default_factory=list)


def _tags(tok: Tokenizer, opening: bool, name: str) -> list[int]:
    return tok.section_tag(name, opening)


def answer_ids(tok: Tokenizer, answer: str) -> tuple[list[int], list[int], list[int]]:
    """(scaffold before, answer ids, scaffold after) of an assistant answer after the generation prompt.

    `answer` is the whole response text (`Sample.response`, `key: value`)."""
    before = tok.response_prefix()
    after = _tags(tok, False, "response") + _tags(tok, False, "message") + [tok.end_of_msg_id]
    return before, tok.encode(answer), after


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable nonsense word (`bavoki`): training keys made of these can only be answered by
    copying them from the question, never from a memorised key vocabulary, so the copy generalises
    to key names the model never saw (the held-out world's)."""
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3)))


def _training_world(world: World) -> bool:
    """TRAIN and the worlds derived from it (`training.wording.varied_world`, named `train-...`) get
    made-up key names and quote words; the held-out world never does."""
    return world is TRAIN or world.name.startswith("train")


def _key(world: World, rng: random.Random) -> str:
    adjective, noun = rng.choice(world.key_adjectives), rng.choice(world.key_nouns)
    if _training_world(world):
        r = rng.random()
        if r < PSEUDO_KEY_SHARE / 3:
            adjective = pseudo_word(rng)
        elif r < 2 * PSEUDO_KEY_SHARE / 3:
            noun = pseudo_word(rng)
        elif r < PSEUDO_KEY_SHARE:
            adjective, noun = pseudo_word(rng), pseudo_word(rng)
    return f"{adjective} {noun}"


def _facts(world: World, rng: random.Random, kinds: list[str]) -> list[Fact]:
    facts: list[Fact] = []
    keys: list[str] = []
    while len(keys) < len(kinds):   # distinct keys within a sample
        k = _key(world, rng)
        if k not in keys:
            keys.append(k)
    names = rng.sample(world.variables, min(len(world.variables), 2 * len(kinds)))
    for i, kind in enumerate(kinds):
        k = keys[i]
        if kind == "needle":
            v = value_string(rng)
            t = rng.randrange(len(world.needles))
            q = world.needle_questions[t] if rng.random() < 0.7 else rng.choice(world.needle_questions)
            facts.append(Fact(world.needles[t].format(k=k, v=v), q.format(k=k), v, kind=kind, key=k))
        elif kind == "kv":
            v = str(rng.randint(10, 99999))
            facts.append(Fact(rng.choice(world.kv_facts).format(k=k, v=v), rng.choice(world.kv_questions).format(k=k), v,
                              kind=kind, key=k))
        elif kind == "var":
            a, b = names[2 * i], names[2 * i + 1]
            v = str(rng.randint(1, 999))
            first = Fact(rng.choice(world.var_set).format(a=a, v=v), "", v)
            facts.append(first)
            facts.append(Fact(rng.choice(world.var_copy).format(a=a, b=b), rng.choice(world.var_questions).format(b=b),
                              v, kind=kind, key=b, after=first))
        else:  # quote
            q = " ".join(pseudo_word(rng) if _training_world(world) and rng.random() < 0.5 else rng.choice(world.quote_words)
                         for _ in range(rng.randint(2, 4)))
            facts.append(Fact(rng.choice(world.quote_facts).format(k=k, q=q), rng.choice(world.quote_questions).format(k=k), q,
                              kind=kind, key=k))
    return facts


def _restate(world: World, rng: random.Random, f: Fact) -> Fact:
    """A later mention of fact `f` in another of its kind's templates (dense retrieval practice: the value
    is predictable only from the first mention)."""
    pools = {"needle": world.needles, "kv": world.kv_facts, "quote": world.quote_facts}
    text = rng.choice(pools[f.kind]).format(k=f.key, v=f.answer, q=f.answer)
    return Fact(text, "", f.answer, kind=f.kind, key=f.key, after=f, restated=True)


def _place(rng: random.Random, facts: list[Fact], n: int, depths: list[float] | None) -> list[tuple[float, Fact]]:
    """Depth (fraction of the filler) of each fact; dependent facts come after what they depend on."""
    if depths is None:
        depths = [rng.random() for _ in facts]
    placed = dict(zip(map(id, facts), depths))
    for f in facts:
        if f.after is not None and placed[id(f)] < placed[id(f.after)]:
            placed[id(f)], placed[id(f.after)] = placed[id(f.after)], placed[id(f)]
    return sorted(((placed[id(f)], f) for f in facts), key=lambda p: p[0])


def _copied_at(f: Fact, copied: str) -> int:
    """Character offset in the document of the fact that holds `f`'s answer (`source_fact`) where
    `copied` (an answer's text after its prefill) stands; -1 when it does not."""
    src = source_fact(f)
    if f.key and f.key in src.text:
        return src.text.find(copied, src.text.index(f.key) + len(f.key))
    return src.text.rfind(copied)


def source_fact(f: Fact) -> Fact:
    """The fact whose text holds `f`'s value: the first mention of a restated fact, the assignment a
    variable-tracking question goes back to, else `f` itself."""
    return f.after if (f.restated or f.kind == "var") and f.after is not None else f


def _frame(tok: Tokenizer, world: World, rng: random.Random, asked: list[Fact],
           layout: str, key_weight: float = W_KEY, first_weight: float | None = None,
           style: str = "key", close_weight: float | None = None,
           answers: list[tuple[int, Fact, str]] | None = None) -> tuple[list[int], list[tuple[list[int], float]]]:
    """The ids before the document (head) and the (ids, loss weight) pieces after it (tail).

    `answers`, when given, receives (index of the tail piece where the copied part of the answer
    starts, the fact asked, that part's text) per question."""
    tail: list[tuple[list[int], float]] = []
    for i, f in enumerate(asked):
        if i == 0 and layout == "message":
            q_ids = tok.encode("\n\n" + f.question) + _tags(tok, False, "message") + [tok.end_of_msg_id]
        else:
            q_ids = tok.chat_prompt([Message("user", f.question)], add_generation_prompt=False)
        tail.append((q_ids, W_CONTEXT))
        tail.append((tok.chat_prompt([], add_generation_prompt=True), W_CONTEXT))
        before, _, after = answer_ids(tok, "")
        response, prefill = answer_parts(style, f.key, f.answer, f.text)
        key_part = tok.encode(prefill)
        value = tok.encode(response[len(prefill):])   # the value (key style) or the quoted rest of the span
        if answers is not None:   # the value follows the two pieces appended next (scaffold, key)
            answers.append((len(tail) + 2, f, response[len(prefill):]))
        if first_weight is None:
            tail += [(before, W_SCAFFOLD), (key_part, key_weight), (value, W_ANSWER)]
        else:   # the value's first token is the jump from the key to the value; the rest is a copy
            tail += [(before, W_SCAFFOLD), (key_part, key_weight), (value[:1], first_weight), (value[1:], W_ANSWER)]
        if close_weight is None:
            tail.append((after, W_SCAFFOLD))
        else:   # the `<|close|>` that ends the value, where copying on would emit the document's next character
            tail += [(after[:1], close_weight), (after[1:], W_SCAFFOLD)]
    if layout == "plain":
        head = tok.chat_prompt([Message("system", rng.choice(world.systems))], add_generation_prompt=False)
    else:
        head = _tags(tok, True, 'message role="user"')
    return head, tail


def build(tok: Tokenizer, world: World, rng: random.Random, length: int, *, kinds: list[str] | None = None,
          depths: list[float] | None = None, questions: int | None = None, layout: str | None = None,
          drill: bool = False, key_weight: float = W_KEY, first_weight: float | None = None,
          style: str = "key", close_weight: float | None = None) -> Sample:
    """One sample of about `length` tokens (exactly `length` unless the fixed parts are longer).

    Args:
        kinds: fact kinds to plant (default: a random mix of 1-6 facts).
        depths: depth of each fact in the document (fraction of the filler), default random.
        questions: how many facts are asked about (default 1-3, at most the askable facts).
        layout: "plain" (system turn, plain document, question turn) or "message" (one user message).
        drill: a recall drill instead of a document: as many facts as fit, little filler, every fact
            restated in the second half in random order (dense practice for the retrieval circuit).
        first_weight: loss weight of each answer's first value token (default: W_ANSWER like the rest).
        style: how answers are worded (`workbench.retrieval_text.answer_parts`: "key" or "span").
        close_weight: loss weight of the `<|close|>` right after each answer (default: W_SCAFFOLD).
    """
    restate = kinds is None
    if drill:
        n = max(1, (length - 200) // 75)
        kinds = [rng.choice(("needle", "kv", "kv", "quote")) for _ in range(n)]
    elif kinds is None:
        # denser documents when there is room: every fact and restatement is retrieval practice
        n = rng.randint(1, max(2, min(12, length // 96)))
        kinds = [rng.choices(("needle", "kv", "var", "quote"), weights=(4, 3, 2, 1))[0] for _ in range(n)]
    layout = layout or rng.choice(("plain", "message"))
    n_questions = questions
    for attempt in range(8):
        facts = _facts(world, rng, kinds)
        if restate:
            facts += [_restate(world, rng, f) for f in facts
                      if f.kind in ("needle", "kv", "quote") and (drill or rng.random() < 0.6)]
        askable = [f for f in facts if f.question and not f.restated]
        rng.shuffle(askable)
        asked = askable[: n_questions or rng.randint(1, min(3, len(askable)))]
        answers: list[tuple[int, Fact, str]] = []
        head, tail = _frame(tok, world, rng, asked, layout, key_weight, first_weight, style, close_weight, answers)
        fact_ids = [tok.encode(f.text) for f in facts]
        fixed = len(head) + sum(len(i) for i in fact_ids) + sum(len(i) for i, _ in tail)
        if fixed <= length:
            break
        # too long for `length`: fewer questions, then the shorter layout, then fewer facts
        if attempt == 0 and questions is None:
            n_questions = 1
        elif layout == "plain" and questions is None:
            layout = "message"
        elif len(kinds) > 1:
            kinds = kinds[:-1]
    budget = max(0, length - fixed)
    # a world may bring its own filler (`training.natural_text.NaturalWorld`: natural sentences)
    own = getattr(world, "filler_text", None)
    text = (own(rng, budget + 64) if own is not None else filler(world, rng, budget + 64))[:budget]

    ids: list[int] = list(head)
    weights: list[float] = [W_CONTEXT] * len(head)
    cursor = 0
    if drill:
        depths = [rng.uniform(0.5, 1.0) if f.restated else rng.uniform(0.0, 0.5) for f in facts]
    for depth, f in _place(rng, facts, budget, depths):
        cut = max(cursor, min(budget, int(depth * budget)))
        # move the cut to a sentence end so a fact never lands inside a filler sentence
        dot = text.find(". ", cut)
        if 0 <= dot < cut + 200 and dot + 2 <= budget:
            cut = dot + 2
        else:
            back = text.rfind(". ", cursor, cut)
            cut = back + 2 if back >= 0 else cursor
        piece = tok.encode(text[cursor:cut])
        ids += piece
        weights += [W_CONTEXT] * len(piece)
        cursor = cut
        f.start = len(ids)
        f_ids = tok.encode(f.text)
        ids += f_ids
        f_w = [W_CONTEXT] * len(f_ids)
        if f.restated:
            at = len(tok.encode(f.text[: f.text.rindex(f.answer)]))
            f_w[at: at + len(tok.encode(f.answer))] = [W_RESTATED] * len(tok.encode(f.answer))
        weights += f_w
        f.end = len(ids)
    rest = tok.encode(text[cursor:])
    ids += rest
    weights += [W_CONTEXT] * len(rest)
    copies: list[tuple[int, int]] = []
    for f in facts:   # a restated value copies its first mention
        if f.restated and f.after is not None:
            _add_copies(copies, tok, f.start + len(tok.encode(f.text[: f.text.rindex(f.answer)])), f, f.answer)
    prompt_len = 0
    starts = {piece: (f, copied) for piece, f, copied in answers}
    for i, (piece, w) in enumerate(tail):
        if i in starts:
            _add_copies(copies, tok, len(ids), *starts[i])
        ids += piece
        weights += [w] * len(piece)
        if i == 1:
            prompt_len = len(ids)
    response, prefill = answer_parts(style, asked[0].key, asked[0].answer, asked[0].text)
    return Sample(ids=ids, weights=weights, facts=facts, prompt_len=prompt_len, answer=asked[0].answer,
                  response=response, prefill=prefill, copies=copies)


def _add_copies(copies: list[tuple[int, int]], tok: Tokenizer, at: int, f: Fact, copied: str) -> None:
    """(query row, key position) for each token of `copied` standing at position `at`: the row before
    it predicts it, and the key is the same token in the fact the value came from. Byte-level ids,
    so character offsets are token offsets (`tests/training/test_copy_targets.py` checks that every
    pair names equal tokens); a copied text not found in its fact adds nothing."""
    src = source_fact(f)
    offset = _copied_at(f, copied)
    if offset < 0 or src.start < 0:
        return
    key = src.start + len(tok.encode(src.text[:offset]))
    n = len(tok.encode(copied))
    copies += [(at + j - 1, key + j) for j in range(n) if key + j < at + j]


def key_weight_at(step: int) -> float:
    """Loss weight of the restated key in training batch `step` (W_KEY, then W_KEY_LATE)."""
    return W_KEY_LATE if step >= KEY_WEIGHT_STEP else W_KEY


def batch(tok: Tokenizer, seed: int, step: int, size: int, length: int, *, drill_share: float = DRILL_SHARE,
          world: Callable[[random.Random], World] | None = None,
          first_weight: float | None = None, style: str = "key",
          close_weight: float | None = None, copies: bool = False) -> tuple[torch.Tensor, ...]:
    """Training batch `step`: ids [size, length] and loss weights [size, length] for the next-token
    targets (weights[:, t] weighs predicting ids[:, t + 1]; the last column is 0).

    Deterministic in (seed, step), so a resumed run sees exactly the batches it would have seen.
    `world(rng)` draws each row's world (default: TRAIN, drawing nothing, so the base run's batches
    are unchanged); `drill_share`: share of rows that are recall drills; `first_weight`, `style`, `close_weight`: see `build`.
    With `copies`, also [size, P, 2] (query row, key position) pairs (`Sample.copies`, -1 padding).
    """
    rng = random.Random(seed * 1_000_003 + step)
    ids = torch.zeros(size, length, dtype=torch.long)
    weights = torch.zeros(size, length)
    pairs: list[list[tuple[int, int]]] = []
    for b in range(size):
        row_world = TRAIN if world is None else world(rng)
        s = build(tok, row_world, rng, length, drill=rng.random() < drill_share,
                  key_weight=key_weight_at(step), first_weight=first_weight,
                  style=style, close_weight=close_weight)
        n = min(length, len(s.ids))
        # long fixed parts can overshoot a short length: keep the end (the question and answer)
        row, w = s.ids[len(s.ids) - n:], s.weights[len(s.ids) - n:]
        ids[b, :n] = torch.tensor(row)
        weights[b, : n - 1] = torch.tensor(w[1:])
        cut = len(s.ids) - n
        pairs.append([(q - cut, k - cut) for q, k in s.copies if k >= cut])
    if not copies:
        return ids, weights
    table = torch.full((size, max(1, max(map(len, pairs))), 2), -1, dtype=torch.long)
    for b, rows in enumerate(pairs):
        if rows:
            table[b, : len(rows)] = torch.tensor(rows)
    return ids, weights, table


def needle_prompt(tok: Tokenizer, world: World, rng: random.Random, length: int, depth: float,
                  style: str = "key") -> Sample:
    """One needle-retrieval prompt (plain layout, one question) with its needle at `depth`."""
    return build(tok, world, rng, length, kinds=["needle"], depths=[depth], questions=1, layout="plain",
                 style=style)


__all__ = ["HELD_OUT", "TRAIN", "Fact", "Sample", "answer_ids", "batch", "build", "needle_prompt", "parse_answer",
           "response_value"]
