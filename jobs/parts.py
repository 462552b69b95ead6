"""Message content: a string, or OpenAI content parts (text and image_url). Pure logic, used by formats.py.

Text-only content is stored as one string, as before images were supported. Content holding images is stored as
a list of parts, `{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`,
in the order given, so the worker places each image where the user put it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import image_size
from omlx_jobs.jobs import images as img
from omlx_jobs.jobs.errors import BadValue, check_text, describe

IMAGE_KEYS = ("url", "detail")
VIDEO_TYPES = ("video", "video_url", "input_video")


def parse_content(value: Any, name: str, role: str, access: img.ImageAccess) -> str | list[dict[str, Any]]:
    """Validate a message's content; a string unless it holds an image part."""
    if isinstance(value, str):
        return check_text(value, name)
    if not isinstance(value, list):
        raise BadValue(
            ErrorCode.INVALID_TYPE, name, f"must be a string or a list of content parts, got {describe(value)}"
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        here = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise BadValue(
                ErrorCode.INVALID_TYPE,
                here,
                f'must be a content part object like {{"type": "text", ...}}, got {describe(part)}',
            )
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise BadValue(ErrorCode.INVALID_TYPE, f"{here}.text", f"must be a string, got {describe(text)}")
            parts.append({"type": "text", "text": check_text(text, f"{here}.text")})
        elif kind == "image_url":
            if role != "user":
                raise BadValue(
                    ErrorCode.UNSUPPORTED_CONTENT,
                    f"{here}.type",
                    f"images go in user messages, not in {'an' if role[0] in 'aeiou' else 'a'} {role} message",
                )
            parts.append(_image_part(part, here, access))
        elif kind in VIDEO_TYPES:
            raise BadValue(
                ErrorCode.UNSUPPORTED_CONTENT,
                f"{here}.type",
                f"video ({kind!r} parts) is out of scope: no model here takes video; send frames as image_url parts",
            )
        elif kind is None:
            raise BadValue(
                ErrorCode.MISSING_FIELD, f"{here}.type", 'is missing; text parts are {"type": "text", "text": "..."}'
            )
        else:
            raise BadValue(
                ErrorCode.UNSUPPORTED_CONTENT,
                f"{here}.type",
                f"content part type {kind!r} is not supported (audio and files are not); send text and image_url parts",
            )
    if not any(p["type"] == "image_url" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_part(part: dict[str, Any], here: str, access: img.ImageAccess) -> dict[str, Any]:
    _only_keys(part, ("type", "image_url"), here)
    spec = part.get("image_url")
    if spec is None:
        raise BadValue(
            ErrorCode.MISSING_FIELD, f"{here}.image_url", 'is missing; give {"url": "data:image/png;base64,..."}'
        )
    if not isinstance(spec, dict):
        raise BadValue(
            ErrorCode.INVALID_TYPE,
            f"{here}.image_url",
            f'must be an object like {{"url": "..."}}, got {describe(spec)}',
        )
    _only_keys(spec, IMAGE_KEYS, f"{here}.image_url")
    url = spec.get("url")
    field = f"{here}.image_url.url"
    if url is None:
        raise BadValue(ErrorCode.MISSING_FIELD, field, "is missing; give a data: URI, a file path or an http(s) URL")
    if not isinstance(url, str):
        raise BadValue(ErrorCode.INVALID_TYPE, field, f"must be a string, got {describe(url)}")
    if not url:
        raise BadValue(
            ErrorCode.EMPTY_VALUE, field, "must not be empty; give a data: URI, a file path or an http(s) URL"
        )
    check_text(url, field)
    detail = spec.get("detail", "auto")
    if detail not in img.DETAILS:
        allowed = ", ".join(img.DETAILS)
        raise BadValue(
            ErrorCode.INVALID_VALUE, f"{here}.image_url.detail", f"must be one of {allowed}, got {describe(detail)}"
        )
    try:
        _check_source(img.classify(url, access), access)
    except img.ImageSourceError as exc:
        raise BadValue(exc.code, field, exc.message) from None
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def _check_source(source: img.ImageSource, access: img.ImageAccess) -> None:
    """What submit can check without decoding: the data's or the file's first bytes, its size in bytes, and the
    pixel size its header gives (an aspect ratio the vision processor refuses)."""
    if isinstance(source, img.DataImage):
        img.check_format(source.data, "the data URI")
        _check_shape(source.data, "the data URI image")
    elif isinstance(source, img.FileImage):
        with img.open_confined(source, access) as fh:  # as the worker opens it: no link, no FIFO
            size = os.fstat(fh.fileno()).st_size
            if size > access.max_bytes:
                cap = f"{access.max_bytes:,}"
                raise img.ImageSourceError(
                    ErrorCode.IMAGE_TOO_LARGE, f"{source.path} is {size:,} bytes, over {cap} bytes; use a smaller image"
                )
            head = fh.read(image_size.HEAD_BYTES)
        img.check_format(head, str(source.path))
        _check_shape(head, str(source.path))


def _check_shape(head: bytes, what: str) -> None:
    """The header's pixel size against the processors' limits, and a JPEG's scans (in the bytes read)."""
    size = image_size.image_size(head)
    problem = image_size.aspect_problem(size) if size is not None else None
    if problem is not None:
        raise img.ImageSourceError(ErrorCode.IMAGE_REJECTED_BY_PROCESSOR, f"{img.short(what)}: {problem}")
    problem = image_size.scans_problem(head)
    if problem is not None:
        raise img.ImageSourceError(ErrorCode.INVALID_IMAGE, f"{img.short(what)}: {problem}")


def _only_keys(obj: dict[str, Any], allowed: tuple[str, ...], here: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        takes = ", ".join(allowed)
        raise BadValue(ErrorCode.UNKNOWN_FIELD, f"{here}.{extra[0]}", f"unsupported field; this object takes {takes}")


def image_urls(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, str]]:
    """(message index, part index, url) of every image part of stored messages, in prompt order."""
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") == "image_url":
                    yield i, j, part["image_url"]["url"]
