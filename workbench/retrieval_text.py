"""Filler text, key names and value strings of the demo model's generated tasks, in two disjoint worlds.

The trained demo model (`builtin:demo`, trained by `python -m training.demo_model`) saw only `TRAIN`
wording; `workbench demo` and the notebooks ask it in that wording (or `HELD_OUT`, to test that it
generalises), so the one definition lives here, below both `training` and `apps`.

`TRAIN` is everything the training generator may produce; `HELD_OUT` is what evaluation uses:
other filler (other subjects, verbs, objects, sentence shapes), other key names and other needle
wordings. The word pools of the two worlds share no content word (`tests/training` checks it), so a
held-out prompt measures retrieval, not memorised phrasing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.model_card import ANSWER_STYLES, answer_style_of  # noqa: F401  (re-exported: the checkpoint's record)


@dataclass(frozen=True)
class World:
    """Word pools and templates of one world (train or held-out)."""

    name: str
    subjects: tuple[str, ...]
    verbs: tuple[str, ...]
    objects: tuple[str, ...]   # may contain {n}
    tails: tuple[str, ...]
    shapes: tuple[str, ...]    # sentence templates over {S} {V} {O} {T}
    key_adjectives: tuple[str, ...]
    key_nouns: tuple[str, ...]
    variables: tuple[str, ...]
    quote_words: tuple[str, ...]
    # needle templates: {k} key phrase, {v} value; questions ask for the value of {k}
    needles: tuple[str, ...]
    needle_questions: tuple[str, ...]
    kv_facts: tuple[str, ...]
    kv_questions: tuple[str, ...]
    var_set: tuple[str, ...]     # {a} = {v}
    var_copy: tuple[str, ...]    # {b} takes {a}
    var_questions: tuple[str, ...]
    quote_facts: tuple[str, ...]   # {k} and {q}
    quote_questions: tuple[str, ...]
    systems: tuple[str, ...] = field(default=())

    def key(self, rng: random.Random) -> str:
        return f"{rng.choice(self.key_adjectives)} {rng.choice(self.key_nouns)}"


TRAIN = World(
    name="train",
    subjects=("The inspector", "A technician", "The night shift", "The committee", "Our survey team", "The archivist",
              "A visiting engineer", "The ledger", "The foreman", "A clerk", "The pilot", "The harbour master",
              "The gardener", "A courier", "The baker", "The surveyor"),
    verbs=("recorded", "measured", "noted", "replaced", "catalogued", "compared", "reviewed", "estimated",
           "painted", "carried", "repaired", "counted", "sorted", "delivered", "tested", "moved"),
    objects=("the pressure in valve {n}", "{n} crates of spare parts", "the drift of sensor {n}",
             "the temperature at gate {n}", "shelf {n} of the east wing", "the delay on line {n}",
             "the load on crane {n}", "the reading of meter {n}", "{n} sacks of flour", "the roof of shed {n}",
             "the fence along field {n}", "{n} letters for the town hall", "the lamp on pier {n}"),
    tails=("before noon.", "after the storm.", "during the audit.", "on the second day.", "without incident.",
           "as scheduled.", "for the quarterly report.", "twice, to be sure.", "at dawn.", "in the rain.",
           "with some difficulty.", "while the crew had lunch."),
    shapes=("{S} {V} {O} {T} ", "{S} {V} {O} {T} ", "Later, {s_lower} {V} {O} {T} ", "{S} quietly {V} {O} {T} ",
            "In the morning {s_lower} {V} {O}. "),
    key_adjectives=("amber", "silver", "crimson", "northern", "quiet", "hidden", "iron", "golden", "frozen", "western",
                    "little", "ancient", "bright", "hollow", "copper", "velvet", "marble", "dusty", "royal", "lunar"),
    key_nouns=("falcon", "lantern", "harbor", "orchard", "tower", "bridge", "cellar", "garden", "engine", "mirror",
               "river", "castle", "window", "wagon", "canyon", "meadow", "beacon", "anchor", "chapel", "forge"),
    variables=tuple(f"{a}{d}" for a in "ABCDEFGHJKLMNPQRSTUVWXYZ" for d in "123456789"),
    quote_words=("red", "blue", "stone", "apple", "cloud", "seven", "north", "paper", "glass", "horse", "river",
                 "candle", "silent", "yellow", "winter", "pepper", "honey", "salt", "night", "door", "small", "open"),
    needles=("The secret passcode for the {k} is {v}. ", "The {k} code is {v}. ",
             "Remember this: the password of the {k} is {v}. ", "Note: {k} number {v}. ",
             "The code that opens the {k} is {v}. ", "Keep in mind that the {k} passcode is {v}. "),
    needle_questions=("What is the secret passcode for the {k}?", "What is the {k} code?",
                      "What is the password of the {k}?", "Which number belongs to the {k}?",
                      "What is the code that opens the {k}? Answer with the digits only.",
                      "Tell me the {k} passcode."),
    kv_facts=("The {k} is number {v}. ", "{k} has the value {v}. ", "Item {k}: {v}. ", "The {k} was assigned {v}. "),
    kv_questions=("What number is the {k}?", "What value does the {k} have?", "Which value was assigned to the {k}?"),
    var_set=("Let {a} be {v}. ", "Set {a} to {v}. ", "Variable {a} holds {v}. "),
    var_copy=("Then {b} takes the value of {a}. ", "Copy {a} into {b}. ", "Now {b} equals {a}. "),
    var_questions=("What is the value of {b}?", "What does {b} hold now?"),
    quote_facts=('The sign on the {k} read "{q}". ', 'A note about the {k} said: "{q}". '),
    quote_questions=("What did the sign on the {k} read? Quote it exactly.", "Quote the note about the {k}."),
    systems=("You are a careful reader. Answer questions about the documents exactly.",
             "Answer with the exact value from the text.", "You answer briefly and exactly."),
)

HELD_OUT = World(
    name="held-out",
    subjects=("The biologist", "A violinist", "The mayor", "Two students", "The chemist", "A shepherd",
              "The librarian's cousin", "The orchestra", "A novelist", "The lighthouse keeper"),
    verbs=("observed", "sketched", "borrowed", "praised", "questioned", "photographed", "described", "ignored"),
    objects=("a heron near pond {n}", "the melody of song {n}", "chapter {n} of the novel", "the comet over hill {n}",
             "{n} jars of jam", "the statue in square {n}", "the recipe from page {n}"),
    tails=("yesterday evening.", "with great care.", "for no clear reason.", "under a grey sky.",
           "despite the noise.", "long after midnight."),
    shapes=("Honestly, {s_lower} {V} {O} {T} ", "{S} {V} {O} {T} It was a long week. ",
            "According to rumours, {s_lower} {V} {O} {T} "),
    key_adjectives=("scarlet", "emerald", "southern", "tiny", "broken", "secretive", "violet", "polar"),
    key_nouns=("observatory", "greenhouse", "submarine", "vault", "locker", "aquarium", "museum", "pavilion"),
    variables=tuple(f"{w}" for w in ("alpha", "omega", "theta", "sigma", "delta", "kappa")),
    quote_words=("violin", "tulip", "orbit", "thunder", "lemon", "shadow", "pebble", "saffron"),
    needles=("Write this down somewhere safe, the combination for the {k} reads {v}. ",
             "For the record: {k} access = {v}. "),
    needle_questions=("Which combination unlocks the {k}? Reply with the number only.",
                      "Give the {k} access number."),
    kv_facts=("Register entry, {k}, {v}. ",),
    kv_questions=("Which entry number went to the {k} in the register?",),
    var_set=("Assign {v} to {a}. ",),
    var_copy=("Afterwards {a} is copied to {b}. ",),
    var_questions=("After these steps, what is {b}?",),
    quote_facts=('Engraved on the {k}: "{q}". ',),
    quote_questions=("Repeat the engraving on the {k} word for word.",),
    systems=("Read the material and answer precisely.",),
)


def value_string(rng: random.Random) -> str:
    """A passcode: 4-7 digits, sometimes dash-separated single digits (like the demo's 4-7-1-9)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 7)))
    return "-".join(digits[:4]) if rng.random() < 0.2 else digits


def filler(world: World, rng: random.Random, n_bytes: int) -> str:
    """Roughly `n_bytes` of that world's filler sentences (never cut inside a sentence)."""
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        obj = rng.choice(world.objects).format(n=rng.randint(2, 999))
        subject = rng.choice(world.subjects)
        s = rng.choice(world.shapes).format(S=subject, s_lower=subject[0].lower() + subject[1:],
                                            V=rng.choice(world.verbs), O=obj, T=rng.choice(world.tails))
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)




