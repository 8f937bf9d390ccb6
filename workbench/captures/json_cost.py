"""What parsing a responses file would cost, measured on its text before it is parsed.

    check_json_cost(text, where) -> None      raises InputError, one line naming the file and the limit

A JSON parser turns every array, object and number into a Python object: 3 bytes of `[],` become
an empty list of 56 bytes and its slot in the parent, so a 45 MiB file of `[[],[],...]` held 3 GB
before its first record could be refused. A capture is token ids and base64 strings (the strings
cost what their text costs), so the structure outside strings is counted first: arrays and objects,
values (commas), the nesting depth (the parser recurses once per level) and the longest number (a
5,000-digit integer is no token id, and Python refuses to parse one past 4,300 digits). Everything is
counted with regular expressions and `str.count`, and the depth with NumPy in bounded chunks.
"""

from __future__ import annotations

import re

import numpy as np

from engine.errors import InputError

MAX_PARSED_BYTES = 1 << 30  # Python objects a capture's JSON may become (a 1M-token prompt: ~40 MB)
MAX_DEPTH = 64  # nesting of arrays and objects (a response nests five deep)
MAX_DIGITS = 20  # digits of one number (token ids, offsets, counts: int64 at most)
CONTAINER_BYTES = 72  # an empty list or dict and its slot in the parent
VALUE_BYTES = 40  # a number (int 28 bytes, float 24) and its slot in the parent
_CHUNK = 1 << 24  # structural characters whose depth is summed at a time

# a JSON string: quotes around anything but a quote or backslash, or an escaped character
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_STRUCTURE = re.compile(r"[^\[\]{},]+")
_LONG_NUMBER = re.compile(r"[0-9]{%d,}" % (MAX_DIGITS + 1))


def _depth(structure: str) -> int:
    """Deepest nesting of `[`/`{` in a string of structural characters (strings already cut out)."""
    deepest = level = 0
    for lo in range(0, len(structure), _CHUNK):
        chars = np.frombuffer(structure[lo:lo + _CHUNK].encode("ascii"), np.uint8)
        steps = ((chars == ord("[")) | (chars == ord("{"))).astype(np.int32)
        steps -= (chars == ord("]")) | (chars == ord("}"))
        running = np.cumsum(steps) + level
        if len(running):
            deepest, level = max(deepest, int(running.max())), int(running[-1])
    return deepest


def check_json_cost(text: str, where: str) -> None:
    """Refuse JSON (or JSON Lines) `text` whose parse would nest past MAX_DEPTH, hold a number of more
    than MAX_DIGITS digits, or build more than MAX_PARSED_BYTES of Python objects (estimated from its
    arrays, objects and values); InputError naming `where`."""
    skeleton = _STRING.sub("", text)
    number = _LONG_NUMBER.search(skeleton)
    if number:
        digits = len(re.match(r"[0-9]*", skeleton[number.start():]).group())
        raise InputError(f"{where}: holds a number of {digits:,} digits; a capture's numbers (token ids, offsets) "
                         f"have at most {MAX_DIGITS}")
    structure = _NOT_STRUCTURE.sub("", skeleton)
    del skeleton
    containers = structure.count("[") + structure.count("{")
    values = structure.count(",") + 1
    cost = containers * CONTAINER_BYTES + values * VALUE_BYTES
    if cost > MAX_PARSED_BYTES:
        raise InputError(f"{where}: parsing it would build about {cost:,} bytes of objects ({containers:,} arrays "
                         f"and objects, {values:,} values), more than the {MAX_PARSED_BYTES:,} a capture may; a "
                         f"capture is one conversation's responses (token ids and base64 arrays)")
    depth = _depth(structure)
    if depth > MAX_DEPTH:
        raise InputError(f"{where}: nested {depth:,} levels deep, more than the {MAX_DEPTH} a capture may")
