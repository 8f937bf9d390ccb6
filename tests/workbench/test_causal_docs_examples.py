"""docs/interventions.md's Python examples run as written on builtin:demo and give meaningful figures: the
answer scored where the model writes it, the fact's effect beside 8 disjoint controls with its verdict,
and the attribution sweep written into a trace's effects table (issue 39)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT


def test_the_interventions_page_examples_run_as_written(tmp_path) -> None:
    page = (ROOT / "docs" / "interventions.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    runnable = [b for b in blocks if "load_model(\"builtin:demo\")" in b or "rows_from_attribution" in b]
    assert len(runnable) == 2, "the page's two runnable examples (effects + verdict, the effects table)"
    (tmp_path / "docs").symlink_to(ROOT / "docs")     # the example reads docs/engine.md as the user's document
    out = subprocess.run([sys.executable, "-c", "\n".join(runnable)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ScoringWarning" not in out.stderr                      # scored where the model answers
    change = float(re.search(r"target log-probability: \S+ -> \S+ nats \(([-+.\d]+)\)", out.stdout).group(1))
    assert change < -3, out.stdout
    assert re.search(r"hiding the fact lowered the answer's log-probability by [\d.]+ nats; 8 random spans of the "
                     r"same size changed it by .*: the answer depends on the fact", out.stdout), out.stdout
    assert (tmp_path / "traces" / "run1" / "effects.parquet").is_file()
