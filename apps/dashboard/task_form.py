"""Drive mode's task templates: ask a small trained model what it was trained to answer.

`builtin:demo` answers its trained tasks (find a fact in documents, say what a simple 64 x 64
picture shows) in its trained format and nonsense to anything else. The form puts the user's input
into that format with `workbench.task_templates`: the fact the user types or picks (from the facts
found in the uploaded documents) is written in the trained wording inside their own documents, the
question is the trained one and the response is prefilled with the restated key. Free-form chat
stays one choice away; for a model whose card has a notice, the notice is shown beside it, with
the template one click away, and the free-form answer is still shown exactly as generated.

The form holds no session and runs nothing: `task_prompt()` builds the question the runner asks
(`workbench.task_templates.append_task` then `answer_task`, with the what-if branch points kept
between them), and the runner sets the card when the model changes.
"""

from __future__ import annotations

import io
import random
from typing import Any

import panel as pn
import param

from apps.dashboard.components.panes import AlertText, alert_text, set_text, text_pane
from apps.dashboard.picture_note import PICTURE_HINT, TRAINED_PICTURE_SIZE

FIND_FACT = "Find a fact in my documents"
PICTURE = "Ask about a picture"
FREE_FORM = "Free-form chat"
# the form's labels and the template names of `workbench.task_templates.TASKS`
TASK_NAMES = {FIND_FACT: "find-fact", PICTURE: "picture", FREE_FORM: "free-form"}
TYPED = "(none: use the fact typed above)"
# the trained pictures' size, and the pictures the model was trained on in one line (shown when its card
# lists the picture task; `workbench run --task picture` prints the same)
SAMPLE_SIZE = TRAINED_PICTURE_SIZE


def task_label(name: str) -> str:
    """The form's label of a template name ("find-fact" -> "Find a fact in my documents")."""
    return next(label for label, n in TASK_NAMES.items() if n == name)


def fact_label(fact: Any, names: list[str]) -> str:
    """How a found fact is offered: 'greenhouse alarm: 3-8-2-5 (notes.txt)'."""
    where = names[fact.document] if 0 <= fact.document < len(names) else "?"
    return f"{fact.key}: {fact.value} ({where})"


def sample_picture(attribute: str, seed: int) -> tuple[bytes, dict[str, str], str]:
    """A picture of the trained kind for a question about `attribute`: (PNG bytes, what was drawn,
    'shape' or 'digit'). A digit question gets a digit, every other question a shape."""
    from workbench.shape_pictures import draw_digit, draw_shape

    rng = random.Random(seed)
    picture = draw_digit(rng, SAMPLE_SIZE) if attribute == "digit" else draw_shape(rng, SAMPLE_SIZE)
    out = io.BytesIO()
    picture.image.save(out, format="PNG")
    return out.getvalue(), dict(picture.attributes), picture.kind


