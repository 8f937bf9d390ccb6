"""The README's Python quick start runs as written and the demo model answers it right."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT


def test_readme_python_quick_start_runs_and_answers_in_the_trained_form(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start: Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "docs").symlink_to(ROOT / "docs")     # the snippet reads docs/engine.md as the user's document
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "garage door: 7142"
    assert (tmp_path / "traces" / "py" / "session.json").is_file()
