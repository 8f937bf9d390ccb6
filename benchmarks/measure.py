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


def print_memory_growth(rows: list[dict], size_key: str, what: str, matrix: str) -> None:
    """The closing line of a memory-vs-size table: growth of the forward's own memory (peak minus
    RSS before) between the first and last row, against linear and quadratic, and what one fp32
    `matrix` (e.g. "[T, T]") at the last size would take."""
    if len(rows) < 2:
        return
    first, last = rows[0], rows[-1]
    e0, e1 = first["peak_kb"] - first["rss_before_kb"], last["peak_kb"] - last["rss_before_kb"]
    ratio, n = last[size_key] / first[size_key], last[size_key]
    print(f"\nforward memory grew {e1 / e0:.2f}x for {ratio:.1f}x {what} (linear: {ratio:.1f}x, quadratic: "
          f"{ratio ** 2:.0f}x); one fp32 {matrix} matrix at {n} {what} would be {n ** 2 * 4 / 2 ** 30:.1f} GiB")
