"""Varied fact wording for training: a fresh needle / key-value phrasing for every document.

Why: the base run (`training.demo_model`) saw six needle sentences. Measured on its shipped
checkpoint at 2K tokens (value given the key, sparse, 18-24 prompts each): training wording 96%,
training wording with the held-out filler 94%, with held-out key names 94%, with the held-out
system prompt 100%, but with the held-out needle sentences 44% and with held-out needle sentences
and questions 11%. The model learned "the value after `is`" for those six templates, not "the
value after the key". `varied_world` draws new templates per document (lead-in, carrier noun,
linking word, word order, punctuation, some of them made-up words), so the only constant left is
the key next to its value.

Every word here comes from the training world's pools, a small list of function words, or
`pseudo_word`; none of the held-out world's content words (`tests/training/test_wording.py`
checks it on many draws), so held-out evaluation stays held out.
"""

from __future__ import annotations

import dataclasses
import random

from training.tasks import pseudo_word
from workbench.retrieval_text import TRAIN, World

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


def _sentence(rng: random.Random, noun: str, prep: str, link: str) -> str:
    """One fact sentence over {k} and {v}, in one of several word orders."""
    form = rng.randrange(6)
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


def _pairs(rng: random.Random, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    needles, questions = [], []
    for _ in range(n):
        noun = rng.choice(_NOUNS) if rng.random() < 0.75 else pseudo_word(rng)
        prep = rng.choice(_PREPS)
        link = rng.choice(_LINKS) if rng.random() < 0.8 else pseudo_word(rng)
        needles.append(_sentence(rng, noun, prep, link))
        q = rng.choice(_QUESTIONS).format(n=noun, p=prep, k="{k}")
        questions.append(q[0].upper() + q[1:])
    return tuple(needles), tuple(questions)


def varied_world(rng: random.Random, templates: int = 4) -> World:
    """The training world with `templates` freshly drawn needle and key-value phrasings (each needle
    with its matching question), for one document."""
    needles, needle_questions = _pairs(rng, templates)
    kv_facts, kv_questions = _pairs(rng, templates)
    return dataclasses.replace(TRAIN, name=VARIED_NAME, needles=needles, needle_questions=needle_questions,
                               kv_facts=kv_facts, kv_questions=kv_questions)