def response_text(key: str, value: str) -> str:
    """The trained demo model's answer in the `key` style: the key it was asked about, then the value
    (`amber tower: 4821`).

    Restating the key first puts the key phrase right before the value, as it stands in the document,
    so retrieving the value is a match on the words just before it (what DSA's top-k can select).
    """
    return f"{key}: {value}"


def answer_parts(style: str, key: str, value: str, fact_text: str = "") -> tuple[str, str]:
    """(whole response, the part of it a demo prefills) of an answer in `style`.

    `key`: `amber tower: 4821`, prefilled `amber tower: ` (the model produces the value).
    `span`: the document quoted from the key through the value (`amber tower reads 4821` for the
    fact `... the code of the amber tower reads 4821.`), prefilled `amber tower`. Every token after
    the key is then a copy of the token that follows the same text in the document (what an
    induction head does, whatever the wording), where the `key` style must jump from the key over
    words it may never have seen to the value's first token. Facts whose text does not hold the key
    before the value (variable tracking) answer in the `key` style.
    """
    prefix = answer_prefix(style, key)
    if style == "span" and key and key in fact_text:
        start = fact_text.index(key)
        at = fact_text.find(value, start + len(key))
        if at >= 0:
            return fact_text[start:at + len(value)], prefix
    return response_text(key, value), response_text(key, "")


def answer_prefix(style: str, key: str) -> str:
    """What a demo prefills of a needle answer in `style` (the key, and `: ` in the key style)."""
    if style not in ANSWER_STYLES:
        raise ValueError(f"answer style must be one of {ANSWER_STYLES}, got {style!r}")
    return key if style == "span" else response_text(key, "")


def response_value(response: str, style: str = "key") -> str:
    """The value in an answer of `style`: everything after the first ': ' (`key`; the whole text
    without one), or the last word of the quoted span (`span`: needle values are digit strings)."""
    text = response.strip()
    if style == "span":
        return text.split()[-1] if text else ""
    _, sep, value = text.partition(": ")
    return (value if sep else text).strip()
