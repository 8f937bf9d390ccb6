"""Chat transcripts in the OpenAI messages format -> session segments (`Session.append_messages`).

    messages = read_transcript("chat.json")          # a list of messages, or {"messages": [...]}
    session.append_messages(messages)                # one segment per message (plus one per image)

A message is `{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": ...}` where content
is a string, a list of parts (`{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
{"url": ...}}`) or, for an assistant message that only calls tools, null beside `tool_calls`.
"developer" is the newer name of "system". Images are `data:image/...;base64,` URLs, or local paths
(plain or `file://`) only when the caller names a root they must stay inside; remote URLs are never
fetched. Tool calls are kept as their JSON text after the message's text (the K3 format of spec
section 9 has no tool syntax of its own), so a replayed agent transcript keeps what the model saw.

Layout (the one `Session.append_message` uses): a message's images first, then its text parts
joined by newlines, inside `<|open|>message role="R"<|sep|>` ... `<|close|>message<|sep|><|end_of_msg|>`.

Everything is checked before the session changes: `parse_messages` names the message and field of
the first problem, `render_messages` preprocesses every image (ImageError naming the message) and
checks the context limit, and only `append_rendered` touches the session. A `RenderedChat` also
gives the server what it needs for prefix reuse: the token ids and where each picture lies, since
two different pictures of one size have identical ids.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import unquote, urlsplit

from engine.errors import InputError
from engine.io.files import read_limited
from engine.session.images import PreparedImage, prepare_image

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}
MAX_MESSAGES = 16384  # segments per session are bounded too; a transcript past this is not a conversation
MAX_TRANSCRIPT_BYTES = 1 << 30
MAX_IMAGE_BYTES = 32 << 20  # one encoded picture; checked on the base64 text before it is decoded
MAX_PARTS = 4096
# message-level fields that carry nothing the model reads; everything else unknown is refused
_IGNORED_FIELDS = {"name", "tool_call_id", "id", "refusal", "annotations", "audio", "function_call",
                   "reasoning_content", "prefix"}


@dataclass(frozen=True)
class TranscriptMessage:
    """One checked message.

    Attributes:
        index: its position in the transcript (errors and segment names use it).
        role: system, user, assistant or tool.
        text: the text parts joined by newlines (and tool calls as JSON), or None for images only.
        images: encoded image bytes or local paths, in order.
    """

    index: int
    role: str
    text: str | None
    images: tuple[bytes | Path, ...] = ()

    @property
    def label(self) -> str:
        return f"message {self.index} ({self.role})"


def _where(i: int, name: str = "") -> str:
    return f"message {i}" + (f" field {name!r}" if name else "")


def _text_of(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise InputError(f"{where} must be a string, got {type(raw).__name__}")
    return raw


def image_from_url(url: Any, where: str, image_root: Path | None) -> bytes | Path:
    """The picture an `image_url` names: bytes of a `data:` URL, or a path inside `image_root`."""
    if isinstance(url, dict):
        unknown = sorted(set(url) - {"url", "detail"})
        if unknown:
            raise InputError(f"{where}: unknown field(s) {unknown[:3]} (expected url, detail)")
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise InputError(f"{where}: expected an image URL string (data:image/...;base64,...)")
    if url[:5].lower() == "data:":
        header, comma, payload = url.partition(",")
        if not comma or not header.lower().endswith(";base64") or not header[5:].lower().startswith("image/"):
            raise InputError(f"{where}: a data: URL must look like data:image/png;base64,... "
                             f"(got {header[:40]!r})")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise InputError(f"{where}: the image is larger than the {MAX_IMAGE_BYTES:,} bytes allowed")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"{where}: the data: URL is not valid base64") from None
        if not data:
            raise InputError(f"{where}: the data: URL holds no bytes")
        return data
    parts = urlsplit(url)
    if parts.scheme.lower() in ("http", "https"):
        raise InputError(f"{where}: remote image URLs are not fetched; send the picture as a data: URL")
    if parts.scheme and parts.scheme.lower() != "file" and len(parts.scheme) > 1:  # "C:" is a drive, not a scheme
        raise InputError(f"{where}: unsupported image URL scheme {parts.scheme[:20]!r} (use data:)")
    if image_root is None:
        raise InputError(f"{where}: local image paths are not allowed here (no image root was given); send the "
                         "picture as a data: URL")
    raw = unquote(parts.path) if parts.scheme.lower() == "file" else url
    root = image_root.resolve()
    path = (root / raw).resolve()
    if path != root and root not in path.parents:
        raise InputError(f"{where}: image path {raw[:120]!r} is outside the image root {image_root}")
    return path


def _parts(content: list, i: int, image_root: Path | None) -> tuple[list[str], list[bytes | Path]]:
    if len(content) > MAX_PARTS:
        raise InputError(f"{_where(i, 'content')}: {len(content)} parts, more than the {MAX_PARTS} allowed")
    texts: list[str] = []
    images: list[bytes | Path] = []
    for j, part in enumerate(content):
        where = f"{_where(i, 'content')} part {j}"
        if not isinstance(part, dict):
            raise InputError(f"{where} must be an object with a \"type\", got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            texts.append(_text_of(part.get("text"), f"{where} \"text\""))
        elif kind == "image_url":
            images.append(image_from_url(part.get("image_url"), f"{where} \"image_url\"", image_root))
        else:
            raise InputError(f"{where}: unsupported part type {str(kind)[:40]!r} (text or image_url)")
    return texts, images


def _tool_calls_text(raw: Any, i: int) -> str:
    if not isinstance(raw, list):
        raise InputError(f"{_where(i, 'tool_calls')} must be a list, got {type(raw).__name__}")
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", ""), str):
            raise InputError(f"{_where(i, 'tool_calls')} entry {j}: expected "
                             "{\"function\": {\"name\": str, \"arguments\": str}}")
    return json.dumps({"tool_calls": raw}, ensure_ascii=False)


def parse_messages(raw: Any, *, image_root: Path | None = None, where: str = "messages") -> list[TranscriptMessage]:
    """Check a decoded OpenAI messages list (or `{"messages": [...]}`); InputError naming message and field."""
    if isinstance(raw, dict) and "messages" in raw:
        raw = raw["messages"]
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}: expected a non-empty list of messages ({{\"role\": ..., \"content\": ...}})")
    if len(raw) > MAX_MESSAGES:
        raise InputError(f"{where}: {len(raw):,} messages, more than the {MAX_MESSAGES:,} allowed")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise InputError(f"{_where(i)} must be an object with \"role\" and \"content\", got {type(msg).__name__}")
        unknown = sorted(set(msg) - {"role", "content", "tool_calls"} - _IGNORED_FIELDS)
        if unknown:
            raise InputError(f"{_where(i)}: unknown field(s) {[u[:40] for u in unknown[:3]]}")
        role = msg.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise InputError(f"{_where(i, 'role')}: expected one of system, developer, user, assistant, tool; "
                             f"got {str(role)[:40]!r}")
        content = msg.get("content")
        texts: list[str] = []
        images: list[bytes | Path] = []
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts, images = _parts(content, i, image_root)
        elif content is not None or "tool_calls" not in msg:
            raise InputError(f"{_where(i, 'content')}: expected a string or a list of parts, got "
                             f"{type(content).__name__}")
        if images and role not in ("user", "tool"):
            raise InputError(f"{_where(i, 'content')}: images belong in user (or tool) messages, not {role}")
        if "tool_calls" in msg and msg["tool_calls"] is not None:
            if role != "assistant":
                raise InputError(f"{_where(i, 'tool_calls')}: only assistant messages call tools")
            texts.append(_tool_calls_text(msg["tool_calls"], i))
        text = "\n".join(texts) if texts else None
        # an assistant reply may be empty text: a reasoning model's whole answer can be its thinking,
        # which clients keep apart and send back as "" content
        if not text and not images and not (role == "assistant" and text is not None):
            raise InputError(f"{_where(i, 'content')}: the message is empty (no text, no image)")
        out.append(TranscriptMessage(i, role, text if text or role == "assistant" else None, tuple(images)))
    return out


def read_transcript(path: str | Path) -> list[TranscriptMessage]:
    """A transcript file (JSON: a messages list or an object with `messages`); local image paths resolve
    next to the file and must stay inside its directory."""
    path = Path(path)
    raw = read_limited(path, "a JSON transcript", InputError, MAX_TRANSCRIPT_BYTES)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise InputError(f"{path}: not valid JSON ({str(exc)[:200]})") from None
    try:
        return parse_messages(data, image_root=path.parent, where=str(path))
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


@dataclass
class ChatPiece:
    """One future segment: its ids, and the prepared picture when it is an image segment."""

    ids: list[int]
    role: str
    name: str
    image: PreparedImage | None = None
    head: list[int] = field(default_factory=list)  # chat tags before an image's media ids
    tail: list[int] = field(default_factory=list)  # ... and after them


@dataclass
class RenderedChat:
    """A conversation as token ids, split into the segments it becomes.

    Attributes:
        ids: every token id, in order.
        pieces: the segments (their ids concatenate to `ids`).
        images: (first media position, end, pixel sha256) of every picture.
    """

    ids: list[int]
    pieces: list[ChatPiece]
    images: list[tuple[int, int, str]]


# (ids rendered so far, an assistant message's text) -> the exact ids that message had when this server
# generated it, or None; lets a client's next turn reproduce what the model saw, token for token
ReplyLookup = Callable[[list[int], str], "list[int] | None"]


def render_messages(model: Any, tokenizer: Any, messages: Sequence[TranscriptMessage], *,
                    add_generation_prompt: bool = False, start: int = 0,
                    replies: ReplyLookup | None = None, open_response: bool = False,
                    continue_final: bool = False) -> RenderedChat:
    """Token ids of `messages` (images preprocessed, no tower run, nothing changed).

    Args:
        start: tokens already before the messages (the context limit counts them).
        replies: exact ids of assistant messages a server generated (see `ReplyLookup`).
        open_response: after the generation prompt, also close the (empty) `think` section and open
            `response` (a model trained to answer without thinking writes its answer at once).
        continue_final: the last message is an assistant message of text to continue: it becomes the
            start of an open response after the generation prompt (vLLM's `continue_final_message`).
    The generation prompt (with what it opens) is always the last piece.
    """
    if tokenizer is None:
        raise InputError("chat messages need a tokenizer")
    final = None
    if continue_final:
        if not messages or messages[-1].role != "assistant" or messages[-1].images or messages[-1].text is None:
            raise InputError("continue_final_message needs a last message from the assistant, of text only")
        final, messages = messages[-1], messages[:-1]
    ids: list[int] = []
    pieces: list[ChatPiece] = []
    images: list[tuple[int, int, str]] = []
    for m in messages:
        head, tail = tokenizer.message_frame(m.role)
        known = replies(ids, m.text) if replies is not None and m.role == "assistant" and m.text is not None else None
        if known is not None:
            pieces.append(ChatPiece(list(known), m.role, m.label))
            ids.extend(known)
            continue
        body: list[ChatPiece] = []
        for k, source in enumerate(m.images):
            name = source.name if isinstance(source, Path) else f"{m.label} image {k}"
            try:
                prepared = prepare_image(model, tokenizer, source, name)
            except InputError as exc:
                raise type(exc)(f"{m.label}: {exc}") from None
            body.append(ChatPiece([], m.role, name, image=prepared))
        if m.text is not None:
            body.append(ChatPiece(tokenizer.encode(m.text), m.role, m.label))
        body[0].head, body[-1].tail = head, tail
        for piece in body:
            if piece.image is not None:
                first = start + len(ids) + len(piece.head) + piece.image.pad_at
                images.append((first, first + piece.image.rows * piece.image.cols, piece.image.processed.sha256))
                piece.ids = piece.head + piece.image.ids + piece.tail
            else:
                piece.ids = piece.head + piece.ids + piece.tail
            ids.extend(piece.ids)
            pieces.append(piece)
    if add_generation_prompt or final is not None:
        prompt = tokenizer.chat_prompt([], add_generation_prompt=True)
        if final is not None or open_response:
            prompt = prompt + tokenizer.response_prefix(final.text if final is not None else "")
        pieces.append(ChatPiece(prompt, "assistant", "assistant"))
        ids.extend(prompt)
    limit = model.config.max_position_embeddings
    if start + len(ids) > limit:
        raise InputError(f"the conversation holds {start + len(ids)} tokens; the model's limit is {limit}")
    return RenderedChat(ids, pieces, images)


def append_rendered(session: Any, chat: RenderedChat, *, skip: int = 0) -> list:
    """Append `chat`'s pieces to `session` (an `engine.session.Session`), leaving out its first `skip`
    tokens, which the session already holds (a cut inside a piece appends that piece's rest as raw ids;
    a picture is never cut: `skip` never falls inside one). Runs each picture's tower. Returns the segments."""
    out = []
    offset = 0
    for piece in chat.pieces:
        end = offset + len(piece.ids)
        if end <= skip:
            offset = end
            continue
        if piece.image is not None:
            if offset < skip:
                raise InputError("a cached prefix may not end inside a picture")
            session._run_tower(piece.image)
            out.append(session._commit_image(piece.image, piece.head, piece.tail, role=piece.role, kind=None))
        else:
            rest = piece.ids[max(skip - offset, 0):]
            out.append(session.append(ids=rest, kind="turn", name=piece.name, role=piece.role))
        offset = end
    return out
