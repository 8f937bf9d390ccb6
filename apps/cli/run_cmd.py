"""`workbench run`: a scripted session that streams generated text to stdout.

Progress of long prefills (tokens done, tokens/s, ETA) and the deployment record go to stderr, so
stdout carries only the generated text.
"""

from __future__ import annotations

import argparse
import codecs
import io
import json
import sys
import time
from pathlib import Path
from typing import Sequence, TextIO

import torch

from apps.cli.model_cmds import DTYPES, add_parallel_args
from apps.cli.run_task import add_task_args, free_form_notice, prepare_task, resolve_card_defaults, run_task
from engine.session.answer import Answer
from engine.errors import InputError
from engine.io.inputs import read_prompt_file
from engine.parallel import ParallelContext, distributed
from engine.session.sampling import SamplingParams
from engine.session import Session
from engine.session.snapshot import check_target as check_snapshot_target
from engine.session.transcript import read_transcript
from workbench import intervene, load_intervention_spec
from workbench.sessions import (AnswerEvent, AnswerText, AnswerToken, RecordedSession, load_with_tokenizer,
                                open_session, recorded_session)
from workbench.signals import families_from_spec
from workbench.task_templates import append_task
from workbench.trace import check_trace_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a session: prefill a prompt and stream generated tokens")
    p.add_argument("--model", required=True, help="checkpoint directory, builtin:demo (the trained demo model) or preset:NAME[:VARIANT] (random weights)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 text file")
    src.add_argument("--messages", type=Path, metavar="CHAT_JSON", help="replay a conversation in the OpenAI messages "
                     "format (a JSON list, or an object with \"messages\"): one segment per message; local images "
                     "must lie in the file's directory")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message and open an assistant turn")
    p.add_argument("--system", metavar="TEXT", help="a system message before the prompt (implies --chat)")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="also end the answer where its text reaches STRING (repeatable; STRING is not printed)")
    p.add_argument("--raw", action="store_true", help="print every generated token, chat tags and thinking "
                   "included (default: the response text only; generation stops where the response ends either way)")
    p.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                   help="an image before the prompt (repeatable, in order; --chat: one user message, images then text)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="most tokens to generate (default: the model card's, 48 for builtin:demo; else 128)")
    p.add_argument("--intervene", type=Path, metavar="SPEC_JSON",
                   help="run with interventions on what the layers read, remember and route: a JSON list such as "
                        '[{"op": "dsa.hide", "segment": "prompt", "layers": "all"}] (engine.interventions)')
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model card's "
                   "generation_config.json, greedy for builtin:demo; 1.0 where the card says nothing)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed = same tokens)")
    p.add_argument("--weights-seed", type=int, default=0, help="weights seed for preset: models")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill step (bounds memory)")
    # dest is not "save": argparse sets a default only where hasattr(namespace, dest) is false, and nnsight
    # (imported in the same process, as in a notebook) mounts a `save` method on every object
    p.add_argument("--save", dest="save_to", type=Path, help="save a snapshot of the session here afterwards")
    p.add_argument("--load", type=Path, help="continue a saved snapshot (the prompt, if any, is appended)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow --save and --trace to replace a snapshot / trace written before (files you added "
                        "there are kept; nothing else is ever replaced)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill progress bar on stderr (default: for prompts of 2K tokens or more, once the "
                        "prefill has run two seconds)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="decode through the compiled step (engine.decode.step): auto = on CUDA only; on a CPU the "
                        "first use compiles for minutes (cached on disk afterwards)")
    p.add_argument("--stats", action="store_true", help="print the deployment record as JSON on stderr")
    p.add_argument("--trace", type=Path, help="record the session into this trace directory")
    p.add_argument("--record", default="all", help="signal families to record: all (default) or a comma list "
                   "of registered families (dsa, kda, moe, and any a plugin registers)")
    p.add_argument("--policy", default="default", help="recording policy: default, all, or a JSON file of fields")
    p.add_argument("--overwrite-trace", action="store_true",
                   help="deprecated: the same as --overwrite for --trace")
    add_task_args(p)
    add_parallel_args(p)
    p.set_defaults(func=cmd_run)


def read_prompt(args: argparse.Namespace) -> str | None:
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)  # regular files only, size-limited, one-line errors
    return args.prompt


