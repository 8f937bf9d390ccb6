"""Reducer of the dashboard's integrity banner: the recording's health checks in one line.

`workbench.signals.integrity.summary_line` over the trace's `*_health` tables: the first fault with its
layer, head and the position and step since when it holds, or "no faults" with the warnings and the
share of DSA rows the tie-break decided. Recomputed only when a health table gained a part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.analysis.views.base import Reducer, ViewOptions
from workbench.signals import integrity
from workbench.trace import TraceError


@dataclass(frozen=True)
class IntegrityData:
    """line: the summary; level: "fault", "warn", "clean" or "" (not checked: nothing to show)."""

    line: str = ""
    level: str = ""


class IntegrityReducer(Reducer[IntegrityData]):
    data_type = IntegrityData

    def reduce(self, trace: Any, options: ViewOptions, session: Any) -> IntegrityData:
        try:
            parts = tuple(len(trace.parts(name)) for name in integrity.HEALTH_TABLES)
        except (TraceError, KeyError):
            parts = ()
        line = self.memo("line", (id(trace), parts), lambda: integrity.summary_line(trace) if any(parts) else "")
        level = ("" if not line or "not checked" in line else "fault" if line.startswith("integrity: fault")
                 else "warn" if "warning:" in line else "clean")
        return self.result(line=line, level=level)
