"""Image parts at submit: structure, data URIs, path confinement (real files and symlinks). No MLX, no decoder."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from omlx_jobs.jobs import images
from omlx_jobs.jobs.formats import CHAT_URL, InvalidLine, parse_line, parse_stream
from omlx_jobs.jobs.images import ImageAccess, ImageSourceError


def png_bytes(size: tuple[int, int] = (8, 6), color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def line(*parts: Any, role: str = "user") -> str:
    msg = {"role": role, "content": list(parts)}
    return json.dumps({"custom_id": "r", "method": "POST", "url": CHAT_URL, "body": {"messages": [msg]}})


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


TEXT = {"type": "text", "text": "What is in these pictures?"}


NOTHING = ImageAccess()


def error(text: str, access: ImageAccess = NOTHING) -> tuple[str | None, str, str]:
    with pytest.raises(InvalidLine) as exc:
        parse_line(text, 3, access)
    err = exc.value.error
    assert err.line == 3
    return err.field, err.code, err.message


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes())
    (allowed / "sub").mkdir()
    (allowed / "sub" / "dog.png").write_bytes(png_bytes(color=(0, 0, 255)))
    (tmp_path / "secret.png").write_bytes(png_bytes())
    return allowed


# ---- accepted -------------------------------------------------------------------------------------


def test_image_parts_are_kept_in_order_beside_text(folder: Path) -> None:
    uri = data_uri(png_bytes())
    access = ImageAccess.create([folder])
    req = parse_line(
        line(TEXT, image(uri), image(str(folder / "cat.png"), detail="low"), image(f"file://{folder}/sub/dog.png")),
        1,
        access,
    )
    content = req.body["messages"][0]["content"]
    assert [p["type"] for p in content] == ["text", "image_url", "image_url", "image_url"]
    assert content[1] == {"type": "image_url", "image_url": {"url": uri, "detail": "auto"}}
    assert content[2]["image_url"] == {"url": str(folder / "cat.png"), "detail": "low"}


def test_several_images_per_conversation() -> None:
    uri = data_uri(png_bytes())
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image(uri), TEXT]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, image(uri)]},
    ]
    req = parse_line(json.dumps({"messages": msgs}), 1)
    assert req.body["messages"][0]["content"] == "Be brief."
    assert isinstance(req.body["messages"][1]["content"], list)
    assert req.body["messages"][2]["content"] == "A red square."


def test_text_only_parts_stay_one_string() -> None:
    req = parse_line(line(TEXT, {"type": "text", "text": " Thanks."}), 1)
    assert req.body["messages"][0]["content"] == "What is in these pictures? Thanks."


def test_every_accepted_format_by_its_first_bytes() -> None:
    for fmt, media in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")):
        buf = io.BytesIO()
        Image.new("RGB", (4, 4)).save(buf, fmt)
        parse_line(line(image(data_uri(buf.getvalue(), media))), 1)
        assert images.sniff(buf.getvalue()) == fmt


# ---- refused, with the field and what to do -------------------------------------------------------


def test_local_files_are_off_without_allow_files_from(folder: Path) -> None:
    field, code, message = error(line(TEXT, image(str(folder / "cat.png"))))
    assert (field, code) == ("body.messages[0].content[1].image_url.url", "image_path_not_allowed")
    assert "--allow-files-from" in message


def test_a_path_outside_the_allowed_folder(folder: Path) -> None:
    outside = folder.parent / "secret.png"
    field, code, message = error(line(image(str(outside))), ImageAccess.create([folder]))
    assert (field, code) == ("body.messages[0].content[0].image_url.url", "image_path_not_allowed")
    assert "outside the allowed folders" in message


def test_dotdot_is_resolved_before_the_check(folder: Path) -> None:
    _, code, _ = error(line(image(f"{folder}/sub/../../secret.png")), ImageAccess.create([folder]))
    assert code == "image_path_not_allowed"
    # .. that stays inside is fine
    parse_line(line(image(f"{folder}/sub/../cat.png")), 1, ImageAccess.create([folder]))


def test_a_symlink_pointing_out_of_the_allowed_folder_is_refused(folder: Path) -> None:
    link = folder / "innocent.png"
    link.symlink_to(folder.parent / "secret.png")
    _, code, message = error(line(image(str(link))), ImageAccess.create([folder]))
    assert code == "image_path_not_allowed"
    assert "resolves to" in message and "secret.png" in message
    dir_link = folder / "elsewhere"
    dir_link.symlink_to(folder.parent)
    _, code, _ = error(line(image(f"{dir_link}/secret.png")), ImageAccess.create([folder]))
    assert code == "image_path_not_allowed"


def test_a_symlink_inside_the_folder_is_fine(folder: Path) -> None:
    (folder / "alias.png").symlink_to(folder / "cat.png")
    parse_line(line(image(str(folder / "alias.png"))), 1, ImageAccess.create([folder]))


def test_an_allowed_folder_reached_through_a_symlink(tmp_path: Path, folder: Path) -> None:
    via = tmp_path / "via"
    via.symlink_to(folder)
    parse_line(line(image(f"{via}/cat.png")), 1, ImageAccess.create([via]))


def test_missing_file_and_relative_path(folder: Path) -> None:
    access = ImageAccess.create([folder])
    _, code, message = error(line(image(str(folder / "nope.png"))), access)
    assert (code, "does not exist" in message) == ("image_not_found", True)
    _, code, message = error(line(image("cat.png")), access)
    assert code == "invalid_image_url" and "absolute path" in message


def test_a_file_that_is_not_an_image(folder: Path) -> None:
    (folder / "notes.png").write_text("just text")
    _, code, message = error(line(image(str(folder / "notes.png"))), ImageAccess.create([folder]))
    assert code == "invalid_image" and "not a PNG" in message
    _, code, _ = error(line(image(str(folder / "sub"))), ImageAccess.create([folder]))
    assert code == "invalid_image"  # a folder


def test_a_file_over_the_byte_cap(folder: Path) -> None:
    access = ImageAccess.create([folder], max_bytes=50)
    _, code, message = error(line(image(str(folder / "cat.png"))), access)
    assert code == "image_too_large" and "over 50 bytes" in message


def test_data_uri_over_the_byte_cap_is_refused_before_decoding() -> None:
    access = ImageAccess(max_bytes=100)
    _, code, _ = error(line(image(data_uri(png_bytes((64, 64)) + b"\0" * 200))), access)
    assert code == "image_too_large"


@pytest.mark.parametrize(
    ("url", "code", "message"),
    [
        ("data:image/png;base64,@@@@", "invalid_image_url", "base64 data is invalid"),
        ("data:text/plain;base64,aGk=", "invalid_image_url", "media type 'text/plain'"),
        ("data:image/png;base64,", "invalid_image", "no data"),
        ("data:;base64,aGk=", "invalid_image_url", "must look like"),
        ("ftp://host/x.png", "invalid_image_url", "scheme 'ftp'"),
        ("https://example.invalid/x.png", "remote_images_disabled", "--allow-remote-images"),
        ("file://otherhost/x.png", "invalid_image_url", "local file"),
    ],
)
def test_bad_urls(url: str, code: str, message: str) -> None:
    field, got, text = error(line(image(url)))
    assert (field, got) == ("body.messages[0].content[0].image_url.url", code)
    assert message in text


@pytest.mark.parametrize(
    ("part", "field", "code"),
    [
        ({"type": "image_url"}, "body.messages[0].content[0].image_url", "missing_field"),
        ({"type": "image_url", "image_url": "https://x/y"}, "body.messages[0].content[0].image_url", "invalid_type"),
        ({"type": "image_url", "image_url": {}}, "body.messages[0].content[0].image_url.url", "missing_field"),
        ({"type": "image_url", "image_url": {"url": 5}}, "body.messages[0].content[0].image_url.url", "invalid_type"),
        ({"type": "image_url", "image_url": {"url": ""}}, "body.messages[0].content[0].image_url.url", "empty_value"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk=", "size": 3}},
            "body.messages[0].content[0].image_url.size",
            "unknown_field",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk=", "detail": "max"}},
            "body.messages[0].content[0].image_url.detail",
            "invalid_value",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}, "extra": 1},
            "body.messages[0].content[0].extra",
            "unknown_field",
        ),
    ],
)
def test_part_structure(part: dict[str, Any], field: str, code: str) -> None:
    assert error(line(part))[:2] == (field, code)


def test_images_only_in_user_messages() -> None:
    field, code, message = error(line(image(data_uri(png_bytes())), role="system"))
    assert (field, code) == ("body.messages[0].content[0].type", "unsupported_content")
    assert "user messages" in message and "not in a system message" in message
    assert "not in an assistant message" in error(line(image(data_uri(png_bytes())), role="assistant"))[2]


def test_parse_stream_passes_access_through(folder: Path) -> None:
    text = line(image(str(folder / "cat.png"))) + "\n"
    refused = list(parse_stream(io.BytesIO(text.encode())))
    assert refused[0].code == "image_path_not_allowed"  # type: ignore[union-attr]
    accepted = list(parse_stream(io.BytesIO(text.encode()), ImageAccess.create([folder])))
    assert accepted[0].body["messages"][0]["content"][0]["type"] == "image_url"  # type: ignore[union-attr]


# ---- the worker's re-check: read_confined ---------------------------------------------------------


def test_read_confined_re_checks_and_caps(folder: Path) -> None:
    access = ImageAccess.create([folder])
    src = images.classify(str(folder / "cat.png"), access)
    assert isinstance(src, images.FileImage)
    assert images.read_confined(src, access) == (folder / "cat.png").read_bytes()
    with pytest.raises(ImageSourceError) as exc:
        images.read_confined(src, ImageAccess.create([folder / "sub"]))  # this worker allows less
    assert exc.value.code == "image_path_not_allowed"
    with pytest.raises(ImageSourceError) as exc:
        images.read_confined(src, ImageAccess.create([folder], max_bytes=10))
    assert exc.value.code == "image_too_large"


def test_read_confined_refuses_a_file_swapped_for_a_link(folder: Path) -> None:
    access = ImageAccess.create([folder])
    target = folder / "swap.png"
    target.write_bytes(png_bytes())
    src = images.classify(str(target), access)
    target.unlink()
    target.symlink_to(folder.parent / "secret.png")  # swapped after the check, before the read
    with pytest.raises(ImageSourceError) as exc:
        images.read_confined(src, access)
    assert exc.value.code == "image_path_not_allowed"


def test_a_fifo_is_not_read(folder: Path) -> None:
    fifo = folder / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(ImageSourceError) as exc:
        images.classify(str(fifo), ImageAccess.create([folder]))
    assert exc.value.code == "invalid_image"


def test_allowed_folder_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a folder"):
        ImageAccess.create([tmp_path / "missing"])


# ---- the CLI flags reach the parser ------------------------------------------------------------------


def test_submit_allow_files_from(tmp_path: Path, folder: Path, redis_url: str) -> None:
    from click.testing import CliRunner

    from omlx_jobs.cli import cli
    from omlx_jobs.store import open_store

    src = tmp_path / "in.jsonl"
    src.write_text(line(TEXT, image(str(folder / "cat.png"))) + "\n")
    env = {"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_REDIS_URL": redis_url}
    refused = CliRunner().invoke(cli, ["submit", str(src), "-m", "m"], env=env)
    assert refused.exit_code == 2
    assert "body.messages[0].content[1].image_url.url" in refused.stderr and "--allow-files-from" in refused.stderr
    ok = CliRunner().invoke(cli, ["submit", str(src), "-m", "m", "--allow-files-from", str(folder)], env=env)
    assert ok.exit_code == 0, ok.stderr
    job = ok.stdout.strip()
    store = open_store(db_path=str(tmp_path / "jobs.db"))
    (row,) = store.pending_requests(job)
    store.close()
    assert row.body["messages"][0]["content"][1]["image_url"]["url"] == str(folder / "cat.png")
    args = ["submit", str(src), "-m", "m", "--allow-files-from", str(tmp_path / "no")]
    missing = CliRunner().invoke(cli, args, env=env)
    assert missing.exit_code == 2 and "not a folder" in missing.stderr


@pytest.mark.parametrize("kind", ["video", "video_url", "input_video"])
def test_a_video_part_is_a_line_error_that_says_video_is_out_of_scope(kind: str) -> None:
    field, code, message = error(line({"type": kind, kind: {"url": "file:///v.mp4"}}))
    assert (field, code) == ("body.messages[0].content[0].type", "unsupported_content")
    assert "video" in message and "out of scope" in message
