"""`workbench serve` against the engine in-process, side by side in one run (the real `openai` client on 127.0.0.1).

1. Server overhead per streamed token: the same greedy decode (a short chat prompt, `--decode` tokens)
   through `Session.generate` in this process and streamed from the server; per token = the time
   from the first streamed token to the last over the tokens between them. Alternated over
   `--repeats` rounds, best of each kept, so a busy machine biases both alike.
2. TTFT of turn 2 with and without prefix reuse: turn 1 is a user message holding a `--tokens`-token
   document; turn 2 sends the whole conversation back with a short question. With reuse, the server
   continues turn 1's state and prefills only what is new; without (a second server keeping no
   state, `cache_bytes=0`), it prefills every token again. TTFT is measured on the client (request
   sent -> first content chunk).

    python benchmarks/bench_serve.py --tokens 32768 --decode 64     # builtin:demo
    python benchmarks/bench_serve.py --model preset:tiny --tokens 2048 --decode 32 --repeats 2   # a quick check

Nothing is recorded (the server's `--no-record`), so both sides run the same work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai
import torch

from apps.dashboard.host_guard import HostPolicy
from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from engine.session import Session
from measure import filler_ids
from workbench.sessions import load_with_tokenizer

QUESTION = [{"role": "user", "content": "Summarise the document in one sentence."}]


def in_process(model, tokenizer, decode: int, chunk: int) -> float:
    """Seconds per decoded token of `Session.generate` after the same prompt the server gets."""
    session = Session(model, tokenizer, prefill_chunk=chunk, progress=False)
    session.append_messages(QUESTION, add_generation_prompt=True)
    stamps = [time.perf_counter() for _ in session.generate(decode, temperature=0, add_generation_prompt=False,
                                                            stop_ids=())]
    return (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


def streamed(client: openai.OpenAI, model_id: str, messages: list[dict], max_tokens: int) -> dict:
    """(TTFT, seconds per token after the first, tokens, reply text, cached tokens) of one streamed request."""
    sent = time.perf_counter()
    stamps, text, usage = [], "", None
    for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = usage.completion_tokens if usage else len(stamps)
    per_token = (stamps[-1] - stamps[0]) / max(tokens - 1, 1) if len(stamps) > 1 else float("nan")
    return {"ttft_s": stamps[0] - sent if stamps else float("nan"), "per_token_s": per_token, "tokens": tokens,
            "text": text, "cached": usage.prompt_tokens_details.cached_tokens if usage else 0,
            "prompt": usage.prompt_tokens if usage else 0}


def start_server(model, tokenizer, name: str, chunk: int, cache_bytes: int) -> tuple[Server, openai.OpenAI]:
    server = Server(model, tokenizer, ServeOptions(model_name=name, trace_root=None, cache_bytes=cache_bytes,
                                                   prefill_chunk=chunk),
                    AppConfig(model_id=name, hosts=HostPolicy.for_server("127.0.0.1"), max_tokens=1 << 16), port=0)
    server.start_in_thread()
    return server, openai.OpenAI(base_url=server.url, api_key="bench", max_retries=0, timeout=3600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--tokens", type=int, default=32768, help="document tokens in turn 1")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded for the per-token comparison")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_with_tokenizer(args.model)
    warm, warm_client = start_server(model, tokenizer, args.model, args.prefill_chunk, 64 << 30)
    cold, cold_client = start_server(model, tokenizer, args.model, args.prefill_chunk, 0)
    try:
        local, served = [], []
        for _ in range(args.repeats):
            local.append(in_process(model, tokenizer, args.decode, args.prefill_chunk))
            # a fresh question each round: the server prefills it cold, like the in-process session
            served.append(streamed(cold_client, args.model, QUESTION, args.decode)["per_token_s"])
        best_local, best_served = min(local), min(served)
        print(f"decode per token, best of {args.repeats} ({args.model}, {args.decode} tokens, greedy):")
        print(f"  Session.generate in process   {best_local * 1e3:8.2f} ms  (median {statistics.median(local) * 1e3:.2f})")
        print(f"  streamed by workbench serve   {best_served * 1e3:8.2f} ms  (median {statistics.median(served) * 1e3:.2f})")
        print(f"  server overhead per token     {(best_served - best_local) * 1e3:8.2f} ms "
              f"({(best_served / best_local - 1) * 100:+.1f}%)")

        document = tokenizer.decode(filler_ids(args.tokens, tokenizer.encode))
        turn1 = [{"role": "user", "content": document}]
        first = streamed(warm_client, args.model, turn1, 8)
        turn2 = turn1 + [{"role": "assistant", "content": first["text"] or "ok"}] + QUESTION
        reused = streamed(warm_client, args.model, turn2, 4)
        again = streamed(cold_client, args.model, turn2, 4)
        print(f"\nturn 2 of a conversation with a {args.tokens}-token document ({args.model}):")
        print(f"  turn 1 (cold)                 TTFT {first['ttft_s']:8.2f} s   prompt {first['prompt']} tokens")
        print(f"  turn 2, prefix reused         TTFT {reused['ttft_s']:8.2f} s   prompt {reused['prompt']} tokens, "
              f"{reused['cached']} cached")
        print(f"  turn 2, no reuse (cold)       TTFT {again['ttft_s']:8.2f} s   prompt {again['prompt']} tokens, "
              f"{again['cached']} cached")
        print(f"  speed-up from reuse           {again['ttft_s'] / reused['ttft_s']:8.1f}x")
    finally:
        warm.stop()
        cold.stop()


if __name__ == "__main__":
    main()
