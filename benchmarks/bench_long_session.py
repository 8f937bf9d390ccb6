"""A long-context session on the demo preset: prefill N tokens in chunks, then decode a few.

Prints wall time, prefill tokens/s, decode latency and the process's peak RSS (goal for 128K
tokens on a 2-core machine: completes, peak RSS under 8 GB).

    python benchmarks/bench_long_session.py --tokens 131072
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine import load_model
from engine.deployment import peak_rss_bytes
from engine.session import Session
from engine.tokenizer import Tokenizer
from measure import filler_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--model", default="preset:demo")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tokenizer = Tokenizer.byte_level()
    session = Session(model, tokenizer, prefill_chunk=args.chunk, progress=True, model_name=args.model)
    session.append(ids=filler_ids(args.tokens, tokenizer.encode), name="long document")
    start = time.perf_counter()
    session.prefill()
    prefill_s = time.perf_counter() - start
    rss_after_prefill = peak_rss_bytes()
    tokens = [t.id for t in session.generate(args.decode, temperature=0)]
    rec = session.deployment
    print(json.dumps({
        "model": args.model,
        "context_tokens": args.tokens,
        "prefill_chunk": args.chunk,
        "prefill_seconds": round(prefill_s, 1),
        "prefill_tokens_per_s": round(args.tokens / prefill_s, 1),
        "decode_tokens": len(tokens),
        "decode_ms_per_token": round(1000 * rec.tpot_s, 1) if rec.tpot_s else None,
        "peak_rss_gib_after_prefill": round(rss_after_prefill / 2**30, 2),
        "peak_rss_gib": round(peak_rss_bytes() / 2**30, 2),
        "torch_threads": torch.get_num_threads(),
    }, indent=1))


if __name__ == "__main__":
    main()
