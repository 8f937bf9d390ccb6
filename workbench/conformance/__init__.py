"""Does a deployment compute the model? `conformance(endpoint, model, tokenizer, prompts)` asks an
OpenAI-compatible endpoint (vLLM, SGLang, `workbench serve`) for greedy answers with their
log-probabilities and, where the server has them, its routed experts and DSA indexer top-k; runs the
same tokens through this exact engine (teacher-forced) and compares them position by position and
layer by layer, beside the engine's tie bands (docs/conformance.md).

    check.py      one reply against the engine; the run (repeats, follow-ups, concurrent requests)
    endpoint.py   the request and the reply's fields (token ids, log-probs, vLLM / SGLang captures)
    reference.py  the engine's teacher-forced run: log-probs, routes and selections with their ties
    layers.py     the first divergent layer: captures against the reference, ties apart
    suite.py      `--prompts FILE` and the suite built to trigger known failure classes
    output.py     the verdict table, the Parquet file, the deployment record's line
"""

from workbench.conformance.check import (DEFAULT_TOLERANCE, ConformanceReport, PromptResult, compare_reply,
                                         conformance)
from workbench.conformance.endpoint import EndpointError
from workbench.conformance.output import record_line, report_table, verdict_table, write_parquet
from workbench.conformance.suite import MAX_PROMPTS, SuiteItem, long_context_suite, read_prompts

__all__ = ["ConformanceReport", "DEFAULT_TOLERANCE", "EndpointError", "MAX_PROMPTS", "PromptResult", "SuiteItem",
           "compare_reply", "conformance", "long_context_suite", "read_prompts", "record_line", "report_table",
           "verdict_table", "write_parquet"]
