"""Named probe points: the engine's one surface for observers (the workbench's recorders).

- `Signal` / `Field`: each signal's payload declared once, as data (field names, dims, dtypes, what
  the positions mean). `SIGNALS` is the catalogue; the recorder and the trace schema read it.
- `ProbePoint`: one signal of one layer, named by family + layer and by its module path
  (`model.layers.3.self_attn:dsa.topk`). A layer calls `point.emit(**tensors)` only when
  `point.listening` (a sink attached, or the decode step collecting), so with nothing attached the
  cost is that one check.
- `ProbeRequest`: what the listener asks for (optional fields, which queries to measure), declared
  data the layer reads; `Sample` / `Marks` say which positions are wanted, decided on the host.
- `ProbeContext`: one per model, set by the session around each forward; every `Emission` carries
  its step, phase and rank.
- Inside the compiled decode step a listening point is `collecting`: `emit` keeps the tensors (graph
  outputs) and the step hands them on afterwards, with positions from the host, through the
  model's `engine.decode.probe_tape.ProbeTape`: one record per step, cut into one emission of up to
  `probe_tape.BACKLOG_STEPS` decode steps per point (per-row `Emission.steps`), so a decode step costs the
  host one list append whatever the number of listeners (and the recorder one reduction per 64
  steps). The tape is delivered when full, before any other forward, when a generation ends, when
  a listener detaches, and on `ProbePoint.deliver()` (a recorder's flush), so a sink sees each
  point's emissions in step order and none is lost.

Adding a signal: declare its `Signal` here (and list it in `SIGNALS`); emit it from its layer
(`if point.listening: point.emit(...)`, any optional measure an `engine.ops` function); the
workbench side is one module of its family in `workbench/signals/` (its tables, request and rows).

Positions are sequence positions, given as CPU int64 tensors so that a listener can decide what to
keep without synchronising the device; expert ids are logical. The engine never imports the
workbench, and this module imports neither torch nor the rest of the engine (trace readers cite
the declarations without loading torch).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

OPEN_END = sys.maxsize  # end of a `Marks` span that is still growing (the answer being generated)


@dataclass(frozen=True)
class Field:
    """One tensor of a payload.

    Attributes:
        name: the keyword the layer emits it under.
        dims: dimension names; `B` is the batch, `n` the payload's rows (one per position), the
            others are sizes from the config (see `Signal.check`).
        dtype: torch dtype name (`"int64"`, `"float32"`).
        doc: what it holds.
        optional: emitted only when the listener's `ProbeRequest` names it.
        host: on the CPU whatever the model's device (positions), so a listener reads it freely.
        eager: measured with host decisions inside the layer (which positions, the context so far), so
            a decode step whose listener asks for it runs the eager forward instead of the compiled step.
    """

    name: str
    dims: tuple[str, ...]
    dtype: str
    doc: str
    optional: bool = False
    host: bool = False
    eager: bool = False


def _positions(meaning: str) -> Field:
    return Field("positions", ("n",), "int64", meaning, host=True)


@dataclass(frozen=True)
class Signal:
    """The declaration of one signal: its name, family and payload fields (positions first)."""

    name: str
    doc: str
    fields: tuple[Field, ...]

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @cached_property
    def optional(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields if f.optional)

    @cached_property
    def eager(self) -> frozenset[str]:
        """Fields only the eager forward measures (`Field.eager`)."""
        return frozenset(f.name for f in self.fields if f.eager)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}; fields are {', '.join(self.names)}")

    def check(self, data: dict[str, Any], sizes: dict[str, int], requested: frozenset[str] = frozenset()) -> list[str]:
        """Where `data` (an emission's tensors) departs from this declaration; [] when it matches.

        `sizes` gives every dimension other than `n` (e.g. `{"B": 1, "topk": 16}`); `n` is taken
        from `positions`. Optional fields must be present exactly when `requested` names them.
        """
        problems = []
        data = resolved(data)
        expected = {f.name for f in self.fields if not f.optional or f.name in requested}
        if set(data) != expected:
            problems.append(f"{self.name}: fields {sorted(data)}, declared {sorted(expected)}")
        n = len(data["positions"]) if "positions" in data else -1
        for name, t in data.items():
            if name not in self.names:
                continue
            f = self.field(name)
            want = tuple(n if d == "n" else sizes.get(d, -1) for d in f.dims)
            if tuple(t.shape) != want:
                problems.append(f"{self.name}.{name}: shape {tuple(t.shape)}, declared {f.dims} = {want}")
            if str(t.dtype).removeprefix("torch.") != f.dtype:
                problems.append(f"{self.name}.{name}: dtype {t.dtype}, declared {f.dtype}")
            if f.host and t.device.type != "cpu":
                problems.append(f"{self.name}.{name}: on {t.device}, declared on the host")
        return problems


DSA_TOPK = Signal("dsa.topk", "the key positions each DSA layer's indexer selected, per query of the call", (
    _positions("query positions of this forward call"),
    Field("indices", ("B", "n", "topk"), "int64", "selected key positions, ascending; -1 = empty slot"),
    Field("scores", ("B", "n", "topk"), "float32", "indexer scores aligned with indices", optional=True),
    Field("tie_band", ("B", "n"), "int64", "integrity: keys sharing the k-th score (0 = every visible key kept)",
          optional=True),
    Field("tie_cut", ("B", "n"), "int64", "integrity: keys of that band left out (> 0: the tie-break, earliest "
          "position first, decided the selection)", optional=True),
))
DSA_DENSE_MASS = Signal("dsa.dense_mass", "how faithful sparse attention is, for the sampled queries", (
    _positions("the sampled query positions (`ProbeRequest.queries` in prefill, `decode_every` in decode)"),
    Field("mass", ("B", "n"), "float32", "share of the dense softmax attention mass inside the selected set, "
          "averaged over all heads"),
    Field("iou", ("B", "n"), "float32", "set IoU of the selection and the top-k keys of the dense probabilities "
          "averaged over heads (k = the query's picks)", optional=True),
    Field("recall", ("B", "n"), "float32", "share of the dense top-k inside the selection (requested with iou)",
          optional=True),
))
KDA_STATE = Signal("kda.state", "per-head statistics of the KDA recurrent state S", (
    _positions("positions after which the state was measured (chunk boundaries and the call's last token "
               "in prefill, every token in decode)"),
    Field("norm", ("B", "n", "heads"), "float32", "Frobenius norm of S per head"),
    Field("max_abs", ("B", "n", "heads"), "float32", "max |S| per head", optional=True),
    Field("mean_decay", ("B", "n", "heads"), "float32", "mean exp(g) per head over the interval since the "
          "previous measurement", optional=True),
    Field("mean_beta", ("B", "n", "heads"), "float32", "mean beta per head over the same interval", optional=True),
    Field("eff_rank", ("B", "n", "heads"), "float32", "effective rank of S per head (exp of the entropy of its "
          "normalised singular values); NaN at positions the request's `queries` sample skips", optional=True,
          eager=True),
    Field("half_life", ("B", "n", "heads"), "float32", "median over channels of the half-life ln 2 / -mean(g) "
          "(tokens) over the interval", optional=True, eager=True),
    Field("global_share", ("B", "n", "heads"), "float32", "share of channels whose half-life over the interval "
          "exceeds the context so far (position + 1)", optional=True, eager=True),
    Field("frozen", ("B", "n", "heads"), "float32", "integrity: channels per head whose decay exp(g) is exactly "
          "1.0 in fp32 (never forget), averaged over the interval's tokens", optional=True),
    Field("drift", ("B", "n", "heads"), "float32", "integrity: relative difference of the state a chunked prefill "
          "left at one chunk boundary per call (step % chunks) and the same chunk run token by token from the state "
          "before it; NaN elsewhere (decode steps run token by token already)", optional=True),
))
MOE_ROUTE = Signal("moe.route", "the experts each token was routed to", (
    _positions("token positions of this forward call"),
    Field("experts", ("B", "n", "experts_per_token"), "int64", "logical expert ids, router order"),
    Field("weights", ("B", "n", "experts_per_token"), "float32", "combine weights aligned with experts"),
    Field("entropy", ("B", "n"), "float32", "entropy (nats) of the router's normalised sigmoid scores over "
          "all experts", optional=True),
    Field("logit_sum", ("B", "n"), "float32", "integrity: sum of the token's router logits (non-finite exactly "
          "when one of them is, short of an overflow no router reaches)", optional=True),
    Field("kth_choice", ("B", "n"), "float32", "integrity: the k-th chosen expert's choice score (sigmoid + "
          "correction bias)", optional=True),
    Field("runner_up", ("B", "n"), "float32", "integrity: the best choice score left out (equal to kth_choice: a "
          "tie at the top-k boundary decided the route)", optional=True),
))

SIGNALS: dict[str, Signal] = {s.name: s for s in (DSA_TOPK, DSA_DENSE_MASS, KDA_STATE, MOE_ROUTE)}
PROBE_NAMES = tuple(SIGNALS)


@dataclass(frozen=True)
class Marks:
    """Positions a listener always wants: single positions and [start, end) spans (segments)."""

    positions: tuple[int, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()

    def mask(self, pos: np.ndarray) -> np.ndarray:
        """pos [n] int64 -> bool [n]: marked."""
        keep = np.zeros(len(pos), bool)
        if self.positions:
            keep |= np.isin(pos, np.asarray(self.positions))
        for start, end in self.spans:
            keep |= (pos >= start) & (pos < end)
        return keep


@dataclass(frozen=True)
class Sample:
    """Which positions to keep: every `stride`-th ((p + 1) % stride == 0; 0 = none), a window of
    `window_tokens` every `window_every` positions (0 = none), and the marks."""

    stride: int = 0
    window_every: int = 0
    window_tokens: int = 0
    marks: Marks = Marks()

    def rows(self, pos: np.ndarray) -> np.ndarray:
        """pos [n] int64 -> indices (into pos) of the kept positions, ascending."""
        keep = (pos + 1) % self.stride == 0 if self.stride > 0 else np.zeros(len(pos), bool)
        if self.window_every > 0:
            keep |= (pos % self.window_every) < self.window_tokens
        return np.flatnonzero(keep | self.marks.mask(pos))


@dataclass(frozen=True)
class SampleUnion:
    """The positions any of several `Sample`s keeps (what a point with several listeners measures)."""

    samples: tuple[Sample, ...]

    def rows(self, pos: np.ndarray) -> np.ndarray:
        keep = np.zeros(len(pos), bool)
        for sample in self.samples:
            keep[sample.rows(pos)] = True
        return np.flatnonzero(keep)


@dataclass(frozen=True)
class ProbeRequest:
    """What a listener asks of a probe point; the layer reads it (nothing calls back).

    Attributes:
        optional: optional fields of the signal to emit (see `Signal.optional`).
        queries: `dsa.dense_mass` in prefill (and any phase but decode): which query positions to
            measure; None = every query.
        decode_every: `dsa.dense_mass` in decode: measure the step when step % decode_every == 0
            (0 = never).
    """

    optional: frozenset[str] = frozenset()
    queries: Sample | SampleUnion | None = None
    decode_every: int = 1

    def wants(self, name: str) -> bool:
        return name in self.optional

    def measures_step(self, step: int) -> bool:
        """Whether a decode step is measured (`decode_every`)."""
        return self.decode_every > 0 and step % self.decode_every == 0

    def rows(self, start: int, count: int, step: int, phase: str) -> np.ndarray:
        """Rows of a forward call over positions [start, start + count) to measure (int64, host)."""
        if phase == "decode":
            return np.arange(count) if self.measures_step(step) else np.zeros(0, np.int64)
        if self.queries is None:
            return np.arange(count)
        return self.queries.rows(np.arange(start, start + count))


@dataclass
class ProbeContext:
    """Where the model is in its session; every emission is tagged with it.

    Attributes:
        step: session-wide forward counter (each prefill chunk and decode step is one).
        phase: "prefill" | "decode" | "idle" (no session forward running, e.g. a plain `model(ids)`).
        rank: this process's tensor/expert-parallel rank (set when the model is built).
    """

    step: int = 0
    phase: str = "idle"
    rank: int = 0

    def begin(self, *, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def end(self) -> None:
        self.phase = "idle"


# rows (tokens) of a call below which a layer may emit integrity fields as `Deferred` (eager decode steps)
DEFER_MAX_ROWS = 16


class Deferred:
    """An optional field's value, not computed yet: `fn(*inputs)`, each input holding the emission's rows
    along dim `axis` (and `fn` giving the field's declared shape for them).

    Eager decode steps emit integrity fields this way to sinks that take them (`takes_deferred`: the
    recorder, which turns decode steps into rows in bulk): computed per step they cost a few small ops
    per layer, ~4% of an eager demo decode step; the sink concatenates the inputs of many steps along
    their rows and computes once (`cat_rows`). The inputs are the step's own tensors, kept by reference
    (never written again), so nothing is copied either. Every other sink receives the value computed."""

    __slots__ = ("fn", "inputs", "axis")

    def __init__(self, fn: Callable[..., "torch.Tensor"], *inputs: "torch.Tensor", axis: int = 1) -> None:
        self.fn, self.inputs, self.axis = fn, inputs, axis

    def value(self) -> "torch.Tensor":
        return self.fn(*self.inputs)


def resolved(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every `Deferred` value computed."""
    return {k: v.value() if isinstance(v, Deferred) else v for k, v in data.items()}


def cat_rows(parts: list[Any], axis: int) -> "torch.Tensor":
    """One field of several emissions concatenated along its rows (dim `axis` of the field); deferred
    parts of one function are computed once over their concatenated inputs."""
    import torch

    if all(isinstance(p, Deferred) for p in parts) and len({(p.fn, p.axis) for p in parts}) == 1:
        first = parts[0]
        inputs = [torch.cat([p.inputs[i] for p in parts], first.axis) for i in range(len(first.inputs))]
        return first.fn(*inputs)
    return torch.cat([p.value() if isinstance(p, Deferred) else p for p in parts], axis)


class Emission(NamedTuple):
    """What a sink receives: the point, the context's tags, and the tensors (`point.signal`'s fields).

    `steps` tags each row (`positions`) of an emission that carries several decode steps (a
    batch of decode steps delivered by the tape); None: every row belongs to `step` (then the first row's step).
    """

    point: "ProbePoint"
    step: int
    phase: str
    rank: int
    data: dict[str, "torch.Tensor"]
    steps: "torch.Tensor | None" = None

    def row_steps(self) -> "torch.Tensor":
        """The step of each row, int64 [n] on the host."""
        import torch

        if self.steps is not None:
            return self.steps
        return torch.full((len(self.data["positions"]),), self.step, dtype=torch.long)


Sink = Callable[[Emission], None]


def combined_request(requests: list[ProbeRequest]) -> ProbeRequest:
    """One request that measures everything any of `requests` asks for: the union of their optional
    fields and sampled queries, and every decode step any of them measures (the gcd of their periods,
    a superset; `FanOut` gives each listener only its own rows back)."""
    if len(requests) == 1:
        return requests[0]
    queries: Sample | SampleUnion | None
    samples = [r.queries for r in requests]
    if any(q is None for q in samples):
        queries = None
    else:
        flat = tuple(dict.fromkeys(x for q in samples for x in (q.samples if isinstance(q, SampleUnion) else (q,))))
        queries = flat[0] if len(flat) == 1 else SampleUnion(flat)
    periods = [r.decode_every for r in requests if r.decode_every > 0]
    return ProbeRequest(optional=frozenset().union(*(r.optional for r in requests)), queries=queries,
                        decode_every=math.gcd(*periods) if periods else 0)


class FanOut:
    """The sink of a point with several listeners: each emission goes to every listener, with only the
    optional fields it asked for and, for `dsa.dense_mass` (whose rows are the sampled queries), only the
    rows its own request samples. Listeners are called in the order they attached."""

    def __init__(self, listeners: list[tuple[Sink, ProbeRequest]], combined: ProbeRequest) -> None:
        self.listeners, self.combined = listeners, combined

    def __call__(self, emission: Emission) -> None:
        for sink, request in self.listeners:
            own = _own_part(emission, request, self.combined)
            if own is not None:
                sink(own)


def _own_part(emission: Emission, request: ProbeRequest, combined: ProbeRequest) -> Emission | None:
    """`emission` cut down to what `request` asks for (None when none of its rows are wanted)."""
    if request == combined:
        return emission
    signal = emission.point.signal
    data = {k: v for k, v in emission.data.items() if k not in signal.optional or request.wants(k)}
    if signal.name == "dsa.dense_mass":
        positions = emission.data["positions"].numpy()
        if emission.phase == "decode":
            steps = emission.row_steps().numpy()
            keep = (np.flatnonzero(steps % request.decode_every == 0) if request.decode_every > 0
                    else np.zeros(0, np.int64))
        else:
            keep = np.arange(len(positions)) if request.queries is None else request.queries.rows(positions)
        if len(keep) == 0:
            return None
        if len(keep) < len(positions):
            import torch

            index = torch.from_numpy(keep)
            data = {k: v.index_select(signal.field(k).dims.index("n"), index.to(v.device)) for k, v in data.items()}
            steps_kept = None if emission.steps is None else emission.steps[index]
            return emission._replace(data=data, steps=steps_kept)
    return emission._replace(data=data)


_UNBOUND = ProbeContext()  # tags of a layer used outside a model (never begun: always step 0, "idle")


class ProbePoint:
    """One recordable signal of one layer. `sink` is None unless a listener attached one.

    Several listeners may attach (a recording, an intervention's measurement, a user's own sink): `sink`
    is then a `FanOut` over them and `request` the union of their requests (`combined_request`), so the
    layers and the decode step read one sink and one request whatever the number of listeners.

    Attributes:
        name: the signal's name (`dsa.topk`); `signal` its declaration; `family` e.g. `dsa`.
        layer: model layer index.
        path: module path in the model (`model.layers.3.self_attn`), set by `bind_probes`.
        request: what the listeners ask for (a `ProbeRequest`).
    """

    __slots__ = ("name", "signal", "layer", "path", "sink", "request", "context", "collecting", "collected",
                 "tape", "_listeners", "defers")

    def __init__(self, name: str, layer: int) -> None:
        if name not in SIGNALS:
            raise ValueError(f"unknown probe {name!r}; probes are {', '.join(SIGNALS)}")
        self.name = name
        self.signal = SIGNALS[name]
        self.layer = layer
        self.path = ""
        self.sink: Sink | None = None
        self.request = ProbeRequest()
        self._listeners: list[tuple[Sink, ProbeRequest]] = []
        self.defers = False  # every listener takes `Deferred` field values (`takes_deferred`)
        self.context = _UNBOUND
        # inside the compiled decode step emissions are kept here (the graph's outputs) and handed to
        # the sink on the host after it (`engine.decode.step`); one list for the point's lifetime, so
        # the traced step always reads the same object
        self.collecting = False
        self.collected: list[dict[str, "torch.Tensor"]] = []
        # the decode step's tape holding this point's undelivered steps (`engine.decode.probe_tape`), once
        # the model has decoded with the compiled / static step
        self.tape: Any = None

    @property
    def family(self) -> str:
        return self.signal.family

    @property
    def full_name(self) -> str:
        """`model.layers.3.self_attn:dsa.topk` (module path, then signal)."""
        return f"{self.path}:{self.name}"

    def attach(self, sink: Sink, request: ProbeRequest | None = None) -> None:
        """Start listening (beside any listener already attached); the request may name only optional
        fields the signal declares."""
        request = request or ProbeRequest()
        unknown = request.optional - self.signal.optional
        if unknown:
            raise ValueError(f"{self.name} has no optional fields {sorted(unknown)}; "
                             f"optional: {sorted(self.signal.optional)}")
        if self._listeners:
            self.deliver()  # the steps on the tape belong to the listeners attached when they ran
        self._listeners.append((sink, request))
        self._rewire()

    def detach(self, sink: Sink | None = None) -> None:
        """Stop `sink` listening (every listener when None); the listeners first receive the decode
        steps the tape still holds."""
        self.deliver()
        if sink is None:
            self._listeners.clear()
        else:
            kept = [(s, r) for s, r in self._listeners if s != sink]
            if len(kept) == len(self._listeners):
                raise ValueError(f"{sink!r} is not listening to {self}")
            self._listeners = kept
        self._rewire()

    def update_request(self, sink: Sink, request: ProbeRequest) -> None:
        """Change what the listener `sink` asks for (e.g. new marked positions)."""
        if not any(s == sink for s, _ in self._listeners):
            raise ValueError(f"{sink!r} is not listening to {self}")
        self._listeners = [(s, request if s == sink else r) for s, r in self._listeners]
        self._rewire()

    @property
    def listeners(self) -> tuple[Sink, ...]:
        """The attached sinks, in the order they attached."""
        return tuple(s for s, _ in self._listeners)

    def _rewire(self) -> None:
        self.defers = bool(self._listeners) and all(getattr(s, "takes_deferred", False) for s, _ in self._listeners)
        if not self._listeners:
            self.sink, self.request = None, ProbeRequest()
        elif len(self._listeners) == 1:  # one listener: it is the sink itself (no fan-out on the path)
            self.sink, self.request = self._listeners[0]
        else:
            self.request = combined_request([r for _, r in self._listeners])
            self.sink = FanOut(list(self._listeners), self.request)

    def rows(self, start: int, count: int) -> np.ndarray:
        """Rows of this forward call the listener wants measured (`ProbeRequest.rows`)."""
        ctx = self.context
        return self.request.rows(start, count, ctx.step, ctx.phase)

    @property
    def listening(self) -> bool:
        """Whether the layer should emit: a sink is attached, or the decode step collects (checked
        first, so a traced step depends on this flag only, not on which sink is attached)."""
        return self.collecting or self.sink is not None

    def may_defer(self, rows: int) -> bool:
        """Whether a call of `rows` tokens may emit its integrity fields as `Deferred`: an eager call of a
        decode step's size (at most DEFER_MAX_ROWS), heard only by listeners that take them."""
        return self.defers and not self.collecting and rows <= DEFER_MAX_ROWS

    def emit(self, **data: "torch.Tensor | None") -> None:
        """Hand the tensors (fields of `signal`; None = not measured) to the sink with the tags.

        While `collecting` (the decode step), keep them instead, without `positions`: the step's
        positions are known on the host, which adds them when it hands the emission on.
        """
        if self.collecting:
            self.collected.append({k: v for k, v in data.items() if v is not None and k != "positions"})
            return
        sink = self.sink
        if sink is not None:
            ctx = self.context
            sink(Emission(self, ctx.step, ctx.phase, ctx.rank, {k: v for k, v in data.items() if v is not None}))

    def deliver(self) -> None:
        """Hand the sinks the decode steps the tape holds (every listening point of the model: a point's
        steps are delivered with the others', in one pass)."""
        tape = self.tape
        if tape is not None and tape.steps:
            tape.deliver()

    def __repr__(self) -> str:
        where = self.full_name if self.path else f"{self.name}, layer={self.layer}"
        return f"ProbePoint({where!r}, listening={self.sink is not None})"


def bind_probes(model: "torch.nn.Module", context: ProbeContext) -> None:
    """Give every probe point of `model` its module path and the model's context."""
    for path, module in model.named_modules():
        for value in vars(module).values():
            if isinstance(value, ProbePoint):
                value.path, value.context = path, context


def probe_points(model: "torch.nn.Module") -> Iterator[ProbePoint]:
    """Every probe point declared by the modules of `model`, in module order."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, ProbePoint):
                yield value
