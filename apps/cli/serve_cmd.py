"""`workbench serve`: an OpenAI-compatible endpoint (chat completions) whose every conversation is a trace.

    workbench serve --model builtin:demo --trace-root traces/serve          # http://127.0.0.1:8000/v1
    workbench dashboard --trace traces/serve/conv-0001-...                   # follow one conversation live
    K3WB_API_KEY=... workbench serve --host 0.0.0.0                          # other hosts: a key is required

Bound to 127.0.0.1 unless `--host` says otherwise; any other address needs an API key (from the
environment variable K3WB_API_KEY or `--api-key-file`, never from the command line, where other
users of the machine could read it), which every request must send as `Authorization: Bearer KEY`.
Requests addressed to a name other than the loopback names, `--host` and `--allow-host` are refused.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from apps.cli.model_cmds import DTYPES
from engine.errors import InputError
from engine.model_ref import DEFAULT_MODEL
from engine.io.files import read_limited

KEY_ENV = "K3WB_API_KEY"
MIN_KEY_CHARS = 16


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible API, recording every conversation")
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory, builtin:demo (default) or "
                   "preset:NAME[:VARIANT]")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests addressed to this host name (repeatable)")
    p.add_argument("--api-key-file", type=Path, help=f"file holding the API key (else ${KEY_ENV}); required when "
                   "--host is not a loopback address")
    p.add_argument("--trace-root", type=Path, default=Path("traces/serve"),
                   help="each conversation is recorded into its own trace under this directory")
    p.add_argument("--no-record", action="store_true", help="record nothing")
    p.add_argument("--record", default="all", help="signal families to record: all (default) or a comma list "
                   "of registered families")
    p.add_argument("--otel", default="off", choices=["off", "console", "otlp"],
                   help="an OpenTelemetry span per request (GenAI conventions, linked to its trace): printed (console) "
                        "or sent over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (otlp); default off")
    p.add_argument("--policy", default="default", help="recording policy: default, all, or a JSON file of fields")
    p.add_argument("--image-root", type=Path, help="local image paths in messages are allowed under this directory "
                   "only (default: none; data: URLs always work)")
    p.add_argument("--cache-mib", type=int, default=4096, help="memory budget of the model states kept for prefix "
                   "reuse across turns (least recently used out)")
    p.add_argument("--max-conversations", type=int, default=64, help="conversations kept open for reuse (each "
                   "holds its state and its open trace); the least recently used is closed first")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for the model; more get 429")
    p.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask for")
    p.add_argument("--max-body-mib", type=int, default=64, help="largest request body (images included)")
    p.add_argument("--max-pending-mib", type=int, default=256, help="request bodies being read, waiting or running, "
                   "together (more get 429; at least --max-body-mib)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill step (bounds memory)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--weights-seed", type=int, default=0, help="weights seed for preset: models")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="decode through the compiled step (auto = on CUDA only)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=cmd_serve)


def read_api_key(path: Path | None) -> str | None:
    """The API key from `path` or $K3WB_API_KEY (None when neither is given); checked, never printed."""
    if path is not None:
        raw = read_limited(path, "an API key file", InputError, 4096)
        try:
            key = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise InputError(f"{path}: the API key file is not UTF-8 text") from None
    else:
        key = os.environ.get(KEY_ENV, "").strip()
        if not key:
            return None
    if len(key) < MIN_KEY_CHARS or any(not c.isprintable() or c.isspace() for c in key):
        raise InputError(f"the API key must be at least {MIN_KEY_CHARS} printable characters without spaces")
    return key


def cmd_serve(args: argparse.Namespace) -> int:
    from apps.cli.dashboard_cmd import allowed_hosts
    from apps.cli.run_cmd import record_families
    from apps.web_guard import HostPolicy
    from apps.dashboard.security import is_local
    from workbench import load_policy

    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    for flag in ("cache_mib", "max_conversations", "max_queue", "max_tokens", "max_body_mib", "max_pending_mib",
                 "prefill_chunk"):
        lowest = 0 if flag in ("cache_mib", "max_queue") else 1  # 0: no prefix reuse / no request waits
        if getattr(args, flag) < lowest:
            raise InputError(f"--{flag.replace('_', '-')} must be at least {lowest}")
    key = read_api_key(args.api_key_file)
    if key is None and not is_local(args.host):
        raise InputError(f"--host {args.host} is reachable from other machines: set an API key (${KEY_ENV} or "
                         "--api-key-file); clients send it as Authorization: Bearer KEY")
    if args.image_root is not None and not args.image_root.is_dir():
        raise InputError(f"--image-root {args.image_root} is not a directory")
    families = record_families(args.record)
    policy = load_policy(args.policy)  # an unknown policy is refused now, not by every request
    trace_root = None if args.no_record else args.trace_root
    if trace_root is not None:
        if trace_root.exists() and not trace_root.is_dir():
            raise InputError(f"--trace-root {trace_root} is not a directory")
        trace_root.mkdir(parents=True, exist_ok=True)
    hosts = HostPolicy.for_server(args.host, allowed_hosts(args.allow_host))

    import torch

    from apps.serve.app import AppConfig
    from apps.serve.protocol import parse_chat_request
    from apps.serve.ranks import RankChannel, follow
    from apps.serve.server import Server
    from apps.serve.worker import EngineWorker, ServeOptions
    from engine.parallel import distributed
    from workbench.sessions import load_with_tokenizer
    from workbench.task_templates import card_of

    from apps.serve.telemetry import make_telemetry

    card = card_of(args.model)  # a bad card file is one line now, before the model loads
    telemetry = make_telemetry(args.otel, model=str(args.model), trace_root=trace_root)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    options = ServeOptions(model_name=str(args.model), trace_root=trace_root, policy=policy,
                           families=families, cache_bytes=args.cache_mib << 20, prefill_chunk=args.prefill_chunk,
                           max_queue=args.max_queue, max_conversations=args.max_conversations,
                           open_response=bool(card.tasks), notice=card.notice, telemetry=telemetry)
    config = AppConfig(model_id=str(args.model), hosts=hosts, api_key=key, max_body_bytes=args.max_body_mib << 20,
                       max_tokens=args.max_tokens, image_root=args.image_root,
                       max_pending_bytes=max(args.max_pending_mib, args.max_body_mib) << 20)
    with distributed() as ctx:  # world 1 unless launched by torchrun: then rank 0 serves, every rank runs
        model, tokenizer = load_with_tokenizer(args.model, dtype=DTYPES[args.dtype], seed=args.weights_seed,
                                               parallel=ctx, device=ctx.device)
        model.runtime.compile = {"auto": "auto", "on": True, "off": False}[args.compile]
        channel = RankChannel(ctx)
        if not ctx.is_leader:
            worker = EngineWorker(model, tokenizer, options, channel)
            follow(channel, lambda body, request_id, owner: worker.run_job(parse_chat_request(
                body, max_tokens_limit=config.max_tokens, image_root=config.image_root), request_id, owner))
            return 0
        server = Server(model, tokenizer, options, config, host=args.host, port=args.port, channel=channel)
        world = f", {ctx.world} ranks" if ctx.world > 1 else ""
        print(f"K3 Workbench OpenAI-compatible endpoint: {server.url}  (model {args.model!s}{world})", flush=True)
        if trace_root is not None:
            print(f"conversations are recorded under {trace_root}/ (workbench dashboard --trace {trace_root}/CONV)",
                  flush=True)
        try:
            server.run()
        finally:
            if telemetry is not None:
                telemetry.shutdown()  # the spans still batched are exported before the process ends
    return 0
