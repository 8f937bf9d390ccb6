"""Pictures for multimodal experiments: `chart_picture()` draws a labelled bar chart with a caption.

Notebooks, the demo session and tests need a real image whose content is known (bars of given
heights, a title, a caption naming a fact), drawn the same for the same arguments; Pillow draws it,
so nothing is downloaded. The answer's reads can then be compared with where the bars and the
caption lie in the picture.
"""

from __future__ import annotations

from typing import Sequence

from PIL import Image, ImageDraw, ImageFont

_COLOURS = [(76, 120, 168), (245, 133, 24), (84, 162, 75), (228, 87, 86), (114, 183, 178), (178, 121, 162)]


def chart_picture(values: Sequence[float] = (3, 7, 4, 9, 5), labels: Sequence[str] | None = None,
                  title: str = "Crates unloaded per pier", caption: str = "Pier D unloaded the most: 9 crates.",
                  size: tuple[int, int] = (448, 336)) -> Image.Image:
    """An RGB bar chart: `title` on top, one bar per value (labelled below), `caption` at the bottom.

    Args:
        values: bar heights (>= 0; the tallest fills the plot area).
        labels: one label per bar (default "A", "B", ...).
        title, caption: text drawn above and below the plot.
        size: (width, height) in pixels.
    """
    width, height = size
    if width < 64 or height < 64:
        raise ValueError(f"chart_picture: size {size} is too small (at least 64 x 64)")
    labels = list(labels) if labels is not None else [chr(ord("A") + i) for i in range(len(values))]
    if len(labels) != len(values) or not values or min(values) < 0:
        raise ValueError("chart_picture: need one label per value and values >= 0")
    im = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(im)
    font = ImageFont.load_default()
    draw.text((10, 8), title, fill=(20, 20, 20), font=font)
    top, bottom, left, right = 32, height - 44, 28, width - 12
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=(60, 60, 60), width=2)
    peak = max(values) or 1.0
    slot = (right - left) / len(values)
    for i, (value, label) in enumerate(zip(values, labels)):
        x0 = left + i * slot + slot * 0.18
        x1 = left + (i + 1) * slot - slot * 0.18
        y0 = bottom - (bottom - top - 6) * value / peak
        draw.rectangle([x0, y0, x1, bottom - 1], fill=_COLOURS[i % len(_COLOURS)])
        draw.text(((x0 + x1) / 2 - 3, bottom + 4), str(label), fill=(20, 20, 20), font=font)
        draw.text(((x0 + x1) / 2 - 3, y0 - 12), f"{value:g}", fill=(20, 20, 20), font=font)
    draw.text((10, height - 22), caption, fill=(150, 20, 20), font=font)
    return im
