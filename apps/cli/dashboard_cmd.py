"""`workbench dashboard`: serve the live dashboard (Panel) on a trace directory or a driven session.

    workbench dashboard --trace traces/run1            # follow a trace (finished, or being written elsewhere)
    workbench dashboard --model preset:demo            # drive sessions from the browser
    workbench dashboard --host 0.0.0.0 --port 5006     # reachable from other machines: needs the printed token
    workbench dashboard --trace traces/a --compare traces/b   # two traces side by side + DSA difference view

The server binds to 127.0.0.1 unless told otherwise; any other host gets a random access token that
every URL must carry (`?token=...`). Every request must be addressed (`Host`, and `Origin` when sent)
to a loopback name, `--host` or an `--allow-host` name: a web page under another name is refused. `?trace=NAME` picks a trace inside `--root` only; `&compare=NAME`
(inside `--root` too) shows a second trace beside it.
Panel is imported only when this command runs, so the other commands start without it.
"""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from engine.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="serve the live memory-inspector dashboard")
    p.add_argument("--model", help="checkpoint directory, builtin:demo or preset:NAME offered first in drive mode (default builtin:demo)")
    p.add_argument("--trace", type=Path, help="trace directory to follow (it may still be being written)")
    p.add_argument("--compare", type=Path, help="a second trace shown beside --trace (same layout) with a DSA "
                   "difference view, e.g. the two traces of `workbench compare`; drive mode is off then")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)")
    p.add_argument("--port", type=int, default=5006)
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests addressed to this host name (repeatable); any name other than the "
                   "loopback names, --host and these is refused, so a web page cannot reach the dashboard")
    p.add_argument("--root", type=Path, help="the only directory tree ?trace= may point into; driven sessions are "
                   "recorded here (default: the parent of --trace, else ./traces)")
    p.add_argument("--no-drive", action="store_true", help="hide the drive-mode controls (follow only)")
    p.add_argument("--show", action=argparse.BooleanOptionalAction, default=False,
                   help="open the dashboard in a browser (default --no-show: print the URL only)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for driven sessions (default 1: on a "
                   "busy or shared machine more threads can stall in OpenMP barriers)")
    p.set_defaults(func=cmd_dashboard)


def dashboard_config(args: argparse.Namespace):
    """A `DashboardConfig` from the command-line arguments (validated; raises InputError)."""
    from apps.dashboard.app import DashboardConfig

    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    root = args.root if args.root is not None else (args.trace.parent if args.trace is not None else Path("traces"))
    if root.exists() and not root.is_dir():
        raise InputError(f"--root {root} is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    compare = getattr(args, "compare", None)
    if compare is not None:
        if args.trace is None:
            raise InputError("--compare needs --trace: the trace to compare it with")
        if compare.resolve() == args.trace.resolve():
            raise InputError("--compare names the same directory as --trace; pick two different traces")
    return DashboardConfig(trace=args.trace, compare=compare, model=args.model, root=root, host=args.host,
                           port=args.port, drive=not args.no_drive and compare is None,
                           allow_hosts=allowed_hosts(getattr(args, "allow_host", None) or []))


def allowed_hosts(names: list[str]) -> tuple[str, ...]:
    """`--allow-host` values as bare names (raises InputError naming a malformed one)."""
    from apps.dashboard.host_guard import normalise_allowed

    try:
        return tuple(normalise_allowed(n) for n in names)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def cmd_dashboard(args: argparse.Namespace) -> int:
    from apps.dashboard.app import serve, url
    from apps.dashboard.security import is_local

    config = dashboard_config(args)
    if args.threads < 1:
        raise InputError("--threads must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    for given in (args.trace, config.compare):
        if given is not None and not given.exists():
            print(f"note: {given} does not exist yet; the dashboard will wait for it")
    try:
        server = serve(config, show=False, start=False)  # binds the port
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"port {config.port} on {config.host} is already in use; choose another with --port") \
                from None
        raise InputError(f"cannot serve on {config.host}:{config.port}: {exc.strerror or exc}") from None
    print(f"K3 Workbench dashboard: {url(config)}", flush=True)
    if not is_local(config.host):
        print(f"access token (required in every URL as ?token=...): {config.token}", flush=True)
    if args.show:
        import webbrowser

        webbrowser.open(url(config))
    server.start()
    server.io_loop.start()
    return 0
