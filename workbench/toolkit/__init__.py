"""The researcher's toolkit on the engine (docs/hooks.md): named hook points cached within a
memory bound (`run_with_cache`), the AttnRes logit lens (`logit_lens`) and activation patching between a
clean and a corrupted run (`patch`)."""

from __future__ import annotations

from workbench.toolkit.cache import ActivationCache, Spilled, run_with_cache
from workbench.toolkit.lens import logit_lens, target_rank
from workbench.toolkit.patching import PatchCell, PatchReport, patch

__all__ = ["ActivationCache", "Spilled", "run_with_cache", "logit_lens", "target_rank", "patch", "PatchReport",
           "PatchCell"]