class TaskForm(pn.viewable.Viewer):
    """Task choice and its fields; `task_prompt()` is the templated question (or None for free-form)."""

    task = param.Selector(default=FREE_FORM, objects=list(TASK_NAMES), doc="what to ask the model")
    key = param.String(default="", doc="the fact's name, e.g. 'greenhouse alarm'")
    value = param.String(default="", doc="the fact's value, e.g. '3-8-2-5' (what the answer should be)")
    fact = param.Selector(default=TYPED, objects=[TYPED], doc="a fact found in the uploaded documents")
    depth = param.Number(default=0.5, bounds=(0.0, 1.0), step=0.05,
                         doc="where a typed fact is inserted in the longest document (0 = start, 1 = end)")
    attribute = param.Selector(default="colour", objects=["colour", "shape", "position", "digit"],
                               doc="what to ask about the picture")
    card = param.Parameter(default=None, doc="the model's prompting card (`workbench.task_templates.ModelCard`)")
    style = param.String(default="key", doc="the model's answer style (`workbench.retrieval_text.answer_prefix`)")
    documents = param.List(default=[], doc="the uploaded text documents, (name, text) in context order")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._found: dict[str, Any] = {}  # fact label -> FoundFact
        self.preview = text_pane("", sizing_mode="stretch_width", css_classes=["k3-task-preview"])
        self.picture_hint = text_pane("", sizing_mode="stretch_width", css_classes=["k3-task-picture-hint"])
        self.notice = AlertText("", alert_type="info", visible=False, sizing_mode="stretch_width",
                                css_classes=["k3-task-notice"])
        self.use_template = pn.widgets.Button(label="Use the find-a-fact template", width=240, visible=False)
        self.use_template.on_click(lambda _: self.use_first_template())
        self.sample_button = pn.widgets.Button(label="Use a sample picture", width=180)
        self._fact_fields = pn.Column(
            pn.widgets.TextInput.from_param(self.param.key, label="Key"),
            pn.widgets.TextInput.from_param(self.param.value, label="Value"),
            pn.widgets.Select.from_param(self.param.fact, label="Facts found in your documents"),
            pn.widgets.FloatSlider.from_param(self.param.depth, label="Depth of a typed fact"),
            sizing_mode="stretch_width", visible=False)
        self._picture_fields = pn.Column(
            pn.widgets.Select.from_param(self.param.attribute, label="Ask about the picture's"),
            self.sample_button, self.picture_hint, sizing_mode="stretch_width", visible=False)
        self._show()

    # ---- state --------------------------------------------------------------------------------
    @property
    def name_of_task(self) -> str:
        """The chosen template's name: "find-fact", "picture" or "free-form"."""
        return TASK_NAMES[self.task]

    def set_card(self, card: Any, style: str = "key") -> None:
        """A new model: its card's first task becomes the choice (free-form when it lists none)."""
        self.style = style
        self.card = card
        tasks = tuple(getattr(card, "tasks", ()) or ())
        self.task = task_label(tasks[0]) if tasks else FREE_FORM
        self._show()

    def use_first_template(self) -> None:
        """The notice's button: switch to the card's first template (find a fact for `builtin:demo`)."""
        tasks = tuple(getattr(self.card, "tasks", ()) or ())
        if tasks:
            self.task = task_label(tasks[0])

    @param.depends("documents", watch=True)
    def _find_facts(self) -> None:
        from workbench.task_templates import find_facts

        names = [n for n, _ in self.documents]
        self._found = {}
        for fact in find_facts(self.documents):
            label = fact_label(fact, names)
            if label in self._found:  # the same fact twice in one document: each sentence its own choice
                label = f"{label} #{sum(k.startswith(label) for k in self._found) + 1}"
            self._found[label] = fact
        self.param.fact.objects = [TYPED, *self._found]
        if self.fact not in self.param.fact.objects:
            self.fact = TYPED
        self._show()

    @param.depends("fact", watch=True)
    def _picked(self) -> None:
        found = self._found.get(self.fact)
        if found is not None:
            self.key, self.value = found.key, found.value

    @property
    def picked(self) -> Any:
        """The found fact chosen in the select (a `FoundFact`), or None for a typed fact."""
        return self._found.get(self.fact)

    def task_prompt(self) -> Any:
        """The templated question (`workbench.task_templates.TaskPrompt`) of the chosen task, or None for
        free-form. A picture question's kind is left to the caller (`picture_prompt`). Bad fields raise
        InputError naming them."""
        from workbench.task_templates import fact_task, picture_task

        if self.name_of_task == "find-fact":
            return fact_task(self.documents, self.key, self.value, found=self.picked, depth=self.depth,
                             style=self.style)
        if self.name_of_task == "picture":
            return picture_task(self.attribute)
        return None

    def verdict_source(self) -> str:
        """What a find-fact answer is judged against, in words."""
        found = self.picked
        if found is not None and self.value.strip() == found.value:
            return "the value in your document"
        return "the value you typed"

    # ---- showing ------------------------------------------------------------------------------
    @param.depends("task", "key", "value", "depth", "attribute", "card", watch=True)
    def _show(self) -> None:
        name = self.name_of_task
        self._fact_fields.visible = name == "find-fact"
        self._picture_fields.visible = name == "picture"
        card = self.card
        notice = getattr(card, "notice", "") if name == "free-form" else ""
        tasks = tuple(getattr(card, "tasks", ()) or ())
        self.notice.object = alert_text(notice)
        self.notice.visible = bool(notice)
        self.use_template.visible = bool(notice and tasks)
        if tasks:
            self.use_template.name = f"Use the {'find-a-fact' if tasks[0] == 'find-fact' else tasks[0]} template"
        set_text(self.picture_hint, PICTURE_HINT if "picture" in tasks else
                 "This model's card lists no picture task: its answers about pictures are untrained.")
        set_text(self.preview, self._preview_text())

    def _preview_text(self) -> str:
        from engine.errors import InputError
        from workbench.task_templates import fact_sentence

        name = self.name_of_task
        if name == "free-form":
            return ""
        if name == "find-fact" and not self.key.strip():
            return "Type the fact's key and value, or pick a fact found in your documents."
        try:
            task = self.task_prompt()
        except InputError as exc:
            return f"error: {exc}"
        lines = [f"asked:           {task.question}", f"answer starts:   {task.prefix!r}"]
        if name == "find-fact":
            d, start, _ = task.fact
            doc, text = task.documents[d]
            lines.append(f"fact written as: {fact_sentence(self.key.strip(), task.expected).strip()!r}")
            if not self.documents:
                lines.append(f"no documents uploaded: the fact is asked about a one-line document ({doc}) holding "
                             "only it; upload text to ask about your own")
            elif self.picked is not None:
                lines.append(f"placed in {doc}, in place of the sentence you picked")
            else:
                lines.append(f"placed in {doc}, {100 * start / max(1, len(text)):.0f}% of the way through")
        else:
            lines.append("sent: the system line, the last picture uploaded and the question (text documents "
                         "are not sent with a picture question)")
        return "\n".join(lines)

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Column(
            pn.widgets.Select.from_param(self.param.task, label="Task"),
            self._fact_fields, self._picture_fields, self.preview,
            sizing_mode="stretch_width", css_classes=["k3-task-form"])
