"""Varied fact wording for training: a fresh needle / key-value phrasing for every document.

Why: the base run (`training.demo_model`) saw six needle sentences, and held-out needle sentences,
not held-out filler, keys or system prompts, were what it failed on; a needle new to the model was
found when it stood out from filler the model knew, not by its key (the measurements: training/README.md,
"Why the design: figures behind the training modules"). So `varied_world` draws new fact templates (lead-in, carrier noun, linking word, word order, punctuation, some
made-up words, some shaped like filler sentences) and new filler per document, so the only
constant left is the key next to its value.

Every word here comes from the training world's pools, a small list of function words, or
`pseudo_word`; none of the held-out world's content words (`tests/training/test_wording.py`
checks it on many draws), so held-out evaluation stays held out.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable

from training.tasks import pseudo_word as _any_pseudo_word
from workbench.retrieval_text import HELD_OUT, TRAIN, World

VARIED_NAME = "train-varied"   # `training.tasks` gives worlds named train* its made-up key names too

_LEADS = ("", "", "", "Remember this: ", "Note: ", "Keep in mind that ", "Important: ", "Listen, ",
          "By the way, ", "Also, ", "Aside: ", "Fact: ")
_NOUNS = ("passcode", "code", "password", "number", "secret passcode", "secret number", "pin", "cipher",
          "token", "key", "value", "digits", "serial", "tag", "id")
_PREPS = ("for", "of", "to", "that opens", "belonging to", "used by", "on")
_LINKS = ("is", "is", "was", "equals", "matches", "is set to", "has become", ":", "->", "stays", "will be")
_QUESTIONS = ("What is the {n} {p} the {k}?", "What is the {k} {n}?", "Tell me the {n} {p} the {k}.",
              "Which {n} goes with the {k}?", "The {k}: what {n}?", "Name the {k} {n}.",
              "What {n} did the text name for the {k}?", "State the {n} {p} the {k}, digits only.",
              "{k} {n}?")


def _held_out_words() -> frozenset[str]:
    text = " ".join(" ".join(v) for v in vars(HELD_OUT).values() if isinstance(v, tuple))
    return frozenset(re.findall(r"[a-z]+", text.lower()))


_HELD_OUT_WORDS = _held_out_words()


def pseudo_word(rng: random.Random) -> str:
    """A made-up word that is none of the held-out world's words (a draw can spell a real one: `give`)."""
    while True:
        w = _any_pseudo_word(rng)
        if w not in _HELD_OUT_WORDS:
            return w


def _sentence(rng: random.Random, noun: str, prep: str, link: str) -> str:
    """One fact sentence over {k} and {v}, in one of several word orders; form 6 is shaped like a
    filler sentence (subject, verb, the fact as its object), so it does not stand out by its shape."""
    form = rng.randrange(7)
    if form == 6:
        subject = rng.choice(TRAIN.subjects) if rng.random() < 0.5 else f"The {pseudo_word(rng)}"
        verb = rng.choice(TRAIN.verbs) if rng.random() < 0.5 else pseudo_word(rng) + "ed"
        return f"{subject} {verb} that the {noun} {prep} the {{k}} {link} {{v}}. "
    if form == 0:
        body = f"the {noun} {prep} the {{k}} {link} {{v}}"
    elif form == 1:
        body = f"the {{k}} {noun} {link} {{v}}"
    elif form == 2:
        body = f"{{k}} {noun}{rng.choice((':', ',', ' -', ''))} {{v}}"
    elif form == 3:
        body = f"{noun} ({{k}}) {link} {{v}}"
    elif form == 4:
        body = f"{{k}}{rng.choice((':', ' ->', ','))} {{v}}"
    else:
        body = f"for the {{k}} the {noun} {link} {{v}}"
    lead = rng.choice(_LEADS)
    if not lead or lead.endswith((": ", ". ")):
        body = body[0].upper() + body[1:]
    return lead + body.replace(" :", ":") + rng.choice((". ", ". ", "; ", "! ")).rstrip() + " "


# Symbols that may stand between a key and its value in `gaps` wording. "=" is left out on purpose:
# the held-out world links with it ("{k} access = {v}"), so it stays a symbol the model never saw there.
_GAP_SYMBOLS = ("->", "=>", "~", "|", "#", ">>", "::", "/", "-", "*", ",", ";")


