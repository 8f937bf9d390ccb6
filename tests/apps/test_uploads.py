"""Drive-mode uploads: images and documents checked by their bytes, sizes limited on the server as chunks
arrive (no browser: upload events are fed to the widget as the browser would send them)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from apps.dashboard.session_runner import SessionRunner
from apps.dashboard.follower import DashboardState
from apps.dashboard.uploads import BoundedFileDropper, UploadError, classify_upload

MIB = 1 << 20


def _image(fmt: str, size=(64, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def _chunks(dropper: BoundedFileDropper, name: str, data_chunks: list, mime: str = "image/png") -> None:
    total = len(data_chunks)
    for i, chunk in enumerate(data_chunks, 1):
        dropper._process_event(SimpleNamespace(event_name="upload_event", data={
            "name": name, "chunk": i, "total_chunks": total, "data": chunk, "type": mime}))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_images_are_recognised_by_their_bytes(fmt: str) -> None:
    upload = classify_upload(f"chart.{fmt.lower()}", _image(fmt), 4 * MIB)
    assert upload.kind == "image" and isinstance(upload.payload, bytes)


@pytest.mark.parametrize("name, data, problem", [
    ("truncated.png", _image("PNG")[:60], "truncated.png:"),
    ("fake.png", b"just some text pretending", "not a PNG, JPEG or WebP"),
    ("blob.bin", b"\xff\xfe\x00\x01", "not UTF-8"),
    ("empty.txt", b"", "empty file"),
    ("big.png", _image("PNG") + b"\0" * 2000, "upload limit"),
])
def test_bad_uploads_get_one_line(name: str, data: bytes, problem: str) -> None:
    with pytest.raises(UploadError) as err:
        classify_upload(name, data, 1500 if name == "big.png" else 4 * MIB)
    assert problem in str(err.value) and "\n" not in str(err.value) and name in str(err.value)


def test_decompression_bomb_is_refused_before_decoding() -> None:
    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, format="PNG")  # 100M pixels in a few kB
    with pytest.raises(UploadError, match="bomb|too large|pixels"):
        classify_upload("bomb.png", buf.getvalue(), 4 * MIB)


def test_oversized_upload_is_dropped_as_chunks_arrive() -> None:
    """Issue 11 item 9: three 60 MB uploads with the page's limit lifted are neither buffered whole nor kept."""
    dropper = BoundedFileDropper(max_bytes=4 * MIB, chunk_size=MIB)
    received = []
    dropper.param.watch(lambda e: received.append(dict(e.new)), "value")
    chunk = b"\0" * MIB
    peak = 0
    for name, total, size in (("a.png", 60, MIB), ("b.png", 60, MIB), ("c.png", 4, 2 * MIB)):
        # a and b announce their 60 chunks; c lies (4 chunks announced, 2 MiB each, 30 sent)
        for i in range(1, 61 if total == 60 else 31):
            dropper._process_event(SimpleNamespace(event_name="upload_event", data={
                "name": name, "chunk": i, "total_chunks": total, "data": chunk * (size // MIB), "type": "image/png"}))
            peak = max(peak, sum(len(c) for b in dropper._file_buffer.values() for c in b))
    assert peak <= 4 * MIB
    assert dropper._file_buffer == {} and not any(received)
    assert len(dropper.refused) == 3 and all("upload limit" in r for r in dropper.refused)
    assert "stopped after" in dropper.refused[-1]


def test_the_widget_builds_its_browser_model() -> None:
    model = BoundedFileDropper(max_bytes=MIB).get_root()  # server-side params stay on the server
    assert type(model).__name__ == "FileDropper"


def test_announced_oversize_and_too_many_in_flight() -> None:
    dropper = BoundedFileDropper(max_bytes=MIB, chunk_size=MIB // 4, max_pending=2)
    _chunks(dropper, "huge.png", [b"x"] * 9)  # 9 chunks of 256 KiB announced: over 1 MiB
    assert "announced" in dropper.refused[-1] and dropper._file_buffer == {}
    for name in ("a.txt", "b.txt", "c.txt"):  # first chunks only: three files in flight
        dropper._process_event(SimpleNamespace(event_name="upload_event", data={
            "name": name, "chunk": 1, "total_chunks": 2, "data": b"hi", "type": "text/plain"}))
    assert "in progress" in dropper.refused[-1] and set(dropper._file_buffer) == {"a.txt", "b.txt"}


def test_runner_takes_images_and_reports_bad_ones(tmp_path: Path) -> None:
    runner = SessionRunner(state=DashboardState(None), runs_dir=str(tmp_path / "runs"), max_upload_bytes=64 << 10)
    png = _image("PNG")
    _chunks(runner.dropper, "chart.png", [png])
    assert runner.documents == [["chart.png", png]] and runner.message == "added 1 image(s)"
    assert "chart.png (image" in runner.doc_list.object
    assert runner.dropper.value == {}  # the widget keeps nothing once the runner has the file
    runner.dropper.value = {"broken.jpg": _image("JPEG")[:40]}
    assert runner.message.startswith("error: broken.jpg:") and runner.alert.alert_type == "danger"
    _chunks(runner.dropper, "big.webp", [b"RIFF" + b"\0" * (40 << 10)] * 3)
    assert runner.message.startswith("error: big.webp: over the") and len(runner.documents) == 1


def test_kept_uploads_are_bounded(tmp_path: Path) -> None:
    runner = SessionRunner(state=DashboardState(None), runs_dir=str(tmp_path / "runs"), max_upload_bytes=1000,
                           max_kept_bytes=2500)
    for i in range(3):
        runner.dropper.value = {f"doc{i}.txt": "x" * 1000}
    assert [n for n, _ in runner.documents] == ["doc0.txt", "doc1.txt"]
    assert "clear some first" in runner.message
