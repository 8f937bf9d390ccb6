"""The conformance checker's pieces without a model: a difference inside the engine's tie band is a tie,
never a divergence; the layer named is the lowest divergent one; an endpoint that refuses the capture
fields or times out is an error; the suite's items refer only to earlier items."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from engine.errors import InputError
from workbench.conformance import SuiteItem, conformance
from workbench.conformance.layers import compare_layers
from workbench.conformance.reference import LayerRows
from workbench.conformance.suite import as_items
from workbench.sessions import load_with_tokenizer


def rows(values: np.ndarray, tie: np.ndarray | None = None, scores: np.ndarray | None = None,
         layers: tuple[int, ...] = (1, 2)) -> LayerRows:
    n, l, _ = values.shape
    tie = np.zeros((n, l), bool) if tie is None else tie
    return LayerRows(values.astype(np.int32), tie, np.full((n, l), np.nan, np.float32), scores, layers,
                     tie.astype(np.int32))  # a band that cut one key where a tie is marked


def test_a_route_decided_by_a_tie_is_a_tie_and_router_order_is_not_a_difference() -> None:
    ours = np.zeros((4, 3, 2), np.int32)
    ours[:, 1] = [0, 1]
    ours[:, 2] = [2, 3]
    theirs = ours.copy()
    theirs[0, 1] = [1, 0]              # the same set in another order: equal
    theirs[2, 1] = [0, 5]              # differs where our router tied: a tie
    tie = np.zeros((4, 3), bool)
    tie[2, 1] = True
    finding = compare_layers((theirs, 0), None, rows(ours, tie), None)
    assert finding.first_layer is None and finding.ties == 1 and finding.compared == 8
    theirs[3, 2] = [2, 7]              # no tie there: a divergence in layer 2 at position 3
    finding = compare_layers((theirs, 0), None, rows(ours, tie), None)
    assert (finding.first_layer, finding.first_position, finding.ties) == (2, 3, 1), finding


def test_a_selection_that_differs_inside_the_tie_band_is_a_tie() -> None:
    ours = np.full((3, 3, 4), -1, np.int32)
    ours[:, 2] = [[0, 1, 2, 3]] * 3
    scores = np.full((3, 3, 4), np.nan, np.float32)
    scores[:, 2] = [[5.0, 4.0, 3.0, 1.0]] * 3
    theirs = ours.copy()
    theirs[1, 2] = [0, 1, 2, 9]        # our k-th key (score 1.0) swapped: a tie when the band was cut ...
    tie = np.zeros((3, 3), bool)
    tie[1, 2] = True
    assert compare_layers(None, (theirs, 0), None, rows(ours, tie, scores, (2,))).ties == 1
    # ... or when the key we kept and they left out scores within the margin of our k-th (a near tie)
    assert compare_layers(None, (theirs, 0), None, rows(ours, None, scores, (2,))).ties == 1
    theirs[1, 2] = [9, 8, 2, 3]        # two keys swapped where the band cut one: not inside the tie
    assert compare_layers(None, (theirs, 0), None, rows(ours, tie, scores, (2,))).first_layer == 2
    theirs[1, 2] = [9, 1, 2, 3]        # they left out our best key (score 5.0): a divergence
    finding = compare_layers(None, (theirs, 0), None, rows(ours, None, scores, (2,)))
    assert (finding.first_layer, finding.first_position, finding.family) == (2, 1, "dsa")


def test_the_lowest_divergent_layer_is_named_and_the_earliest_row_is_the_position() -> None:
    ours = np.zeros((10, 4, 2), np.int32)
    ours[..., 1] = 1
    theirs = ours.copy()
    theirs[3, 3] = [4, 5]              # a later layer flips first ...
    theirs[7, 1] = [4, 5]              # ... the faulty layer only later
    finding = compare_layers((theirs, 0), None, rows(ours, layers=(1, 2, 3)), None)
    assert (finding.first_layer, finding.layer_position, finding.first_position) == (1, 7, 3), finding
    assert finding.divergent_rows == 2 and "lowest divergent layer 1, from position 7" in finding.detail


class _Stub(BaseHTTPRequestHandler):
    mode = "refuse"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.mode == "slow":
            time.sleep(3)
        body = json.dumps({"error": {"message": "unknown field: return_routed_experts", "type": "invalid_request_error",
                                     "param": "return_routed_experts", "code": None}}).encode()
        try:
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the slow case: the client gave up already
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("mode, expected", [("refuse", "HTTP 400: unknown field: return_routed_experts"),
                                            ("slow", "timed out")])
def test_refused_fields_and_timeouts_are_errors_not_divergences(mode: str, expected: str) -> None:
    model, tokenizer = load_with_tokenizer("preset:tiny", seed=0)
    _Stub.mode = mode
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        report = conformance(f"http://127.0.0.1:{server.server_port}/v1", model, tokenizer, ["hello"],
                             model_id="m", max_tokens=2, timeout=1.0)
    finally:
        server.shutdown()
    assert report.verdict == "error" and report.prompts[0].verdict == "error", report.to_json()
    assert expected in report.prompts[0].detail and report.first_divergent_position is None


def test_suite_items_refer_to_earlier_items_only() -> None:
    assert [i.kind for i in as_items(["a", SuiteItem("b", "repeat", 0)])] == ["single", "repeat"]
    with pytest.raises(InputError, match="must name an earlier prompt"):
        as_items([SuiteItem("b", "follow-up", 0)])
    with pytest.raises(InputError, match="unknown kind"):
        as_items(["a", SuiteItem("b", "twice", 0)])
