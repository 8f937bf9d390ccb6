"""`workbench demo`: the README's main job, end to end on a fresh machine.

1. Create (or reuse) the demo checkpoint: K3.1 architecture at demo size, random weights (the real
   weights cannot be downloaded here, so the model's answer is noise; the point is the inspector).
2. Build a long multi-document chat context (default 32K tokens) with a planted fact (the needle)
   and a question about it at the end.
3. Serve the dashboard on the trace directory, print its URL (and open a browser unless
   --no-browser), then run the session under `workbench.record(...)`: prefill progress, the memory
   maps and the generated answer appear live.
4. Print which DSA layers read the needle while the model answered, and keep serving until Ctrl-C.

`--headless` records and exports only (Parquet, next to the trace), without a server: for CI.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

from engine.errors import InputError
from engine.presets import get_preset
from engine.weights.write import write_checkpoint

DEFAULT_DIR = Path("checkpoints/demo")
DEFAULT_TRACE = Path("traces/demo")
NEEDLE = "The code that opens the archive vault is 4-7-1-9, and only the night curator knows it."
QUESTION = "What is the code that opens the archive vault? Answer with the digits only."
MIN_TOKENS = 256

_TOPICS = ["harbour logistics", "glacier survey", "orchard irrigation", "tram maintenance", "library archive",
           "radio observatory", "textile mill", "ferry timetable"]
_SUBJECTS = ["The inspector", "A technician", "The night shift", "The committee", "Our survey team", "The archivist",
             "A visiting engineer", "The ledger"]
_VERBS = ["recorded", "measured", "noted", "replaced", "catalogued", "compared", "reviewed", "estimated"]
_OBJECTS = ["the pressure in valve {n}", "{n} crates of spare parts", "the drift of sensor {n}",
            "the temperature at gate {n}", "shelf {n} of the east wing", "the delay on line {n}",
            "the load on crane {n}", "the reading of meter {n}"]
_TAILS = ["before noon.", "after the storm.", "during the audit.", "on the second day.", "without incident.",
          "as scheduled.", "for the quarterly report.", "twice, to be sure."]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: recorded long-context session on the demo checkpoint + dashboard")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_DIR, help="where the demo checkpoint lives")
    p.add_argument("--tokens", type=int, default=32768, help="context size in tokens (default 32768)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens the model generates for its answer")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace directory (replaced if it holds a trace)")
    p.add_argument("--port", type=int, default=5006)
    p.add_argument("--no-browser", action="store_true", help="print the URL but do not open a browser")
    p.add_argument("--headless", action="store_true", help="record and export only: no server (CI)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill step (live update grain)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on a busy or shared "
                   "machine more threads can stall in OpenMP barriers; raise it on a dedicated one)")
    p.set_defaults(func=cmd_demo)


def ensure_demo_checkpoint(path: Path) -> Path:
    """Create the demo checkpoint on first use; reuse it afterwards."""
    if not (path / "config.json").exists():
        print(f"writing the demo checkpoint to {path} (first run only) ...", flush=True)
        write_checkpoint(get_preset("demo"), path, seed=0, shards=2, overwrite=True)
    return path


def _sentence(rng: random.Random, topic: str) -> str:
    obj = rng.choice(_OBJECTS).format(n=rng.randint(2, 999))
    return f"{rng.choice(_SUBJECTS)} of the {topic} {rng.choice(_VERBS)} {obj} {rng.choice(_TAILS)} "


def build_documents(tokens: int, count_tokens, seed: int = 0) -> tuple[list[tuple[str, str]], int, int]:
    """Documents filling about `tokens` tokens, the needle planted at ~40% of the second one.

    Returns (documents as (name, text), index of the needle's document, character offset of the needle).
    `count_tokens(text)` measures text in the model's tokenizer.
    """
    rng = random.Random(seed)
    n_docs = 4 if tokens >= 4096 else 2
    budget = max(tokens // n_docs, 64)
    docs: list[tuple[str, str]] = []
    needle_doc, needle_at = 1, 0
    for i in range(n_docs):
        topic = _TOPICS[i % len(_TOPICS)]
        parts: list[str] = [f"{topic.title()} notes, volume {i + 1}.\n"]
        size, planted = count_tokens(parts[0]), i != needle_doc
        while size < budget:
            if not planted and size >= 0.4 * budget:
                needle_at = sum(len(p) for p in parts)
                parts.append(NEEDLE + " ")
                size += count_tokens(NEEDLE + " ")
                planted = True
            s = _sentence(rng, topic)
            parts.append(s)
            size += count_tokens(s)
        docs.append((f"{topic.replace(' ', '-')}-{i + 1}.txt", "".join(parts)))
    return docs, needle_doc, needle_at


def record_demo(checkpoint: Path, trace: Path, tokens: int, new_tokens: int, prefill_chunk: int) -> dict:
    """Run the demo session under `workbench.record` into `trace`; returns what the demo found."""
    import workbench
    from workbench.analysis import layers_reading
    from workbench.sessions import recorded_session

    print(f"loading {checkpoint} ...", flush=True)
    with recorded_session(checkpoint, trace, prefill_chunk=prefill_chunk, progress=True, overwrite=True) as run:
        session, tokenizer = run.session, run.session.tokenizer
        system = "You are a careful reader. Answer questions about the documents exactly."
        docs, needle_doc, needle_at = build_documents(tokens, lambda t: len(tokenizer.encode(t)))
        started = time.perf_counter()
        session.append(system, role="system", name="system")
        needle = (0, 0)
        for i, (name, text) in enumerate(docs):
            seg = session.append(text, name=name)
            if i == needle_doc:
                start = seg.start + len(tokenizer.encode(text[:needle_at]))
                needle = (start, start + len(tokenizer.encode(NEEDLE)))
        # an image among the documents (the tower runs on it): the DSA map draws what the answer read in it
        if session.model.vision is not None:
            session.append(image=workbench.chart_picture(), name="chart.png")
        else:
            print(f"no image in this demo: {session.model.vision_unavailable}", flush=True)
        session.append(QUESTION, role="user", name="question")
        run.recorder.writer.update_session(demo={"needle": list(needle), "needle_text": NEEDLE, "question": QUESTION})
        print(f"context: {len(session.tokens):,} tokens in {len(session.segments)} segments; "
              f"needle at positions [{needle[0]}, {needle[1]})", flush=True)
        answer = [tok.text for tok in session.generate(max_new_tokens=new_tokens, temperature=0)]
    elapsed = time.perf_counter() - started
    trace_obj = workbench.open_trace(trace)
    gen = [s for s in trace_obj.segments().itertuples() if s.kind == "generated"]
    queries = (int(gen[-1].start), int(gen[-1].end) - 1) if gen else None
    readers = layers_reading(trace_obj.df("dsa_topk"), needle[0], needle[1], queries=queries)
    return {"answer": "".join(answer), "needle": needle, "seconds": elapsed, "tokens": len(session.tokens),
            "readers": readers}


def _report(found: dict) -> None:
    print(f"recorded {found['tokens']:,} tokens in {found['seconds']:.0f} s; answer (random weights, so noise): "
          f"{found['answer']!r}")
    readers = found["readers"]
    reading = readers[readers["queries_reading"] > 0]
    if len(reading):
        print("DSA layers that read the needle while answering (share of answer tokens, nearest distance):")
        for r in reading.itertuples():
            print(f"  layer {r.layer}: {r.read_share:.0%} of {r.queries} answer tokens, {r.distance_min} tokens back")
    else:
        print("no DSA layer selected the needle's tokens while answering (random weights rarely do)")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.tokens < MIN_TOKENS:
        raise InputError(f"--tokens must be at least {MIN_TOKENS}")
    if args.threads < 1:
        raise InputError("--threads must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    trace = args.trace
    if trace.exists():
        if not (trace / "session.json").is_file():
            raise InputError(f"{trace} exists and is not a trace; choose another --trace")
        # start from an empty directory so a follower never mixes the old run's parts with the new ones
        shutil.rmtree(trace)
    checkpoint = ensure_demo_checkpoint(args.checkpoint)
    if args.headless:
        from workbench.trace.export import export_trace

        found = record_demo(checkpoint, trace, args.tokens, args.new_tokens, args.prefill_chunk)
        _report(found)
        out = trace.with_name(trace.name + "-export")
        export_trace(trace, out, "parquet", overwrite=True)
        print(f"trace: {trace}\nexport (Parquet): {out}")
        return 0
    from apps.dashboard.app import DashboardConfig, serve, url

    trace.parent.mkdir(parents=True, exist_ok=True)
    config = DashboardConfig(trace=trace, root=trace.parent, port=args.port, model=str(checkpoint))
    server = serve(config, threaded=True)
    link = url(config)
    print(f"K3 Workbench dashboard: {link}  (Ctrl-C to stop)", flush=True)
    if not args.no_browser:
        import webbrowser

        webbrowser.open(link)
    found = record_demo(checkpoint, trace, args.tokens, args.new_tokens, args.prefill_chunk)
    _report(found)
    print(f"still serving {link}; Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
    finally:
        server.stop()
    return 0
