"""Error types the engine raises for bad input.

Every error a user can cause (a malformed config, checkpoint, prompt or snapshot) is one of these,
with a message that names the file, field or tensor at fault. The CLI prints the message alone
instead of a traceback.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class for user-facing engine errors (bad input, not bugs)."""


class ConfigError(EngineError, ValueError):
    """A config.json (or preset) that the engine cannot run: names the offending field."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint whose files or tensors are missing, truncated, mis-shaped or invalid."""


class InputError(EngineError, ValueError):
    """A prompt, token list or runtime argument that the engine refuses."""


class NumericsError(EngineError, ArithmeticError):
    """A forward produced NaN or infinite values (usually from bad weights): names where it first happened."""


class ImageError(InputError):
    """An image the engine cannot use (not an image, truncated, too large, ...): names the file."""
