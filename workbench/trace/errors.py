"""Errors the trace store raises for bad input (a path that is not a trace, a newer schema, a corrupt part).

They subclass `engine.errors.EngineError`, so the `workbench` command prints one line and exits 2
instead of a traceback.
"""

from __future__ import annotations

from engine.errors import EngineError


class TraceError(EngineError, ValueError):
    """A trace directory (or an export target) the store cannot use; the message names the path at fault."""


class TraceVersionError(TraceError):
    """A trace written with a schema version this workbench does not read (usually a newer one)."""


class TraceCorruptError(TraceError):
    """A Parquet part or session.json that cannot be decoded (truncated, overwritten, wrong columns)."""
