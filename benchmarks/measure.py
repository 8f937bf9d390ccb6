"""Helpers shared by the benchmark scripts (run as `python benchmarks/NAME.py`, so this directory is
on sys.path): peak-memory measurement on Linux and a non-repeating filler document (the workbench's
`haystack` text, so benchmarks and notebooks feed the model the same kind of prose)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Callable

from workbench.text import filler_ids as _haystack_ids


def status_kb(field: str) -> int | None:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM, ...); None where unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_kb(reset: bool) -> int:
    """Peak RSS since `reset_peak()` when it worked, else since the process started."""
    peak = status_kb("VmHWM") if reset else None
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def filler_ids(n_tokens: int, encode: Callable[[str], list[int]], seed: int = 0) -> list[int]:
    """Exactly `n_tokens` ids of `workbench.haystack` text (deterministic by `seed`, never exactly repeating)."""
    return _haystack_ids(n_tokens, encode, seed=seed)
