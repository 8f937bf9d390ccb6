"""What an intervention changes in an answer: `effects(...)`.

From one shared prefix (the session's context, prefilled once) two branches continue: one as the
model is, one with the interventions. Each branch appends the same continuation (the question),
answers it greedily (or with a fixed seed), and is scored on the same tokens by teacher forcing:

- both answers (ids and text);
- the per-token log-probability of a target answer (the expected value) under each branch;
- the KL divergence KL(plain || intervened) of the next-token distributions at each step of the
  plain branch's answer (both branches read the same tokens there, so the steps line up).

Where the branches fork: at the end of the shared context, or earlier when an intervention changes
what the model computes at an earlier position and that position is not read-only: KDA writes and
edits and expert routes act from their own positions on, so the branches fork before the first of
them (and re-run the context from there). DSA `hide` / `pin` change reads only: they act on every
query from the fork on, so hiding a document's span during the question costs a continuation, never
a prefill of the document.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine.errors import InputError
from engine.interventions import DsaHide, DsaPin, Intervention, KdaErase, KdaScale
from workbench.interventions import check_effects_args, check_token_ids, resolve, spec_json
from workbench.task_templates import TaskPrompt

Continuation = Callable[[Any], None]


class ScoringWarning(UserWarning):
    """The target is scored where the model does not write its answer (e.g. before its response tags)."""


def task_scoring(continuation: Any, target: Any) -> tuple[Any, Any]:
    """A `TaskPrompt` as the continuation scores the answer where the model writes it: the trained
    question, then the response opened and prefilled (`key: `); its expected value is the default target."""
    if isinstance(continuation, TaskPrompt):
        if continuation.task != "find-fact":
            raise InputError(f"a {continuation.task} task's question carries its picture: pass the question as a "
                             "continuation function that appends it")
        if target is None:
            if continuation.expected is None:
                raise InputError("the task has no expected value: give target=")
            target = continuation.expected
    return continuation, target


def _scaffold_warning(tokenizer: Any, answer: Sequence[int], target: Sequence[int] | None) -> str:
    """A warning when the plain answer starts with chat tags the target does not (the target is then scored
    where the model writes scaffolding, and its log-probabilities say nothing about the answer)."""
    if tokenizer is None or target is None or not answer:
        return ""
    specials = getattr(tokenizer, "special_ids", set())
    if answer[0] not in specials or target[0] in specials:
        return ""
    lead = tokenizer.decode(list(answer[:4]))
    return (f"the model's answer starts with scaffolding ({lead!r}), so the target is scored where the model "
            "writes tags, not its answer: pass the task (continuation=task from workbench.task_templates.fact_task) "
            "or a continuation that ends with the response prefix")


@dataclass
class Branch:
    """One branch's answer and scores."""

    answer: list[int]
    text: str
    target_logprobs: np.ndarray | None  # [len(target)] nats, or None without a target


@dataclass
class Effects:
    """The two branches of `effects` side by side.

    Attributes:
        interventions: the spec objects applied on the intervened branch.
        fork_at: the position the branches forked at (the shared prefix's length).
        plain, intervened: each branch's answer and target log-probabilities.
        target: the scored target ids (None without one).
        kl: `[len(plain.answer)]` KL(plain || intervened) in nats of the next-token distribution at each
            step of the plain answer.
    """

    interventions: list[dict]
    fork_at: int
    plain: Branch
    intervened: Branch
    target: list[int] | None
    kl: np.ndarray = field(default_factory=lambda: np.zeros(0))
    warnings: list[str] = field(default_factory=list)  # why the scores may not mean what they seem

    @property
    def target_logprob_change(self) -> float | None:
        """Total target log-probability under the intervention minus without it (nats; None without a target)."""
        if self.plain.target_logprobs is None or self.intervened.target_logprobs is None:
            return None
        return float(self.intervened.target_logprobs.sum() - self.plain.target_logprobs.sum())

    def table(self) -> Any:
        """One row per scored token (pandas): `kind` ("target" or "answer"), `step`, `token`, the
        log-probabilities under each branch (target rows) and the KL (answer rows)."""
        import pandas as pd

        rows = []
        for i, tok in enumerate(self.target or []):
            rows.append({"kind": "target", "step": i, "token": tok, "plain_logprob": float(self.plain.target_logprobs[i]),
                         "intervened_logprob": float(self.intervened.target_logprobs[i]), "kl": np.nan})
        for i, tok in enumerate(self.plain.answer):
            rows.append({"kind": "answer", "step": i, "token": tok, "plain_logprob": np.nan,
                         "intervened_logprob": np.nan, "kl": float(self.kl[i])})
        return pd.DataFrame(rows, columns=["kind", "step", "token", "plain_logprob", "intervened_logprob", "kl"])

    def summary(self) -> str:
        lines = [f"interventions: {self.interventions}", f"plain answer:      {self.plain.text!r}",
                 f"intervened answer: {self.intervened.text!r}"]
        if self.target is not None:
            lines.append(f"target log-probability: {self.plain.target_logprobs.sum():.3f} -> "
                         f"{self.intervened.target_logprobs.sum():.3f} nats ({self.target_logprob_change:+.3f})")
        if len(self.kl):
            lines.append(f"KL per answer step: mean {self.kl.mean():.4f}, max {self.kl.max():.4f} nats")
        lines.append("(one intervention, no controls: workbench.check_span gives a verdict beside random "
                     "same-size spans)")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def earliest_write(items: Sequence[Intervention]) -> int | None:
    """The first position an intervention changes other than by a read (None when all are DSA reads)."""
    firsts = []
    for item in items:
        if isinstance(item, (DsaHide, DsaPin)):
            continue
        if isinstance(item, (KdaErase, KdaScale)):
            firsts.append(item.at)
        else:
            span = getattr(item, "positions", None)
            firsts.append(0 if span is None else span[0])
    return min(firsts) if firsts else None


