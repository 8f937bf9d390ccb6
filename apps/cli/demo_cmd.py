"""`workbench demo`: the README's main job, end to end on a fresh machine.

1. Load the trained demo model (`builtin:demo`: the K3.1 architecture at demo size, trained on
   generated retrieval tasks; `--model preset:demo` writes and runs random weights instead).
2. Build a long multi-document chat context (default 32K tokens) with a planted passcode (the
   needle) and a question about it, in the trained model's own task wording
   (`workbench.retrieval_text`; `--wording held-out` uses wording it never saw).
3. Serve the dashboard on the trace directory, print its URL (and open a browser unless
   --no-show), then run the session under `workbench.record(...)`: prefill progress, the memory
   maps and the generated answer appear live.
4. Print the answer, whether it is right, and which DSA layers read the needle for the answer
   tokens beside their chance baselines; then the causal check (`workbench.causal.demo_check`): the answer
   rerun from the shared prefix with the needle (the picture) hidden from its top reading DSA layer,
   from every DSA layer, and a same-size random span hidden as the control; keep serving until Ctrl-C.

`--headless` records and exports only (Parquet, next to the trace), without a server: for CI.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InputError
from engine.model_ref import DEFAULT_MODEL
from engine.session.answer import generate_answer
from engine.presets import get_preset
from engine.weights.write import write_checkpoint
from workbench.retrieval_text import HELD_OUT, TRAIN, World, answer_prefix, answer_style_of, filler, response_value
from workbench.trace import check_trace_target

DEFAULT_DIR = Path("checkpoints/demo")
DEFAULT_TRACE = Path("traces/demo")
MIN_TOKENS = 256
# long enough that a DSA layer's reads of the needle stand far above what chance picks give, short
# enough that the whole demo (recording and causal check) stays within about a minute on one CPU thread
DEFAULT_TOKENS = 32768
# the context is built in memory as text before the model sees it: bounded by the demo model's context
MAX_TOKENS = 1 << 20
# the passcode the demo plants; 4 dash-separated digits is one of the trained value formats
PASSCODE = "4-7-1-9"
_TOPICS = ["harbour logistics", "glacier survey", "orchard irrigation", "tram maintenance", "library archive",
           "radio observatory", "textile mill", "ferry timetable"]


@dataclass(frozen=True)
class Wording:
    """The demo's system turn, needle and question, in one world of the trained model's tasks."""

    world: World
    key: str
    system: str
    needle: str
    question: str


def wording(name: str = "train") -> Wording:
    """`train`: the trained model's own templates (workbench.retrieval_text.TRAIN); `held-out`: wording,
    key and filler it never saw (HELD_OUT), which shows whether retrieval generalises."""
    world = {"train": TRAIN, "held-out": HELD_OUT}[name]
    key = "hidden cellar" if name == "train" else "polar vault"
    t = 4 if name == "train" else 0     # TRAIN: "The code that opens the {k} is {v}." / its question
    return Wording(world, key, world.systems[0], world.needles[t].format(k=key, v=PASSCODE),
                   world.needle_questions[t].format(k=key))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: recorded long-context session on the demo checkpoint + dashboard")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model to run (default builtin:demo, the trained demo "
                   "model; preset:demo writes a random-weight checkpoint to --checkpoint; or a checkpoint directory)")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_DIR,
                   help="where --model preset:demo's random-weight checkpoint is written (first run only)")
    p.add_argument("--wording", choices=("train", "held-out"), default="train", help="needle and question in the "
                   "trained model's own wording (train) or in wording it never saw (held-out)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="context size in tokens (default 32768: long "
                   "enough that the layers' reads of the needle stand far above chance, see its MODEL_CARD.md for "
                   "where retrieval holds)")
    p.add_argument("--new-tokens", type=int, default=64, help="most tokens the model generates for its answer "
                   "(the response restates the key and takes ~40 byte tokens of scaffold; generation stops at the end of the message)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace directory (replaced if it holds a trace)")
    p.add_argument("--port", type=int, default=5006)
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer dashboard requests addressed to this host name (repeatable); others are refused")
    p.add_argument("--show", action=argparse.BooleanOptionalAction, default=True,
                   help="open the dashboard in a browser (default; --no-show prints the URL only)")
    p.add_argument("--no-browser", dest="show", action="store_false", help=argparse.SUPPRESS)  # older spelling
    p.add_argument("--headless", action="store_true", help="record and export only: no server (CI)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill step (live update grain)")
    p.add_argument("--causal-check", action=argparse.BooleanOptionalAction, default=True,
                   help="after each answer, rerun it from the shared prefix with the needle (the picture) hidden "
                   "from its top reading DSA layer, from every DSA layer, and a same-size random span hidden "
                   "(the control); --no-causal-check skips it")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on a busy or shared "
                   "machine more threads can stall in OpenMP barriers; raise it on a dedicated one)")
    p.set_defaults(func=cmd_demo)


def ensure_demo_checkpoint(path: Path) -> Path:
    """Create the random-weight demo checkpoint (preset:demo) on first use; reuse it afterwards."""
    if not (path / "config.json").exists():
        print(f"writing the random-weight demo checkpoint to {path} (first run only) ...", flush=True)
        write_checkpoint(get_preset("demo"), path, seed=0, shards=2, overwrite=True)
    return path


def demo_model(model: str, checkpoint: Path) -> str | Path:
    """The model reference the session loads: `preset:demo` becomes its written checkpoint directory
    (so the dashboard and the trace name a real checkpoint); anything else is passed on."""
    return ensure_demo_checkpoint(checkpoint) if model == "preset:demo" else model


def build_documents(tokens: int, count_tokens, seed: int = 0, words: Wording | None = None,
                    ) -> tuple[list[tuple[str, str]], int, int]:
    """Documents of the wording's filler filling about `tokens` tokens, the needle planted at ~40% of
    the second one (sentence-aligned, as in training).

    Returns (documents as (name, text), index of the needle's document, character offset of the needle).
    `count_tokens(text)` measures text in the model's tokenizer.
    """
    words = words or wording()
    rng = random.Random(seed)
    n_docs = 4 if tokens >= 4096 else 2
    budget = max(tokens // n_docs, 64)
    docs: list[tuple[str, str]] = []
    needle_doc, needle_at = 1, 0
    for i in range(n_docs):
        text = filler(words.world, rng, budget)
        # the filler is measured in bytes; trim it to the token budget at a sentence end
        while count_tokens(text) > budget and ". " in text[:-2]:
            text = text[: text.rindex(". ", 0, len(text) - 2) + 2]
        if i == needle_doc:
            cut = text.find(". ", int(0.4 * len(text)))
            needle_at = cut + 2 if cut >= 0 else len(text)
            text = text[:needle_at] + words.needle + text[needle_at:]
        docs.append((f"{_TOPICS[i % len(_TOPICS)].replace(' ', '-')}-{i + 1}.txt", text))
    return docs, needle_doc, needle_at


def answer_queries(pieces: list[str], first: int, value: str, prefilled: bool = False) -> tuple[int, int] | None:
    """Inclusive query positions of the answer tokens (query t predicts token t + 1): those that produced
    `value` when the response holds it, else those that produced the response's text; None when the
    generated turn has no response text (then the caller counts every generated token).

    Generated token i sits at position `first + i`. `prefilled`: the prompt already opened the
    response (and restated the key), so the generated text is the rest of the response.
    """
    text = "".join(pieces)
    head = "<|open|>response<|sep|>"
    at = -len(head) if prefilled else text.find(head)
    if at < 0 and not prefilled:
        return None
    lo = at + len(head)
    close = text.find("<|close|>", lo)
    hi = close if close >= 0 else len(text)
    found = text.find(value, lo, hi)
    if found >= 0:
        lo, hi = found, found + len(value)
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    toks = [i for i, s in enumerate(starts) if lo <= s < hi]
    if not toks:
        return None
    return first + toks[0] - 1, first + toks[-1] - 1


def record_demo(model: str | Path, trace: Path, tokens: int, new_tokens: int, prefill_chunk: int,
                words: Wording | None = None, causal: bool = False) -> dict:
    """Run the demo session under `workbench.record` into `trace`; returns what the demo found
    (with `causal`, also each answer's causal check under "causal", run after the recording closes so
    that its branches are not recorded)."""
    import workbench
    from workbench.sessions import recorded_session

    words = words or wording()
    print(f"loading {model} ...", flush=True)
    with recorded_session(model, trace, prefill_chunk=prefill_chunk, progress=True, overwrite=True) as run:
        session, tokenizer = run.session, run.session.tokenizer
        docs, needle_doc, needle_at = build_documents(tokens, lambda t: len(tokenizer.encode(t)), words=words)
        started = time.perf_counter()
        session.append(words.system, role="system", name="system")
        needle = (0, 0)
        documents = []
        for i, (name, text) in enumerate(docs):
            seg = session.append(text, name=name)
            documents.append((seg.start, seg.end))
            if i == needle_doc:
                start = seg.start + len(tokenizer.encode(text[:needle_at]))
                needle = (start, start + len(tokenizer.encode(words.needle)))
        # a picture among the documents, in a user message as sessions (and the model's training) hold
        # one: the tower runs on it, the DSA map draws what each answer token read in it
        picture = demo_picture() if session.model.vision_unavailable is None else None
        image = None
        if picture is not None:
            seg = session.append(image=picture.image, name="picture.png", role="user")
            image = (seg.image["token_start"], seg.image["token_end"])   # the picture's own positions
        else:
            print(f"no image in this demo: {session.model.vision_unavailable}", flush=True)
        run.recorder.writer.update_session(demo={"needle": list(needle), "needle_text": words.needle,
                                                 "question": words.question, "expected": PASSCODE})
        print(f"context: {len(session.tokens):,} tokens in {len(session.segments)} segments; "
              f"needle at positions [{needle[0]}, {needle[1]})", flush=True)
        bases = {}
        if causal:  # the shared prefix of the checks: the context prefilled once, forked before each question
            session.prefill()
            bases["needle"] = session.fork()
        style = answer_style_of(model)
        needle_answer = _ask(session, words.question, words.key, new_tokens, "question", style)
        image_answer = None
        if picture is not None:
            _close_answer(session, needle_answer)
            if causal:
                bases["picture"] = session.fork()
            image_answer = _ask(session, IMAGE_QUESTION, IMAGE_ATTRIBUTE, new_tokens, "image question")
    elapsed = time.perf_counter() - started
    topk = workbench.open_trace(trace).df("dsa_topk")
    found = _judge(needle_answer, PASSCODE, topk, needle)
    found.update(needle=needle, seconds=elapsed, tokens=len(session.tokens))
    if image_answer is not None and image is not None:
        found["image"] = {**_judge(image_answer, picture.attributes[IMAGE_ATTRIBUTE], topk, image), "span": image}
    if causal:
        from workbench.causal.demo_check import causal_check

        region = (documents[0][0], documents[-1][1])
        found["causal"] = [causal_check(bases["needle"], subject="needle", question=words.question, key=words.key,
                                        style=style, expected=PASSCODE, span=needle, region=region,
                                        readers=found["readers"])]
        if "image" in found:
            found["causal"].append(causal_check(bases["picture"], subject="picture", question=IMAGE_QUESTION,
                                                key=IMAGE_ATTRIBUTE, style="key", expected=found["image"]["expected"],
                                                span=image, region=region, readers=found["image"]["readers"]))
        found["causal_seconds"] = time.perf_counter() - started - elapsed
        from workbench.causal.demo_check import effects_rows
        from workbench.trace.effects_table import write_effects

        # `workbench questions` answers "which memory did the answer depend on?" from these rows
        write_effects(trace, [row for check in found["causal"] for row in effects_rows(check)])
    return found


# the demo's picture and the question asked about it (one of the trained model's image questions)
IMAGE_QUESTION, IMAGE_ATTRIBUTE = "What colour is the shape?", "colour"


def demo_picture():
    """A red circle at the left of a 64 x 64 picture (`workbench.draw_shape`, fixed seed): the kind of
    picture the trained demo model answers questions about."""
    import workbench

    return workbench.draw_shape(random.Random(7), 64, shape="circle", colour="red", position="left")


@dataclass
class _Answer:
    prefix: str          # the response's prefilled start (the restated key)
    style: str           # the answer style (`workbench.retrieval_text.answer_parts`)
    pieces: list[str]    # the generated tokens' text
    first: int           # position of the first generated token
    closing: list[int]   # ids that end the assistant message the answer is in (`engine.session.answer`)


def _ask(session, question: str, key: str, new_tokens: int, name: str, style: str = "key") -> _Answer:
    """Ask `question` as a user turn and generate the answer greedily after a response prefilled
    with the key (`key: ` for a model answering `key: value`, the key alone for one quoting the
    document from the key through the value: `answer_parts`), up to the response's `<|close|>`."""
    tokenizer = session.tokenizer
    session.append(question, role="user", name=name)
    prefix = answer_prefix(style, key)
    session.append(ids=tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(prefix),
                   name=f"{name} answer prefix", kind="turn", role="assistant")
    pieces: list[str] = []  # each token's text: the judge finds which tokens produced the value
    answer = generate_answer(session, max_new_tokens=new_tokens, temperature=0, add_generation_prompt=False,
                             stop_ids=(tokenizer.close_id,), on_token=lambda tok: pieces.append(tok.text))
    return _Answer(prefix, style, pieces, len(session.tokens) - len(pieces), answer.closing_ids)


def _close_answer(session, answer: _Answer) -> None:
    """End the assistant message the answer is in (after its `<|close|>`: `response<|sep|><|close|>message
    <|sep|><|end_of_msg|>`), so the next question is a turn of its own, as in training."""
    session.append(ids=answer.closing, name="answer end", kind="turn", role="assistant")


def _judge(answer: _Answer, expected: str, topk, span: tuple[int, int]) -> dict:
    """The response, whether its value is `expected`, and which DSA layers read `span` for the answer
    tokens (those that produced the value, else every generated token's) beside chance."""
    from workbench.analysis import layers_reading

    queries = (answer_queries(answer.pieces, answer.first, expected, prefilled=True)
               or ((answer.first - 1, answer.first + len(answer.pieces) - 2) if answer.pieces else None))
    text = "".join(answer.pieces)
    closed = "<|close|>" in text       # the response section ended, as the format requires
    response = answer.prefix + text.split("<|close|>", 1)[0]
    return {"answer": response, "scaffold_ok": closed, "correct": closed and response_value(response, answer.style) == expected,
            "expected": expected, "readers": layers_reading(topk, span[0], span[1], queries=queries)}


def report_lines(found: dict) -> list[str]:
    """The demo's report: the answer, whether it is right, and which DSA layers read the needle for the
    answer tokens beside what uniformly random selections would give (chance and ratio); the same for
    the question about the picture when the model has a vision tower."""
    lines = _answer_lines(found, "answer", "the passcode is", "the needle")
    if "image" in found:
        lines += _answer_lines(found["image"], "image answer", "the picture shows", "the picture")
    if found.get("causal"):
        from workbench.causal.demo_check import check_lines

        for check in found["causal"]:
            lines += check_lines(check)
    return lines


def _answer_lines(found: dict, label: str, truth: str, span: str) -> list[str]:
    verdict = "right" if found["correct"] else f"wrong ({truth} {found['expected']})"
    shown = found["answer"] if found["scaffold_ok"] else f"{found['answer']!r} (no response section)"
    lines = [f"{label}: {shown} - {verdict}"]
    readers = found["readers"]
    if not len(readers):
        return lines + [f"no DSA selections were recorded for the {label} tokens"]
    lines.append(f"DSA layers reading {span} for the {label} tokens (chance: uniformly random top-k picks):")
    for r in readers.sort_values("ratio", ascending=False, na_position="last").itertuples():
        ratio = "n/a" if r.chance <= 0 else f"{r.read_share / r.chance:.1f}x"
        lines.append(f"  layer {r.layer}: {r.read_share:.0%} of {r.queries} {label} tokens read {span}, "
                     f"chance {_pct(r.chance)}, {ratio}")
    return lines


def _pct(p: float) -> str:
    return f"{p * 100:.2g}%" if 0 < p < 0.01 else f"{p * 100:.0f}%"


def _report(found: dict) -> None:
    print(f"recorded {found['tokens']:,} tokens in {found['seconds']:.0f} s"
          + (f"; causal check in {found['causal_seconds']:.0f} s" if "causal_seconds" in found else ""))
    print("\n".join(report_lines(found)), flush=True)


def _check_port_free(port: int) -> None:
    """One line instead of an OSError traceback when the dashboard's port is taken."""
    import errno
    import socket

    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(f"port {port} is already in use; choose another with --port") from None
            raise InputError(f"cannot serve on port {port}: {exc.strerror or exc}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    if not MIN_TOKENS <= args.tokens <= MAX_TOKENS:
        raise InputError(f"--tokens must be in [{MIN_TOKENS}, {MAX_TOKENS}], got {args.tokens}")
    if args.new_tokens < 1:
        raise InputError(f"--new-tokens must be at least 1, got {args.new_tokens}")
    if args.threads < 1:
        raise InputError("--threads must be at least 1")
    from apps.cli.dashboard_cmd import allowed_hosts

    allow_hosts = allowed_hosts(args.allow_host)  # a bad name is refused before anything is recorded
    import torch

    torch.set_num_threads(args.threads)
    if not args.headless:
        _check_port_free(args.port)  # before the session, so a busy port costs no recording
    trace = args.trace
    # the demo replaces only its own trace there (never another directory, nor a trace being recorded);
    # the new recording starts by deleting the old one's parts, so a follower never mixes the two
    check_trace_target(trace, overwrite=True)
    checkpoint = demo_model(args.model, args.checkpoint)
    words = wording(args.wording)
    if args.headless:
        from workbench.trace.export import export_trace

        found = record_demo(checkpoint, trace, args.tokens, args.new_tokens, args.prefill_chunk, words,
                            causal=args.causal_check)
        _report(found)
        out = trace.with_name(trace.name + "-export")
        export_trace(trace, out, "parquet", overwrite=True)
        print(f"trace: {trace}\nexport (Parquet): {out}")
        return 0
    from apps.dashboard.app import DashboardConfig, serve, url

    trace.parent.mkdir(parents=True, exist_ok=True)
    config = DashboardConfig(trace=trace, root=trace.parent, port=args.port, model=str(checkpoint),
                             allow_hosts=allow_hosts)
    try:
        server = serve(config, threaded=True)
    except OSError as exc:
        raise InputError(f"cannot serve the dashboard on port {args.port}: {exc.strerror or exc}; "
                         "choose another with --port") from None
    link = url(config)
    print(f"K3 Workbench dashboard: {link}  (Ctrl-C to stop)", flush=True)
    if args.show:
        import webbrowser

        webbrowser.open(link)
    found = record_demo(checkpoint, trace, args.tokens, args.new_tokens, args.prefill_chunk, words,
                            causal=args.causal_check)
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
