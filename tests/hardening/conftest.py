"""Hypothesis budgets for the fuzz targets: "ci" (default, a few seconds per target) and "long".

"ci" is derandomized: the same examples every run, so a red CI names a change, not a lucky draw.
"long" draws fresh examples each run and is how new input bugs are found; run it when touching a
reader (`HYPOTHESIS_PROFILE=long python -m pytest tests/hardening`) and pin what it finds with
`@example` or a plain test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=1000, derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import contextlib  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from typing import Iterator  # noqa: E402

EXAMPLE_SECONDS = 10.0  # per fuzz example, generous for a loaded 2-core machine
EXAMPLE_RSS_MIB = 512  # growth of the peak resident set one example may cause


@contextlib.contextmanager
def bounded(seconds: float = EXAMPLE_SECONDS, rss_mib: float = EXAMPLE_RSS_MIB) -> Iterator[None]:
    """Assert that the body runs within `seconds` and raises the peak RSS by less than `rss_mib`."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak
    assert elapsed < seconds, f"took {elapsed:.1f} s"
    assert grown < rss_mib, f"peak RSS grew by {grown:.0f} MiB"