def _continue(branch: Any, continuation: Continuation | str | Sequence[int] | None, role: str) -> None:
    """Append the continuation, ending where the answer starts (an assistant turn is opened for text)."""
    if continuation is None:
        return
    if isinstance(continuation, TaskPrompt):
        tokenizer = branch.tokenizer
        if tokenizer is None:
            raise InputError("a task continuation needs a tokenizer")
        branch.append(continuation.question, role="user", name="question")
        branch.append(ids=tokenizer.chat_prompt([], add_generation_prompt=True)
                      + tokenizer.response_prefix(continuation.prefix), name="answer prefix", kind="turn",
                      role="assistant")
    elif callable(continuation):
        continuation(branch)
    elif isinstance(continuation, str):
        branch.append(continuation, role=role, name="question")
        if branch.tokenizer is None:
            raise InputError("a text continuation needs a tokenizer")
        branch.append(ids=branch.tokenizer.chat_prompt([], add_generation_prompt=True), name="assistant",
                      kind="turn", role="assistant")
    else:
        branch.append(ids=list(continuation), name="question")


def _ids(session: Any, target: str | Sequence[int] | None) -> list[int] | None:
    if target is None:
        return None
    if isinstance(target, str):
        if session.tokenizer is None:
            raise InputError("a text target needs a tokenizer")
        ids = session.tokenizer.encode(target)
    else:
        ids = check_token_ids(session, target, "target")
    if not ids:
        raise InputError("the target answer holds no tokens")
    return ids


def _forced_logprobs(branch: Any, tokens: list[int], keep: bool = True) -> torch.Tensor:
    """`[len(tokens), V]` log-probabilities of the next token before each of `tokens`, by teacher forcing a
    fork of `branch` (left as it was), or `branch` itself when it need not be kept."""
    if not tokens:
        return torch.zeros(0)
    probe = branch.fork() if keep else branch
    first = probe.prefill()
    assert first is not None
    rows = [first.float()[None]]
    if len(tokens) > 1:
        rows.append(probe.feed(tokens[:-1]).float())
    return torch.log_softmax(torch.cat(rows), -1)


def _record_branch(branch: Any, continuation: Continuation | str | Sequence[int] | None, role: str, trace: Path,
                   max_new_tokens: int, temperature: float, seed: int) -> None:
    """Record the DSA reads of the branch's continuation and answer into `trace`, on a fork of its own:
    the branch itself goes on unrecorded, so its scores are the same with or without recording."""
    from workbench.recorders.recorder import record

    copy = branch.fork()
    copy.progress = False
    with record(copy, trace=trace, signals=["dsa"], overwrite=True):
        _continue(copy, continuation, role)
        for _ in copy.generate(max_new_tokens, temperature=temperature, seed=seed, add_generation_prompt=False):
            pass  # a generator: the answer is decoded (and recorded) as it is consumed