def gap_link(rng: random.Random) -> str:
    """What stands between a key and its value in `gaps` wording: one to four made-up or training
    words, symbols, or both, so that the value is "the first number after the key" and not a token
    at a fixed distance from it. Measured on the shipped len1/b checkpoint (held-out, 2K and 8K,
    teacher-forced): every failed prompt but one had only the first digit wrong; the later digits
    were copied right, so the needle was found but the jump from the key to the value's start
    depended on the training links."""
    parts = []
    for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
        r = rng.random()
        if r < 0.4:
            parts.append(pseudo_word(rng) + rng.choice(("", "", "s", "ed", "ing")))
        elif r < 0.6:
            parts.append(rng.choice(_GAP_SYMBOLS))
        elif r < 0.8:
            parts.append(rng.choice(_LINKS))
        else:
            parts.append(rng.choice(("the", "a", "its", "now", "then", "still", "for", "at", "to", "by", "as")))
    return " ".join(parts)


def _pairs(rng: random.Random, n: int, gaps: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    needles, questions = [], []
    for _ in range(n):
        noun = rng.choice(_NOUNS) if rng.random() < 0.75 else pseudo_word(rng)
        prep = rng.choice(_PREPS)
        link = rng.choice(_LINKS) if rng.random() < 0.8 else pseudo_word(rng)
        in_fact = noun
        if gaps and rng.random() < 0.7:
            link = gap_link(rng)
            if rng.random() < 0.3:    # more after the carrier noun too: "{k} pin ~ {v}"
                in_fact = f"{noun} {gap_link(rng)}"
        needles.append(_sentence(rng, in_fact, prep, link))
        q = rng.choice(_QUESTIONS).format(n=noun, p=prep, k="{k}")
        questions.append(q[0].upper() + q[1:])
    return tuple(needles), tuple(questions)


def _cap(word: str) -> str:
    return word[0].upper() + word[1:]


def varied_filler(rng: random.Random, n: int = 6) -> dict[str, tuple[str, ...]]:
    """Filler pools for one document: the training world's words mixed with made-up ones, and
    sentence shapes with made-up lead-ins, so the filler itself is new in every document."""
    def mix(pool: tuple[str, ...], made: callable) -> tuple[str, ...]:
        return tuple(rng.choice(pool) if rng.random() < 0.5 else made() for _ in range(n))

    subjects = mix(TRAIN.subjects, lambda: rng.choice(("The ", "A ", "Our ", "")) + pseudo_word(rng))
    subjects = tuple(_cap(x) for x in subjects)
    verbs = mix(TRAIN.verbs, lambda: pseudo_word(rng) + rng.choice(("ed", "ed", "s")))
    objects = mix(TRAIN.objects, lambda: rng.choice(("the {p} {{n}}", "{{n}} {p}s", "the {p} of {q} {{n}}",
                                                      "{p} {q}")).format(p=pseudo_word(rng), q=pseudo_word(rng)))
    tails = mix(TRAIN.tails, lambda: f"{rng.choice(('in', 'at', 'on', 'before', 'after'))} the {pseudo_word(rng)}.")
    shapes = mix(TRAIN.shapes, lambda: rng.choice((
        "{p}, {{s_lower}} {{V}} {{O}} {{T}} ", "{{S}} {{V}} {{O}} {{T}} {p} {q}. ", "{{S}} {p} {{V}} {{O}} {{T}} ",
        "{{S}} {{V}} {{O}}; {p} {q} {{T}} ")).format(p=_cap(pseudo_word(rng)) if rng.random() < 0.5 else pseudo_word(rng),
                                                      q=pseudo_word(rng)))
    return {"subjects": subjects, "verbs": verbs, "objects": objects, "tails": tails, "shapes": shapes}


def varied_world(rng: random.Random, templates: int = 4, filler: bool = True, gaps: bool = False) -> World:
    """The training world with `templates` freshly drawn needle and key-value phrasings (each needle
    with its matching question) and, with `filler`, freshly mixed filler (`varied_filler`), for one
    document. Both, because a needle sentence new to the model was found at 2K in the training
    filler but not in new filler: it must be found by its key, not by standing out. With `gaps`,
    most links between key and value are `gap_link` draws (another stream of random draws, so a
    run's batches depend on the flag)."""
    needles, needle_questions = _pairs(rng, templates, gaps)
    kv_facts, kv_questions = _pairs(rng, templates, gaps)
    pools = varied_filler(rng) if filler else {}
    return dataclasses.replace(TRAIN, name=VARIED_NAME, needles=needles, needle_questions=needle_questions,
                               kv_facts=kv_facts, kv_questions=kv_questions, **pools)


def row_world(share: float, gaps: bool = False) -> Callable[[random.Random], World]:
    """Each row's world: a freshly drawn phrasing with probability `share`, else TRAIN as the base
    run saw it (so its own wording is kept)."""
    def draw(rng: random.Random) -> World:
        return varied_world(rng, gaps=gaps) if rng.random() < share else TRAIN
    return draw