def record_families(spec: str) -> tuple[str, ...] | None:
    """`--record`: `all` (every registered family: None) or a comma list of registered families."""
    try:
        return families_from_spec(spec)
    except InputError as exc:
        raise InputError(f"--record: {exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    if args.overwrite_trace:
        print("note: --overwrite-trace is deprecated; use --overwrite", file=sys.stderr)
    prompt = read_prompt(args)
    # read and parsed before the model loads; layers, heads and experts are checked once it has
    args.interventions = [load_intervention_spec(args.intervene)] if args.intervene is not None else []
    args.transcript = read_transcript(args.messages) if args.messages is not None else None  # checked before loading
    args.task_prompt = prepare_task(args, prompt)  # a bad template input fails before the model loads
    card = resolve_card_defaults(args)
    if prompt is None and args.load is None and not args.image and args.transcript is None \
            and args.task_prompt is None:
        raise InputError("give --prompt TEXT or --prompt-file FILE (or --image FILE, or --load SNAPSHOT)")
    if prompt is not None and not prompt:
        raise InputError("the prompt is empty")
    if args.system is not None and not args.system:
        raise InputError("--system is empty")
    if any(not s for s in args.stop):
        raise InputError("--stop takes non-empty text")
    args.notice = free_form_notice(card) if args.task_prompt is None else None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_new_tokens=args.max_new_tokens)
    with distributed(debug_checks=args.check_ranks) as ctx:  # world 1 unless launched by torchrun
        if ctx.world > 1 and (args.save_to or args.load):
            raise InputError("--save/--load snapshots are single-process for now (KDA state is split across ranks)")
        # every rank samples the same token from the same all-gathered logits; rank 0 prints
        return _run(args, prompt, params, ctx)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse unusable output paths before the model is loaded, not after the prefill."""
    if args.save_to is not None:
        check_snapshot_target(args.save_to, overwrite=args.overwrite)
    if args.trace is not None:
        check_trace_target(args.trace, overwrite=overwrite_trace(args))


def overwrite_trace(args: argparse.Namespace) -> bool:
    """`--overwrite` (one flag for every output), or its older trace-only spelling."""
    return args.overwrite or args.overwrite_trace


def write_dashboard_summaries(trace: Path) -> None:
    """Reduce the finished trace for the dashboard now (seconds after a recording that took far longer),
    so its first page reads summaries instead of every part; a failure only costs that speed-up."""
    from workbench.analysis.views.summaries import write_summaries  # the reducers load only here

    started = time.perf_counter()
    try:
        written = write_summaries(trace)
    except Exception as exc:  # noqa: BLE001 - the trace is complete on disk; the dashboard reads it anyway
        print(f"dashboard summaries not written ({type(exc).__name__}: {exc}); the dashboard reads the parts",
              file=sys.stderr)
        return
    if written:
        print(f"dashboard summaries written ({time.perf_counter() - started:.1f} s)", file=sys.stderr)


def stream_answer(run: RecordedSession, params: SamplingParams | None, out: TextIO, *, raw: bool = False,
                  stop_strings: Sequence[str] = (), chat: bool = False, interventions: Sequence = ()) -> Answer:
    """Generate the run's answer (`RecordedSession.answer`, with `interventions` active) and write it to
    `out` as it comes: the response text (every token's text with `raw`), ending where the chat format
    says the response ends or at a stop string. `chat`: when nothing was printed (the model wrote only
    chat tags or thinking), say so on stderr."""
    tokenizer = run.session.tokenizer
    if tokenizer is None:
        raise InputError("this model has no tokenizer files: its output cannot be printed as text")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(event: AnswerEvent) -> None:
        if raw and isinstance(event, AnswerToken):
            text = decoder.decode(tokenizer.encoding.decode_single_token_bytes(event.token.id))
        elif not raw and isinstance(event, AnswerText):
            text = event.text
        else:
            return
        out.write(text)
        out.flush()

    answer = run.answer(params, interventions=interventions, stop_strings=stop_strings, on_event=write)
    out.write((decoder.decode(b"", final=True) if raw else "") + "\n")
    if chat and not raw and not answer.text and answer.hidden_tokens:
        print(f"note: the model wrote no response text ({answer.hidden_tokens} tokens of chat tags or thinking, "
              "not printed); --raw prints every token", file=sys.stderr)
    return answer


def _append_prompt(session: Session, args: argparse.Namespace, prompt: str | None) -> None:
    """The free-form prompt: a replayed conversation, the system turn, the images and the text. A bad
    image fails here, before anything ran (and the trace keeps what it has)."""
    if args.transcript is not None:
        session.append_messages(args.transcript)
    if args.system is not None:
        session.append(args.system, role="system", name="system")
    chat = args.chat or args.system is not None
    if chat and (args.image or prompt is not None):  # one user message: the images, then the text
        session.append_message("user", prompt, images=args.image, image_names=[p.name for p in args.image],
                               name="prompt")
    else:
        for path in args.image:
            session.append(image=path, name=path.name)
        if prompt is not None:
            session.append(prompt, name="prompt")


def _no_tower(prepared) -> None:
    """A rehearsal's stand-in for the image tower: the image is checked and its tokens counted, not encoded."""
    prepared.embeds = torch.zeros(0)


def rehearse(args: argparse.Namespace, prompt: str | None, model, tokenizer) -> None:
    """Lay the run's prompt out in a scratch session of the loaded model (no forward runs, no image goes
    through the tower) and resolve the interventions against its segments: a prompt past the context
    limit, a bad image, a bad template input or an intervention the model cannot run (a ban that leaves a
    token too few experts) is refused here, before the trace directory exists."""
    scratch = open_session(model, tokenizer, model_name=str(args.model), prefill_chunk=args.prefill_chunk,
                           progress=False, snapshot=args.load)
    scratch._run_tower = _no_tower  # this session is never run: its images need no embeddings
    if args.task_prompt is not None:
        append_task(scratch, args.task_prompt, images=args.image or None,
                    image_names=[path.name for path in args.image] or None)
        return
    _append_prompt(scratch, args, prompt)
    with intervene(scratch, *args.interventions):
        pass


def _run(args: argparse.Namespace, prompt: str | None, params: SamplingParams, ctx: ParallelContext) -> int:
    families = record_families(args.record) if args.trace is not None else None
    if ctx.is_leader:
        check_outputs(args)
    model, tokenizer = load_with_tokenizer(args.model, dtype=DTYPES[args.dtype], seed=args.weights_seed, parallel=ctx,
                                           device=ctx.device)
    rehearse(args, prompt, model, tokenizer)
    with recorded_session(args.model, args.trace, snapshot=args.load, prefill_chunk=args.prefill_chunk,
                          progress=args.progress if ctx.is_leader else False, policy=args.policy, families=families,
                          overwrite=overwrite_trace(args), loader=lambda ref: (model, tokenizer)) as run:
        session = run.session
        session.model.runtime.compile = {"auto": "auto", "on": True, "off": False}[args.compile]
        out = sys.stdout if ctx.is_leader else io.StringIO()
        if args.task_prompt is not None:
            run_task(session, args.task_prompt, args, out, notes=ctx.is_leader)
        else:
            _append_prompt(session, args, prompt)
            if args.notice and ctx.is_leader:  # once, before the answer: what this model can and cannot answer
                print(args.notice, file=sys.stderr, flush=True)
            # interventions after the prompt: segment names resolve to the prompt's segments
            stream_answer(run, params, out, raw=args.raw, stop_strings=args.stop, interventions=args.interventions,
                          chat=(args.chat or args.system is not None) and ctx.is_leader)
    if args.trace is not None and ctx.is_leader:
        print(f"trace written to {args.trace}", file=sys.stderr)
        write_dashboard_summaries(args.trace)
    if args.save_to is not None:
        session.save(args.save_to, overwrite=args.overwrite)
        print(f"saved snapshot to {args.save_to}", file=sys.stderr)
    if not ctx.is_leader:
        return 0
    dep = session.deployment
    if args.stats:
        print(json.dumps(dep.to_json(), indent=1), file=sys.stderr)
    else:
        tps = f"{dep.tokens_per_s:.1f} tok/s" if dep.tokens_per_s else "n/a"
        ttft = f"{dep.ttft_s:.3f}s" if dep.ttft_s is not None else "n/a"
        print(f"[{dep.prompt_tokens} prompt + {dep.output_tokens} generated tokens; TTFT {ttft}; decode {tps}; "
              f"peak RSS {dep.peak_memory_bytes / 2**20:.0f} MiB]", file=sys.stderr)
    return 0
