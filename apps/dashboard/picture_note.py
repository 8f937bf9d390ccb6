"""What the dashboard and `workbench run --task picture` say about the pictures a trained model knows.

`builtin:demo` was trained on 64 x 64 pictures of one shape or one digit; any other picture gets an
answer in the trained format that is a guess. The drive panel shows `PICTURE_HINT` beside the
picture question; the command line prints `picture_note(...)` before answering. No Panel here: the
command line imports it.
"""

from __future__ import annotations

TRAINED_PICTURE_SIZE = 64  # the trained pictures' width and height: a larger one is a different picture to the model
PICTURE_HINT = ("It was trained on 64 x 64 pictures of one coloured circle, square or triangle (left, right, top, "
                "bottom or centre) or one seven-segment digit, on a light background.")


def picture_note(name: str, size: tuple[int, int] | None) -> str:
    """One line for a picture question about `name` (`size` = (width, height), None if unknown): the
    hint, and first whether this picture's size already tells that it is not a trained picture."""
    trained = (TRAINED_PICTURE_SIZE, TRAINED_PICTURE_SIZE)
    if size is not None and tuple(size) != trained:
        return (f"note: {name} is {size[0]} x {size[1]}, unlike the pictures this model was trained on, so its "
                f"answer is a guess. {PICTURE_HINT}")
    return f"note: {PICTURE_HINT} Answers about other pictures are guesses."
