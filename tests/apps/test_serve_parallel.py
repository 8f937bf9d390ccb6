"""`workbench serve` under torchrun (2 gloo ranks on the CPU): rank 0 serves, every rank runs the same steps,
and the answers equal a single-process server's on the same checkpoint."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from apps.web_guard import HostPolicy
from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from workbench.sessions import load_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conversation(client: openai.OpenAI, model: str) -> list[tuple[str, int]]:
    """Two turns (the second continues the first's state); (text, cached tokens) of each."""
    messages = [{"role": "user", "content": "Ranks in step?"}]
    out = []
    for turn in range(2):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
        out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And {turn}?"}]
    return out


@pytest.mark.slow
def test_rank_zero_serves_and_every_rank_runs_the_same_steps(checkpoint_dir, tmp_path: Path) -> None:
    ckpt = checkpoint_dir("tiny-tp", "k3.1", seed=3)
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "workbench",
           "serve", "--model", str(ckpt), "--port", str(port), "--trace-root", str(tmp_path / "traces")]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in job.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and job.poll() is None, job.stderr.read() if job.poll() else "timeout"
            try:
                if "endpoint:" in lines.get(timeout=0.5):
                    break
            except queue.Empty:
                continue
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        parallel = _conversation(client, str(ckpt))
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(60)
    model, tokenizer = load_with_tokenizer(ckpt)
    single = Server(model, tokenizer, ServeOptions(model_name=str(ckpt)),
                    AppConfig(model_id=str(ckpt), hosts=HostPolicy.for_server("127.0.0.1")), port=0)
    single.start_in_thread()
    try:
        alone = _conversation(openai.OpenAI(base_url=single.url, api_key="x", max_retries=0), str(ckpt))
    finally:
        single.stop()
    assert parallel == alone and parallel[1][1] > 0  # same answers, and turn 2 continued turn 1's state
    (trace,) = (tmp_path / "traces").iterdir()  # rank 0 writes the one conversation's trace
    assert [r["turn"] for r in json.loads((trace / "session.json").read_text())["requests"]] == [1, 2]
