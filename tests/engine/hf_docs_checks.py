"""docs/hooks.md's transformers, nnsight and ContextCite examples run as written, in one namespace, and do
what the text says (the needle sentence ranks first)."""

from __future__ import annotations

import re
import runpy
import warnings
from pathlib import Path

import pytest

pytest.importorskip("nnsight")
pytest.importorskip("context_cite")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
SECTION = "## The libraries the field uses"


def test_the_examples_run(tmp_path: Path) -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3
    # a file, not exec of a string: nnsight reads a traced block's source back from its file
    script = tmp_path / "hooks_examples.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        namespace = runpy.run_path(str(script))
    assert namespace["logits"].shape[-1] == 512 and namespace["out"].shape[1] > namespace["ids"].shape[1]
    assert (namespace["resid"] - namespace["layer"]).abs().max() == 0
    assert namespace["top"] == "The code that opens the greenhouse alarm is 3-8-2-5."
