"""Fixtures for the dashboard tests: small synthetic traces (no model), one with hostile token text."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3testing.synthetic import Dims, Policy, write_synthetic_trace

SMALL_POLICY = Policy(prefill_chunk=1024, dsa_prefill_stride=256, dense_mass_stride=512, moe_window_every=1024,
                      decode_tokens=256, decode_flush_every=16)
# the dashboard's summary cache is a temporary directory for every test (tests/conftest.py)

HOSTILE = ["<script>window.__k3wb_pwned = 1</script>", "<img src=x onerror=\"window.__k3wb_pwned=2\">", "&amp;"]


def write_token_text(trace: Path, texts: dict[int, str]) -> None:
    """Replace the shown text of the tokens at these positions (negative: from the end) in `trace`'s token table."""
    tokens = pq.read_table(trace / "tokens.parquet")
    pieces = tokens["piece"].to_pylist()
    for position, text in texts.items():
        pieces[position] = text
    tokens = tokens.set_column(tokens.column_names.index("piece"), "piece", pa.array(pieces, pa.string()))
    pq.write_table(tokens, trace / "tokens.parquet")


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete 8K-token synthetic trace at demo dims (image segment, generated answer)."""
    return write_synthetic_trace(tmp_path_factory.mktemp("traces") / "small", 8192, Dims.demo(), SMALL_POLICY)


@pytest.fixture(scope="session")
def hostile_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like `small_trace`, but some generated tokens and a document name carry HTML/JS."""
    path = write_synthetic_trace(tmp_path_factory.mktemp("traces") / "hostile", 4096, Dims.demo(), SMALL_POLICY)
    write_token_text(path, {-10 + i: text for i, text in enumerate(HOSTILE)})
    return path


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run the tiny models here on one thread: on a busy 2-core machine two OpenMP threads can make a
    tiny-preset session 100x slower (barrier stalls), and these models are too small to gain from two."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Where tests leave screenshots and measurements: $K3WB_ARTIFACTS, else the test's tmp dir."""
    out = Path(os.environ.get("K3WB_ARTIFACTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out


def record_image_session(path: Path, new_tokens: int = 10) -> Path:
    """A real tiny-preset session: a document, a Pillow chart (the vision tower runs), a question, an answer."""
    import workbench
    from workbench.sessions import recorded_session

    with recorded_session("preset:tiny", path, prefill_chunk=256, progress=False) as run:
        session = run.session
        session.append(workbench.haystack(300, session.tokenizer, seed=1), name="report")
        session.append(image=workbench.chart_picture(), name="chart.png")
        session.append("Which pier unloaded the most crates?", role="user")
        list(session.generate(new_tokens, temperature=0.0))
    return path


@pytest.fixture(scope="session")
def image_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recorded tiny-preset trace with a real image segment (see `record_image_session`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return record_image_session(tmp_path_factory.mktemp("traces") / "image")
    finally:
        torch.set_num_threads(before)
