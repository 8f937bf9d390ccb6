"""`benchmarks/bench_vs_llamacpp.py` without llama-cpp-python: one clear line, exit 0, nothing written.
(With it installed the comparison takes minutes: it is run by hand, figures in docs/benchmarks.md.)"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_skipped_with_a_clear_line_without_llama_cpp(tmp_path) -> None:
    # a sitecustomize that makes `import llama_cpp` fail, as on a machine without the extra
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['llama_cpp'] = None\n")
    work = tmp_path / "work"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vs_llamacpp.py"), "--work", str(work)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("bench_vs_llamacpp: skipped: llama_cpp is not installed")
    assert not work.exists()
