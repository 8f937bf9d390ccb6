"""Hypothesis budgets for the fuzz targets: "ci" (default, a few seconds per target) and "long".

Select with `HYPOTHESIS_PROFILE=long python -m pytest tests/hardening`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=60, **_COMMON)
settings.register_profile("long", max_examples=3000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
