"""Runs `hf_nnsight_checks.py` (nnsight on engine.hf: trace, save, patch, generate) and `hf_docs_checks.py`
(docs/hooks.md's transformers, nnsight and ContextCite examples) in a fresh process: importing nnsight
mounts a `save` method on every Python object for the rest of the process (its PYMOUNT setting), which
would change what every later test sees (argparse, for one, then skips defaults for options named save)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = [Path(__file__).with_name("hf_nnsight_checks.py"), Path(__file__).with_name("hf_docs_checks.py")]


def test_nnsight_on_engine_hf_in_a_fresh_process() -> None:
    if importlib.util.find_spec("nnsight") is None or importlib.util.find_spec("context_cite") is None:
        pytest.skip("the hf extra (nnsight, context-cite) is not installed")  # found, never imported here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, CHECKS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
