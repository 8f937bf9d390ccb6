"""Drive mode: run a recorded model session from the browser, then follow its trace like any other.

The runner loads the chosen model (a preset or a checkpoint directory), builds a `Session` from the
uploaded documents and images (checked and size-limited on the server: `uploads.py`) and the prompt, and runs it with `workbench.record(...)` in a background thread
that writes a new trace directory under `runs_dir`. The dashboard state is pointed at that
directory, so the views see the session exactly as they would see a `torchrun` job's trace: one
data path for both modes. Stop asks the session to stop after its current step.

Nothing in the recording thread touches Panel or Bokeh objects: it leaves its outcome in a slot
that `poll()` (called from the dashboard's periodic callback, on the event loop) applies.

A task template (`task_form.py`) asks a trained model what it was trained to answer, in its trained
wording; the model's card (`workbench.task_templates.card_of`) picks the task and the sampling
defaults whenever the model changes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import panel as pn
import param

from apps.dashboard.attribute_panel import AttributePanel
from apps.dashboard.components.panes import AlertText, alert_text, set_text, text_pane
from apps.dashboard.follower import DashboardState
from apps.dashboard.task_form import FREE_FORM, TaskForm, sample_picture
from apps.dashboard.uploads import (BROWSER_MAX_FILE_SIZE, IMAGE_SUFFIXES, TEXT_SUFFIXES, BoundedFileDropper,
                                    UploadError, classify_upload)
from apps.dashboard.what_if import RerunBase, WhatIfPanel, keep_branch_points

PRESETS = ["preset:tiny", "preset:demo"]
ANSWER_CHARS = 300  # of the answer shown in the status line (the trace holds every token)
DEFAULT_PROMPT = "Which document mentions the vault code, and what is it?"

# one loaded model per process: models are large, sessions of one dashboard run one at a time
_MODELS: dict[str, Any] = {}
_MODELS_LOCK = threading.Lock()
# one recorded session per process: the pages of all users share the cached model, and a model's probe
# points take one recorder at a time; a second Generate is refused with a message, not a RuntimeError
_RUN_LOCK = threading.Lock()


def load_cached_model(name: str) -> tuple[Any, Any]:
    """(model, tokenizer) for a builtin, preset or checkpoint directory, loaded once per process (raises EngineError)."""
    from workbench.sessions import load_with_tokenizer

    with _MODELS_LOCK:
        if name not in _MODELS:
            _MODELS.clear()
            _MODELS[name] = load_with_tokenizer(name)
        return _MODELS[name]


def find_models(extra: list[str] | None = None, search: list[Path] | None = None) -> list[str]:
    """Model choices: `extra` (e.g. --model), the shipped trained models (`builtin:demo`, the default),
    checkpoint directories under `search`, and the random-weight presets."""
    from workbench.sessions import builtin_models

    found = list(extra or []) + builtin_models()
    for root in search or []:
        if root.is_dir():
            found += sorted(str(p.parent) for p in root.glob("*/config.json"))
    return list(dict.fromkeys(found + PRESETS))


def generate_answer(session: Any, max_new: int, temperature: float) -> tuple[int, str]:
    """Generate until the chat format says the answer ended (`engine.session.chat_response`), as `workbench run`
    does; returns (tokens generated, the answer's text)."""
    from engine.session.answer import generate_answer as answer_loop

    answer = answer_loop(session, max_new_tokens=max_new, temperature=temperature)
    return answer.generated, answer.text


@dataclass(frozen=True)
class TemplatedQuestion:
    """A templated run as the form built it, handed to the recording thread."""

    task: Any                          # `workbench.task_templates.TaskPrompt`
    images: list[tuple[str, bytes]]    # the picture sent with a picture question, (name, bytes)
    judged_by: str                     # what the answer is judged against, in words ("the value you typed")
    chance: int = 0                    # values a uniform guess picks from (a picture attribute's), 0: negligible


def answer_status(task: Any, answer: Any, judged_by: str, max_new: int, chance: int = 0) -> str:
    """The status line's answer of a templated run: 'answer: greenhouse alarm: 3-8-2-5 (right: the value
    you typed)'; wrong answers say what was expected, an unfinished response says so. With `chance`, a
    right answer is shown beside how often a uniform guess among that many values is right."""
    text = f"answer: {answer.text[:ANSWER_CHARS]}"
    if task.expected is None:
        return text + ("" if answer.closed else f" (the response did not end within {max_new} new tokens)")
    if answer.correct:
        guess = f"; a guess is right 1 time in {chance}" if chance else ""
        return f"{text} (right: {judged_by}{guess})"
    why = "" if answer.closed else f"; the response did not end within {max_new} new tokens"
    return f"{text} (wrong: {judged_by} is {task.expected}{why})"


class SessionRunner(pn.viewable.Viewer):
    """Model picker, prompt box, document upload, Generate/Stop: a recorded session in a thread."""

    state = param.ClassSelector(class_=DashboardState, doc="dashboard state; pointed at each new run's trace")
    model = param.Selector(default="preset:tiny", objects=PRESETS, doc="preset or checkpoint directory to run")
    prompt = param.String(default=DEFAULT_PROMPT, doc="the question, sent as a user message after the documents")
    chat = param.Boolean(default=True, doc="wrap the prompt as a chat message and open an assistant turn")
    max_new_tokens = param.Integer(default=48, bounds=(1, 4096), doc="tokens to generate")
    temperature = param.Number(default=1.0, bounds=(0.0, 2.0), doc="sampling temperature (0 = greedy)")
    prefill_chunk = param.Integer(default=512, bounds=(16, 65536),
                                  doc="tokens per prefill step (smaller = more frequent live updates)")
    max_upload_bytes = param.Integer(default=4 << 20, bounds=(1, None), doc="largest accepted upload, bytes")
    max_kept_bytes = param.Integer(default=16 << 20, bounds=(1, None),
                                   doc="most bytes of uploads kept at once (further uploads are refused)")
    runs_dir = param.String(default="traces", doc="directory where recorded sessions are written")
    documents = param.List(default=[], doc="uploads in context order: [name, text] (a document) or "
                                           "[name, bytes] (a PNG, JPEG or WebP image)")
    running = param.Boolean(default=False, doc="whether a session is running")
    message = param.String(default="", doc="status or error of the last action")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._session = None
        self._thread: threading.Thread | None = None
        self._outcome: tuple[str, str] | None = None  # (kind, text) left by the thread for poll()
        self._lock = threading.Lock()
        self.dropper = BoundedFileDropper(max_file_size=BROWSER_MAX_FILE_SIZE,
                                          max_bytes=self.max_upload_bytes, chunk_size=1 << 20, multiple=True,
                                          accepted_filetypes=TEXT_SUFFIXES + IMAGE_SUFFIXES,
                                          sizing_mode="stretch_width", height=110)
        self.dropper.param.watch(self._uploaded, "value")
        self.dropper.param.watch(self._refused, "refused")
        self.generate_button = pn.widgets.Button(label="Generate", color="primary", width=110)
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", width=90, disabled=True)
        self.generate_button.on_click(lambda _: self.generate())
        self.stop_button.on_click(lambda _: self.stop())
        self.alert = AlertText("", alert_type="info", visible=False, sizing_mode="stretch_width")
        self.doc_list = text_pane("", sizing_mode="stretch_width")
        self._list_documents()
        # the last session's branch points and model config, published once its recording closed
        self._rerun_base: tuple[RerunBase | None, Any] = (None, None)
        # a rerun writes the trace's effects table after the recording finished: wake the follower so the
        # effects view shows it now, not after a reload
        # what-if and attribute act on a driven session's answer: they join the page with the first one
        # (before it they can do nothing, and their ~100 models would cost every page's first paint)
        self.answer_tools = pn.Column(sizing_mode="stretch_width", margin=0, css_classes=["k3-answer-tools"])
        self.what_if = WhatIfPanel(lambda: self._rerun_base, _RUN_LOCK, on_written=self._effects_written,
                                   selected=lambda: self.state.position if self.state is not None else None)
        # "Attribute": which spans of the context the last answer came from (`workbench.attribute` on the same
        # kept base, under the same lock), written into the trace for the attribution view
        self._task: Any = None  # the last run's templated question (None: free-form), published with the base
        self.attribution = AttributePanel(lambda: (self._rerun_base[0], self._task), _RUN_LOCK,
                                          on_written=self._effects_written)
        self.tasks = TaskForm()
        self.tasks.sample_button.on_click(lambda _: self.add_sample_picture())
        self.tasks.param.watch(self._task_changed, "task")
        self._documents_to_tasks()
        self._samples: dict[str, tuple[dict[str, str], str]] = {}  # sample picture name -> (what was drawn, kind)
        # Panel caps a text area at 5,000 characters by default: long pasted prompts are the point here
        self.free_form_inputs = pn.Column(
            pn.widgets.TextAreaInput.from_param(self.param.prompt, label="Prompt", height=90, max_length=1 << 20),
            pn.widgets.Checkbox.from_param(self.param.chat, label="Chat message"),
            sizing_mode="stretch_width", visible=self.tasks.task == FREE_FORM)

    # ---- inputs ---------------------------------------------------------------------------------
    def _uploaded(self, event: param.parameterized.Event) -> None:
        added, errors = [], []
        kept = sum(len(p) if isinstance(p, bytes) else len(p.encode("utf-8")) for _, p in self.documents)
        known = {n for n, _ in self.documents}
        for name, content in (event.new or {}).items():
            try:
                upload = classify_upload(str(name), content, self.max_upload_bytes)
            except UploadError as exc:
                errors.append(str(exc))
                continue
            if upload.name in known:
                continue
            if kept + upload.size > self.max_kept_bytes:
                errors.append(f"{name}: the uploads kept would pass {self.max_kept_bytes:,} bytes; clear some first")
                continue
            kept += upload.size
            known.add(upload.name)
            added.append([upload.name, upload.payload])
        if added:
            self.documents = self.documents + added
        if errors:
            self.message = "error: " + "; ".join(errors)
        elif added:
            images = sum(isinstance(p, bytes) for _, p in added)
            what = [f"{n} {kind}(s)" for n, kind in ((len(added) - images, "document"), (images, "image")) if n]
            self.message = "added " + " and ".join(what)

    def _refused(self, event: param.parameterized.Event) -> None:
        if event.new:
            self.message = "error: " + event.new[-1]

    @param.depends("model", watch=True)
    def _model_changed(self) -> None:
        """The new model's card sets the task, the temperature and the new tokens (greedy and 48 for
        `builtin:demo`); a card that cannot be read is an error message and leaves free-form chat."""
        from engine import EngineError
        from workbench.task_templates import answer_style, card_of

        try:
            card, style = card_of(self.model), answer_style(self.model)
        except (EngineError, OSError, ValueError) as exc:
            self.tasks.set_card(None)
            self.message = f"error: {exc}"
            return
        self.tasks.set_card(card, style)
        self.temperature = float(card.temperature)
        self.max_new_tokens = int(min(max(card.max_new_tokens, 1), self.param.max_new_tokens.bounds[1]))

    def _task_changed(self, event: param.parameterized.Event) -> None:
        self.free_form_inputs.visible = event.new == FREE_FORM

    def add_sample_picture(self) -> None:
        """Add a 64 x 64 picture of the kind the model was trained on to the uploads (for the picture task)."""
        n = len(self._samples) + 1
        payload, drawn, kind = sample_picture(self.tasks.attribute, seed=n)
        name = f"sample picture {n} ({', '.join(drawn.values())}).png"
        self._samples[name] = (drawn, kind)
        self.documents = self.documents + [[name, payload]]
        self.message = f"added {name}"

    @param.depends("documents", watch=True)
    def _documents_to_tasks(self) -> None:
        self.tasks.documents = [(n, p) for n, p in self.documents if isinstance(p, str)]

    @param.depends("documents", watch=True)
    def _list_documents(self) -> None:
        set_text(self.doc_list, "\n".join(f"{name} (image, {len(p) // 1024:,} KB)" if isinstance(p, bytes) else
                                          f"{name} ({len(p):,} chars)" for name, p in self.documents) or
                 "(no documents uploaded)")

    @param.depends("message", watch=True)
    def _show_message(self) -> None:
        error = self.message.startswith("error:")
        self.alert.object = alert_text(self.message)
        self.alert.alert_type = "danger" if error else "info"
        self.alert.visible = bool(self.message)

    @param.depends("running", watch=True)
    def _buttons(self) -> None:
        self.generate_button.disabled = self.running
        self.stop_button.disabled = not self.running

    def clear_documents(self) -> None:
        self.documents = []

    # ---- running ------------------------------------------------------------------------------
    def generate(self) -> Path | None:
        """Start a recorded session in a thread and follow its trace; returns the trace directory."""
        if self.running:
            self.message = "error: a session is already running; stop it first"
            return None
        try:
            templated = self._templated()
        except ValueError as exc:  # engine's InputError is a ValueError: a field of the form names the problem
            self.message = f"error: {exc}"
            return None
        if templated is None and not self.prompt.strip() and not self.documents:
            self.message = "error: write a prompt or upload a document"
            return None
        if not _RUN_LOCK.acquire(blocking=False):
            self.message = ("error: another session is running on this server (started from another page); "
                            "try again when it has finished")
            return None
        trace = Path(self.runs_dir) / time.strftime("session-%Y%m%d-%H%M%S")
        n = 1
        while trace.exists():
            n += 1
            trace = trace.with_name(f"{trace.name.split('~')[0]}~{n}")
        self.running = True
        self.message = f"loading {self.model} and recording to {trace} …"
        self.state.follow(trace)
        self.state.start()
        args = (self.model, list(self.documents), self.prompt, self.chat, self.max_new_tokens, self.temperature,
                self.prefill_chunk, trace, templated)
        self._thread = threading.Thread(target=self._run_locked, args=args, name="session-runner", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            _RUN_LOCK.release()
            raise
        return trace

    def _templated(self) -> TemplatedQuestion | None:
        """The chosen template's question (None for free-form); InputError naming a bad field."""
        from engine.errors import InputError
        from workbench.shape_pictures import ATTRIBUTE_VALUES
        from workbench.task_templates import picture_task

        task = self.tasks.task_prompt()
        if task is None:
            return None
        if task.task == "find-fact":
            return TemplatedQuestion(task, [], self.tasks.verdict_source())
        images = [(n, p) for n, p in self.documents if isinstance(p, bytes)][-1:]  # trained on one picture
        if not images:
            raise InputError("a picture question needs a picture: upload one or press 'Use a sample picture'")
        drawn, kind = self._samples.get(images[0][0], ({}, None))
        if kind is not None:  # a sample picture: its question is worded for its kind, its answer known
            task = dataclasses.replace(picture_task(self.tasks.attribute, kind), expected=drawn.get(self.tasks.attribute))
        return TemplatedQuestion(task, images, f"the sample picture's {self.tasks.attribute}",
                                 ATTRIBUTE_VALUES.get(self.tasks.attribute, 0))

    def _run_locked(self, *args: Any) -> None:
        try:
            self._run(*args)
        finally:
            _RUN_LOCK.release()

    def stop(self) -> None:
        """Ask the running session to stop after its current step."""
        with self._lock:
            if self._session is not None:
                self._session.request_stop()
                self.message = "stopping after the current step …"

    def _run(self, model_name: str, documents: list, prompt: str, chat: bool, max_new: int, temperature: float,
             chunk: int, trace: Path, templated: TemplatedQuestion | None = None) -> None:
        import workbench
        from engine import EngineError
        from workbench.sessions import recorded_session
        from workbench.task_templates import answer_task, append_task

        self._rerun_base = (None, None)
        self._task = None
        try:
            with recorded_session(model_name, trace, prefill_chunk=chunk, progress=False,
                                  loader=load_cached_model) as run:
                session = run.session
                with self._lock:
                    self._session = session
                if templated is not None:
                    # the context, then (after the what-if branch points) the answer: `ask`'s two steps
                    append_task(session, templated.task, images=[p for _, p in templated.images] or None,
                                image_names=[n for n, _ in templated.images] or None)
                else:
                    for name, payload in documents:
                        if isinstance(payload, bytes):
                            session.append(image=payload, name=name)
                        else:
                            session.append(payload, name=name)
                    if prompt.strip():
                        session.append(prompt, role="user" if chat else None, name="prompt")
                base = keep_branch_points(session, trace)
                if templated is not None:
                    found = answer_task(session, templated.task, max_new_tokens=max_new, temperature=temperature)
                    generated = found.generated
                    answer_line = answer_status(templated.task, found, templated.judged_by, max_new,
                                                templated.chance)
                else:
                    generated, answer = generate_answer(session, max_new, temperature)
                    answer_line = f"answer: {answer[:ANSWER_CHARS]}" if answer.strip() else ""
                tokens = session.tokens[len(base.end.tokens):]
                base.opening, base.answer = tuple(tokens[:-generated]), tuple(tokens[-generated:])
            # published after the recording closed: a rerun's forward passes are never recorded into it
            self._task = templated.task if templated is not None else None
            self._rerun_base = (base, session.config) if generated else (None, None)
            self._outcome = ("done", f"recorded {len(session.tokens):,} tokens ({generated} generated) to {trace}"
                                     + (f"; {answer_line}" if answer_line else ""))
        except (EngineError, workbench.TraceError, OSError, ValueError) as exc:
            self._outcome = ("error", f"error: {exc}")
        except Exception as exc:  # a bug: still tell the user, and keep the server alive
            self._outcome = ("error", f"error: session failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._session = None

    def _effects_written(self) -> None:
        if self.state is not None and self.state.follower is not None:
            self.state.follower.wake()

    @property
    def kept_base(self) -> RerunBase | None:
        """The last session's kept base (its context prefilled, the answer's opening and tokens), or None."""
        return self._rerun_base[0]

    @property
    def model_lock(self) -> threading.Lock:
        """The server's one-model-at-a-time lock (sessions, reruns, attributions, the lens)."""
        return _RUN_LOCK

    def poll(self) -> None:
        """Apply what the recording thread left (event loop only)."""
        outcome, self._outcome = self._outcome, None
        if outcome is not None:
            self.message = outcome[1]
            self.running = False
        elif self.running and self._thread is not None and not self._thread.is_alive():
            self.running = False
        if self._rerun_base[0] is not None and not self.answer_tools.objects:
            self.answer_tools.objects = [self.what_if, self.attribution]
        self.what_if.poll()
        self.attribution.poll()

    def __panel__(self) -> pn.viewable.Viewable:
        clear = pn.widgets.Button(label="Clear documents", width=140)
        clear.on_click(lambda _: self.clear_documents())
        return pn.Column(
            pn.pane.Markdown("### Drive a session"),
            pn.widgets.Select.from_param(self.param.model, label="Model"),
            self.tasks, self.free_form_inputs,
            pn.Row(pn.widgets.IntInput.from_param(self.param.max_new_tokens, label="New tokens", width=110),
                   pn.widgets.FloatInput.from_param(self.param.temperature, label="Temperature", width=110)),
            pn.pane.Markdown(f"Documents and images (text, PNG, JPEG, WebP; up to "
                             f"{self.max_upload_bytes // 1024:,} KB each)"),
            self.dropper, self.doc_list, clear,
            self.tasks.notice, self.tasks.use_template,
            pn.Row(self.generate_button, self.stop_button), self.alert, self.answer_tools,
            sizing_mode="stretch_width", css_classes=["k3-runner"])
