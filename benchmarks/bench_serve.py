"""`workbench serve` against the engine in-process, side by side in one run (the real `openai` client on 127.0.0.1).

1. Server overhead per streamed token: the same greedy decode (the find-fact question about a short
   document, below, `--decode` tokens)
   through `Session.generate` in this process and streamed from the server; per token = the time
   from the first streamed token to the last over the tokens between them. Alternated over
   `--repeats` rounds, best of each kept, so a busy machine biases both alike. The same figure for a
   server that records every conversation (a trace per request) with the integrity checks off
   (`RecordPolicy(health=False)`) and on (the default policy), in the same rounds: the ratios say
   what recording and then integrity add to a streamed token.
2. TTFT of turn 2 with and without prefix reuse: turn 1 asks the find-fact template's question
   (`workbench.task_templates.fact_task`: the trained system line, a `--tokens`-token document
   holding the fact in the trained wording, the trained question), which builtin:demo answers with
   text; turn 2 sends the whole conversation back, reply included, with the question again. With
   reuse, the server continues turn 1's state and prefills only what is new; without (a second
   server keeping no state, `cache_bytes=0`), it prefills every token again. TTFT is measured on
   the client (request sent -> first content chunk).

Every figure is a measurement or the run fails (exit 1, one line saying which): a reply with no
text, a TTFT or per-token time that could not be measured, turn 2 reusing nothing. It never prints
`nan`, and never stands in for a reply the model did not give.

    python benchmarks/bench_serve.py --tokens 32768 --decode 64     # builtin:demo
    python benchmarks/bench_serve.py --model preset:tiny --tokens 2048 --decode 32 --repeats 2   # a quick check

Apart from the recording variants of figure 1, nothing is recorded (the server's `--no-record`), so
both sides run the same work. `--no-reuse` skips figure 2 (the long prefills).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch

from apps.web_guard import HostPolicy
from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from engine.session import Session
from measure import filler_ids
from workbench.recorders.policy import RecordPolicy
from workbench.sessions import load_with_tokenizer
from workbench.task_templates import fact_task

FACT_KEY, FACT_VALUE = "vault code", "4719"
REPLY_TOKENS = 48  # room for the chat scaffold the reply opens with (about 20 tokens), and then its text
SHORT_DOCUMENT = 64  # tokens of the document of the per-token comparison's prompt
CPU_PER_TOKEN: list[float] = []  # in_process's process CPU seconds per token, one entry per call


class BenchFailure(RuntimeError):
    """A figure the run could not measure: the benchmark stops and says which."""


def measured(value: float | None, what: str) -> float:
    """`value` when it is a real measurement (finite, >= 0); BenchFailure naming `what` otherwise."""
    if value is None or not math.isfinite(value) or value < 0:
        raise BenchFailure(f"{what} was not measured (got {value}); nothing is reported")
    return value


def in_process(model, tokenizer, messages: list[dict], decode: int, chunk: int) -> float:
    """Seconds per decoded token of `Session.generate` after the same prompt the server gets."""
    session = Session(model, tokenizer, prefill_chunk=chunk, progress=False)
    session.append_messages(messages, add_generation_prompt=True)
    stamps = [(time.perf_counter(), time.process_time())
              for _ in session.generate(decode, temperature=0, add_generation_prompt=False, stop_ids=())]
    CPU_PER_TOKEN.append((stamps[-1][1] - stamps[0][1]) / max(len(stamps) - 1, 1))
    return (stamps[-1][0] - stamps[0][0]) / max(len(stamps) - 1, 1)


def streamed(client: openai.OpenAI, model_id: str, messages: list[dict], max_tokens: int) -> dict:
    """(TTFT, seconds per token after the first, tokens, reply text, cached tokens) of one streamed request;
    BenchFailure when the reply holds no text (there is then no first token to time)."""
    sent = time.perf_counter()
    stamps, cpu, text, usage = [], [], "", None
    for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise BenchFailure("the server sent no usage chunk (stream_options include_usage)")
    if not stamps:
        raise BenchFailure(f"the reply had no text in {max_tokens} tokens (ask something the model answers, or "
                           "more tokens); no TTFT to report")
    tokens = usage.completion_tokens
    # between the first and the last text chunk (one a token; the chat scaffold's tokens send none)
    per_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    # process CPU time between the same chunks (server, client and engine share this process): far less
    # sensitive than wall time to other jobs on a shared machine
    cpu_per_token = (cpu[-1] - cpu[0]) / (len(cpu) - 1) if len(cpu) > 1 else None
    return {"ttft_s": stamps[0] - sent, "per_token_s": per_token, "cpu_per_token_s": cpu_per_token, "tokens": tokens,
            "text": text,
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt": usage.prompt_tokens}


def fact_conversation(tokenizer, tokens: int) -> list[dict]:
    """Turn 1: the find-fact template around a `tokens`-token document (a question builtin:demo answers)."""
    document = tokenizer.decode(filler_ids(tokens, tokenizer.encode))
    task = fact_task([("document", document)], FACT_KEY, FACT_VALUE)
    return ([{"role": "system", "content": task.system}]
            + [{"role": "user", "content": text} for _, text in task.documents]
            + [{"role": "user", "content": task.question}])


def start_server(model, tokenizer, name: str, chunk: int, cache_bytes: int, trace_root: Path | None = None,
                 policy: object = "default") -> tuple[Server, openai.OpenAI]:
    server = Server(model, tokenizer, ServeOptions(model_name=name, trace_root=trace_root, cache_bytes=cache_bytes,
                                                   prefill_chunk=chunk, policy=policy),
                    AppConfig(model_id=name, hosts=HostPolicy.for_server("127.0.0.1"), max_tokens=1 << 16), port=0)
    server.start_in_thread()
    return server, openai.OpenAI(base_url=server.url, api_key="bench", max_retries=0, timeout=3600)


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except BenchFailure as exc:
        print(f"bench_serve: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


def run(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--tokens", type=int, default=32768, help="document tokens in turn 1")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded for the per-token comparison")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-reuse", action="store_true", help="skip figure 2 (turn 2 with and without prefix reuse)")
    args = ap.parse_args(argv)
    if args.decode < 2 or args.tokens < 1 or args.repeats < 1:
        ap.error("--decode must be at least 2 (a time per token needs two tokens), --tokens and --repeats at least 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_with_tokenizer(args.model)
    warm, warm_client = start_server(model, tokenizer, args.model, args.prefill_chunk, 64 << 30)
    cold, cold_client = start_server(model, tokenizer, args.model, args.prefill_chunk, 0)
    traces = tempfile.TemporaryDirectory(prefix="bench_serve_traces_")
    # recording servers keep no state either: every request is a fresh conversation, recorded into its own trace
    recorded, recorded_client = start_server(model, tokenizer, args.model, args.prefill_chunk, 0,
                                             Path(traces.name) / "plain", RecordPolicy(health=False))
    checked, checked_client = start_server(model, tokenizer, args.model, args.prefill_chunk, 0,
                                           Path(traces.name) / "health", RecordPolicy())
    try:
        short = fact_conversation(tokenizer, SHORT_DOCUMENT)
        variants = {"streamed by workbench serve": cold_client, "streamed, recording (integrity off)": recorded_client,
                    "streamed, recording + integrity": checked_client}
        local: list[float] = []
        served: dict[str, list[float]] = {name: [] for name in variants}
        local_cpu: list[float] = []
        served_cpu: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            local.append(measured(in_process(model, tokenizer, short, args.decode, args.prefill_chunk) or None,
                                  "the in-process time per token"))
            # each server keeping no state prefills the question cold each round, like the in-process session
            local_cpu.append(CPU_PER_TOKEN[-1])
            for name, client in variants.items():
                reply = streamed(client, args.model, short, args.decode)
                served[name].append(measured(reply["per_token_s"],
                                             f"the time per token {name} (the reply needs two text chunks)"))
                served_cpu[name].append(measured(reply["cpu_per_token_s"], f"the CPU time per token {name}"))
        best_local = min(local)
        print(f"decode per token, best of {args.repeats} ({args.model}, {args.decode} tokens, greedy; rounds "
              f"interleaved):")
        print(f"  Session.generate in process          {best_local * 1e3:8.2f} ms  (median "
              f"{statistics.median(local) * 1e3:.2f})")
        for name, times in served.items():
            print(f"  {name:36s} {min(times) * 1e3:8.2f} ms  (median {statistics.median(times) * 1e3:.2f})  "
                  f"x{min(times) / best_local:.3f} of in-process")
        names = list(variants)
        paired = {name: statistics.median(t / l for t, l in zip(served[name], local)) for name in names}
        rec_vs_plain = statistics.median(r / p for r, p in zip(served[names[1]], served[names[0]]))
        health_vs_rec = statistics.median(h / r for h, r in zip(served[names[2]], served[names[1]]))
        print("  paired per round (median of the rounds' ratios; robust to load that drifts between rounds):")
        for name in names:
            print(f"    {name:34s} x{paired[name]:.3f} of in-process")
        print(f"    recording / not recording          x{rec_vs_plain:.3f}")
        print(f"    integrity on / off (recording)     x{health_vs_rec:.3f}")
        print("  process CPU time per token, paired per round (median of the rounds' ratios; min..max):")
        for name in names:
            ratios = [t / l for t, l in zip(served_cpu[name], local_cpu)]
            print(f"    {name:34s} x{statistics.median(ratios):.3f} of in-process ({min(ratios):.3f}..{max(ratios):.3f})")
        for label, a, b in (("recording / not recording", names[1], names[0]),
                            ("integrity on / off (recording)", names[2], names[1])):
            ratios = [x / y for x, y in zip(served_cpu[a], served_cpu[b])]
            print(f"    {label:34s} x{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
        plain, rec, health = (min(served[name]) for name in variants)
        print(f"  server overhead per token            {(plain - best_local) * 1e3:8.2f} ms "
              f"({(plain / best_local - 1) * 100:+.1f}%)")
        print(f"  recording's cost per served token    {(rec - plain) * 1e3:8.2f} ms ({(rec / plain - 1) * 100:+.1f}%)")
        print(f"  integrity's cost per recorded token  {(health - rec) * 1e3:8.2f} ms ({(health / rec - 1) * 100:+.1f}%)")
        if args.no_reuse:
            return

        turn1 = fact_conversation(tokenizer, args.tokens)
        first = streamed(warm_client, args.model, turn1, REPLY_TOKENS)
        turn2 = turn1 + [{"role": "assistant", "content": first["text"]}] + turn1[-1:]
        reused = streamed(warm_client, args.model, turn2, REPLY_TOKENS)
        again = streamed(cold_client, args.model, turn2, REPLY_TOKENS)
        if reused["cached"] <= 0:
            raise BenchFailure("turn 2 reused no cached tokens from turn 1: the prefix cache did not apply")
        for name, result in (("turn 1", first), ("turn 2 with reuse", reused), ("turn 2 without reuse", again)):
            measured(result["ttft_s"], f"the TTFT of {name}")
        print(f"\nturn 2 of a conversation with a {args.tokens}-token document ({args.model}):")
        print(f"  turn 1 (cold)                 TTFT {first['ttft_s']:8.2f} s   prompt {first['prompt']} tokens")
        print(f"  turn 2, prefix reused         TTFT {reused['ttft_s']:8.2f} s   prompt {reused['prompt']} tokens, "
              f"{reused['cached']} cached")
        print(f"  turn 2, no reuse (cold)       TTFT {again['ttft_s']:8.2f} s   prompt {again['prompt']} tokens, "
              f"{again['cached']} cached")
        print(f"  speed-up from reuse           {again['ttft_s'] / reused['ttft_s']:8.1f}x")
    finally:
        for server in (warm, cold, recorded, checked):
            server.stop()
        traces.cleanup()


if __name__ == "__main__":
    sys.exit(main())
