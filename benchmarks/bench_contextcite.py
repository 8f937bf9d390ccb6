"""ContextCite (through engine.hf) beside `workbench.attribute` on the demo's find-fact prompts.

    python benchmarks/bench_contextcite.py                               # 2K, 4K, 8K; needle at 3 depths
    python benchmarks/bench_contextcite.py --lengths 2048 --depths 0.5   # a quick run

For each context length and needle depth: a filler document of about that many tokens holding the
fact once (`fact_task`, no restatement) at that depth, the trained system line, question and
response prefix. The context is cut into sentences by `engine.hf.context_cite.SentencePartitioner`,
and both methods score the same sentences:

- ContextCite (`K3ContextCiter` on `K3ForCausalLM`): it generates the answer greedily, then runs the
  whole prompt once per ablation mask (sentences dropped from the text, `--masks`, ContextCite's
  default 64) and fits its Lasso surrogate; its scores are for the answer's value characters;
- `workbench.attribute` on a session holding the same prompt: the same sentences as token spans,
  `--masks` masks hidden inside the model (only the question and answer run per mask), its
  surrogate, then its `--top` spans checked exactly beside `--controls` same-size controls.

Printed per row: the sentences, the needle sentence's rank under each method (1 = first), whether the
two top sentences agree, each method's wall time and ContextCite's time over workbench's. The two
methods run one after the other in the same process, their order alternating from row to row; each
runs once per row (a row takes minutes: no best-of-N), on one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engine.hf as hf  # noqa: E402
import workbench  # noqa: E402
from engine.hf.context_cite import K3ContextCiter, SentencePartitioner, k3_layout  # noqa: E402
from engine.session import Session  # noqa: E402
from engine.tokenizer import Message  # noqa: E402
from prompts import FACT_KEY, FACT_VALUE, fact_prompt, sweep  # noqa: E402
from workbench.task_templates import append_task, fact_sentence  # noqa: E402


def sentence_spans(tokenizer, partitioner: SentencePartitioner, offset: int) -> list[tuple[int, int]]:
    """Each sentence's token span in the prompt (the document starts at token `offset`)."""
    context = partitioner.context
    spans = []
    for start, part in zip(partitioner.starts, partitioner.parts):
        a = offset + len(tokenizer.encode(context[:start]))
        spans.append((a, offset + len(tokenizer.encode(context[:start + len(part)]))))
    return spans


def run_contextcite(model, tokenizer, task, context: str, masks: int) -> tuple[np.ndarray, str, float]:
    plain = tokenizer.engine_tokenizer
    layout = k3_layout(plain, system=task.system, question=task.question, response_prefix=task.prefix)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ContextCite asks for CUDA autocast on a CPU
        citer = K3ContextCiter(model, tokenizer, context, task.question, layout=layout, num_ablations=masks,
                               generate_kwargs={"max_new_tokens": 12, "do_sample": False,
                                                "eos_token_id": [plain.end_of_msg_id, plain.close_id]})
        response = citer.response
        end = len(FACT_VALUE) if response.startswith(FACT_VALUE) else len(response)
        scores = citer.get_attributions(start_idx=0, end_idx=end, verbose=False)
    return np.asarray(scores), response, time.perf_counter() - t0


def run_workbench(model, tokenizer, task, spans, args) -> tuple[np.ndarray, str, float, object]:
    session = Session(model.engine_model, tokenizer.engine_tokenizer, prefill_chunk=2048, progress=False)
    append_task(session, task, question=False)
    t0 = time.perf_counter()
    result = workbench.attribute(session, continuation=task, spans=spans, masks=args.masks, holdout=args.holdout,
                                 top=args.top, controls=args.controls, seed=args.seed)
    wall = time.perf_counter() - t0
    by_start = {s.start: s for s in result.spans}
    # the estimated drop of each sentence, as a score (larger = the answer leans on it more)
    scores = np.array([-by_start[a].effect for a, _ in spans])
    return scores, result.answer, wall, result


def rank_of(scores: np.ndarray, index: int) -> int:
    return int((scores > scores[index]).sum()) + 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192", help="document lengths in tokens, comma separated")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (0..1), comma separated")
    p.add_argument("--masks", type=int, default=64, help="ablation masks, both methods (ContextCite's default 64)")
    p.add_argument("--holdout", type=int, default=16)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--controls", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(args.seed)
    model = hf.K3ForCausalLM.from_pretrained("builtin:demo")
    tokenizer = hf.K3Tokenizer.from_pretrained("builtin:demo")
    plain = tokenizer.engine_tokenizer
    needle_text = fact_sentence(FACT_KEY, FACT_VALUE).strip()
    plan = sweep(args.lengths, args.depths)
    rows = []
    print(f"{'tokens':>7} {'depth':>5} {'sents':>5} {'cc rank':>7} {'wb rank':>7} {'top agree':>9} "
          f"{'cc s':>7} {'wb s':>7} {'cc/wb':>6}  answers (cc | wb)")
    for i, (tokens, depth) in enumerate(plan):
        task = fact_prompt(plain, tokens, depth, seed=args.seed + i)
        context = task.documents[0][1]
        partitioner = SentencePartitioner(context)
        needle = partitioner.parts.index(needle_text)
        # the document follows the system message
        offset = len(plain.chat_prompt([Message("system", task.system)], add_generation_prompt=False))
        spans = sentence_spans(plain, partitioner, offset)
        order = ("cc", "wb") if i % 2 == 0 else ("wb", "cc")  # alternate which runs first
        out = {}
        for method in order:
            if method == "cc":
                out["cc"] = run_contextcite(model, tokenizer, task, context, args.masks)
            else:
                out["wb"] = run_workbench(model, tokenizer, task, spans, args)
        cc_scores, cc_answer, cc_s = out["cc"]
        wb_scores, wb_answer, wb_s, _ = out["wb"]
        row = {"tokens": len(k3_layout(plain, system=task.system, question=task.question,
                                       response_prefix=task.prefix)(context)),
               "depth": depth, "sentences": len(spans), "cc_rank": rank_of(cc_scores, needle),
               "wb_rank": rank_of(wb_scores, needle),
               "top_agree": int(np.argmax(cc_scores)) == int(np.argmax(wb_scores)),
               "cc_s": cc_s, "wb_s": wb_s, "ratio": cc_s / wb_s, "cc_answer": cc_answer, "wb_answer": wb_answer,
               "cc_needle_score": float(cc_scores[needle]), "wb_needle_effect": float(-wb_scores[needle])}
        rows.append(row)
        print(f"{row['tokens']:>7} {depth:>5.2f} {row['sentences']:>5} {row['cc_rank']:>7} {row['wb_rank']:>7} "
              f"{'yes' if row['top_agree'] else 'no':>9} {cc_s:>7.1f} {wb_s:>7.1f} {row['ratio']:>6.2f}  "
              f"{cc_answer!r} | {wb_answer!r}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
