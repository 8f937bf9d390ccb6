"""Captures in: vLLM / SGLang responses with routed experts (and SGLang's indexer top-k) as traces.

    from workbench.captures import import_capture
    import_capture("vllm", "responses.jsonl", "checkpoints/k3.1-pro", "traces/served")

    records.py   the engines' response formats -> checked `Record`s; layer numbering mapped explicitly
    arrays.py    base64 payloads (raw bytes or .npy) validated before decoding, read in row chunks
    importer.py  records -> a trace, reduced with the recorder's own reductions, written crash-safe
    exporter.py  a recorded trace -> the responses each engine would return (the round-trip proof)

The formats, and where they were read, are in docs/captures.md.
"""

from workbench.captures.arrays import encode_flat, encode_npy
from workbench.captures.exporter import export_responses
from workbench.captures.importer import import_capture, load_capture_model
from workbench.captures.records import ENGINES

__all__ = ["ENGINES", "encode_flat", "encode_npy", "export_responses", "import_capture", "load_capture_model"]