def effects(session: Any, *interventions: Any,
            continuation: Continuation | TaskPrompt | str | Sequence[int] | None = None,
            target: str | Sequence[int] | None = None, role: str = "user", max_new_tokens: int = 16,
            temperature: float = 0.0, seed: int = 0, record_to: tuple[Path, Path] | None = None) -> Effects:
    """Run the continuation with and without `interventions` from one shared prefix; see the module doc.

    Args:
        session: holds the shared context (appended; prefilled or not). It is prefilled up to the fork
            point and otherwise left as it is: the branches are forks.
        interventions: as `workbench.intervene` takes them (segment names resolved in `session`).
        continuation: what each branch appends before answering: a `TaskPrompt` (its trained question
            and the response opened with its prefix: where the model writes the answer), text (a `role`
            turn and an opened assistant turn), token ids, or a function that appends to the branch.
        target: the answer to score (text or ids), e.g. the needle's value (default for a task: its
            expected value). When the plain answer starts with chat tags the target does not, the
            scores are taken where the model writes scaffolding: a `ScoringWarning` says so (also in
            `Effects.warnings`).
        max_new_tokens, temperature, seed: the answers' generation (greedy by default; sampled with
            the same seed on both branches otherwise: deterministic).
        record_to: (plain trace, intervened trace): each branch's continuation and answer are also
            recorded there (DSA selections only; an existing trace there is replaced), so the two
            branches' reads can be compared (the DSA difference view). None: nothing is recorded.

    Returns:
        `Effects`. InputError (before anything runs) for a bad intervention, and when the session has
        already consumed a position an intervention must act on (give it a session prefilled less far).
    """
    items = resolve(session, *interventions)
    continuation, target = task_scoring(continuation, target)
    check_effects_args(session, continuation=continuation, record_to=record_to, max_new_tokens=max_new_tokens,
                       temperature=temperature, seed=seed, role=role)
    target_ids = _ids(session, target)
    fork_at = len(session.tokens)
    first = earliest_write(items)
    if first is not None and first < fork_at:
        fork_at = first
    if session.length > fork_at:
        raise InputError(f"an intervention acts from position {fork_at}, but the session has consumed "
                         f"{session.length} tokens: start from a session (or snapshot) prefilled less far")
    session.prefill(until=fork_at)
    branches = []
    plain_answer: list[int] = []
    forced: list[torch.Tensor] = []
    for intervened in (False, True):
        branch = session.fork()
        branch.progress = False  # a rerun of a few tokens: no progress bar per branch
        if intervened:
            branch.set_interventions(items)
        if record_to is not None:
            _record_branch(branch, continuation, role, Path(record_to[int(intervened)]), max_new_tokens,
                           temperature, seed)
        _continue(branch, continuation, role)
        branch.prefill()  # once per branch: the answer and both scorings fork from here
        runner = branch.fork()
        answer = [t.id for t in runner.generate(max_new_tokens, temperature=temperature, seed=seed,
                                                add_generation_prompt=False)]
        if not intervened:
            plain_answer = answer
        text = branch.tokenizer.decode(answer) if branch.tokenizer is not None else ""
        logprobs = None
        if target_ids is not None:
            scores = _forced_logprobs(branch, target_ids)
            logprobs = scores.gather(-1, torch.tensor(target_ids)[:, None])[:, 0].cpu().numpy()
        forced.append(_forced_logprobs(branch, plain_answer))
        branches.append(Branch(answer, text, logprobs))
    p, q = forced
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0.0).cpu().numpy() if len(plain_answer) else np.zeros(0)
    notes = [w for w in [_scaffold_warning(session.tokenizer, plain_answer, target_ids)] if w]
    for note in notes:
        warnings.warn(note, ScoringWarning, stacklevel=2)
    return Effects(spec_json(items), fork_at, branches[0], branches[1], target_ids, kl, notes)


def target_logprobs(base: Any, spec: Sequence[Any], continuation: Any, target: Sequence[int],
                    role: str = "user") -> np.ndarray:
    """Per-token log-probabilities of `target` after the continuation, on a fork of `base` (left as it
    is) with the interventions `spec` (engine spec objects or dataclasses, already resolved)."""
    branch = base.fork()
    branch.progress = False
    if spec:
        branch.set_interventions(list(spec))
    _continue(branch, continuation, role)
    branch.prefill()
    scores = _forced_logprobs(branch, list(target), keep=False)
    return scores[np.arange(len(target)), list(target)].cpu().numpy()
