"""Simple pictures with known content (what the trained demo model was asked about), drawn with Pillow.

Two kinds, each a pure function of a seeded `random.Random`:

- a shape: a circle, square or triangle in one of six colours at the left, right, top, bottom or
  centre of the picture (size, exact place and tints jittered);
- a digit: 0-9 drawn as seven-segment strokes (box size, stroke width and place jittered), in one
  of the six colours.

`Picture.attributes` names what was drawn (`{"colour": "red", "shape": "circle", "position": "left"}`
or `{"digit": "7", "colour": "blue"}`): the answers the questions ask for. Positions are fifths of
the picture far enough apart that each one covers different merged tokens (a 64-px picture is a
4 x 4 grid of 16-px tokens for the trained demo's tower).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35), "green": (35, 160, 55), "blue": (35, 75, 215),
    "yellow": (230, 200, 20), "purple": (135, 55, 175), "orange": (240, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
# centre of the shape as a fraction of (width, height)
POSITIONS: dict[str, tuple[float, float]] = {
    "left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75), "centre": (0.5, 0.5),
}
DIGITS = tuple(str(d) for d in range(10))
# seven-segment layout: a top, b upper right, c lower right, d bottom, e lower left, f upper left, g middle
_SEGMENTS = {"0": "abcdef", "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc", "5": "afgcd", "6": "afgedc",
             "7": "abc", "8": "abcdefg", "9": "abcdfg"}


@dataclass(frozen=True)
class Picture:
    image: Image.Image
    kind: str                       # "shape" | "digit"
    attributes: dict[str, str]      # attribute -> value, what the questions ask for


def _tint(rng: random.Random, rgb: tuple[int, int, int], spread: int) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-spread, spread))) for c in rgb)  # type: ignore[return-value]


def _canvas(rng: random.Random, size: int) -> Image.Image:
    grey = rng.randint(225, 255)  # light backgrounds, never a colour of their own
    return Image.new("RGB", (size, size), _tint(rng, (grey, grey, grey), 8))


def draw_shape(rng: random.Random, size: int = 64, *, shape: str | None = None, colour: str | None = None,
               position: str | None = None) -> Picture:
    """A `size` x `size` picture of one coloured shape; unspecified attributes are drawn at random."""
    shape = shape or rng.choice(SHAPES)
    colour = colour or rng.choice(list(COLOURS))
    position = position or rng.choice(list(POSITIONS))
    im = _canvas(rng, size)
    draw = ImageDraw.Draw(im)
    fx, fy = POSITIONS[position]
    jitter = size / 32
    cx = fx * size + rng.uniform(-jitter, jitter)
    cy = fy * size + rng.uniform(-jitter, jitter)
    r = size * rng.uniform(0.13, 0.19)  # half the side: the shape stays inside its fifth
    fill = _tint(rng, COLOURS[colour], 18)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")
    return Picture(im, "shape", {"colour": colour, "shape": shape, "position": position})


def draw_digit(rng: random.Random, size: int = 64, *, digit: str | None = None,
               colour: str | None = None) -> Picture:
    """A `size` x `size` picture of one seven-segment digit; unspecified attributes at random."""
    digit = digit if digit is not None else rng.choice(DIGITS)
    if digit not in _SEGMENTS:
        raise ValueError(f"unknown digit {digit!r}; choose one of {DIGITS}")
    colour = colour or rng.choice(list(COLOURS))
    im = _canvas(rng, size)
    draw = ImageDraw.Draw(im)
    w, h = size * rng.uniform(0.32, 0.45), size * rng.uniform(0.55, 0.72)
    cx = size / 2 + rng.uniform(-size / 10, size / 10)
    cy = size / 2 + rng.uniform(-size / 14, size / 14)
    x0, x1, y0, y1 = cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2
    ym = (y0 + y1) / 2
    ends = {"a": ((x0, y0), (x1, y0)), "b": ((x1, y0), (x1, ym)), "c": ((x1, ym), (x1, y1)),
            "d": ((x0, y1), (x1, y1)), "e": ((x0, ym), (x0, y1)), "f": ((x0, y0), (x0, ym)),
            "g": ((x0, ym), (x1, ym))}
    stroke = max(2, round(size * rng.uniform(0.06, 0.09)))
    fill = _tint(rng, COLOURS[colour], 18)
    for seg in _SEGMENTS[digit]:
        (ax, ay), (bx, by) = ends[seg]
        # square caps: extend each stroke by half its width so corners close
        half = stroke / 2
        draw.rectangle([min(ax, bx) - half, min(ay, by) - half, max(ax, bx) + half, max(ay, by) + half], fill=fill)
    return Picture(im, "digit", {"digit": digit, "colour": colour})


def draw_picture(rng: random.Random, size: int = 64, *, digit_share: float = 0.35) -> Picture:
    """A shape picture, or a digit picture with probability `digit_share`."""
    return draw_digit(rng, size) if rng.random() < digit_share else draw_shape(rng, size)


# how many values each attribute takes: the chance level of a uniform guess is 1 / this
ATTRIBUTE_VALUES = {"colour": len(COLOURS), "shape": len(SHAPES), "position": len(POSITIONS), "digit": len(DIGITS)}

__all__ = ["ATTRIBUTE_VALUES", "COLOURS", "DIGITS", "POSITIONS", "Picture", "SHAPES", "draw_digit", "draw_picture",
           "draw_shape"]
