"""A multipart upload streamed straight to a file under the server's folder, capped by bytes and lines.

Never held whole in memory: each chunk from the socket goes through python-multipart's parser into the file.
Text fields are small and capped; there is one file part, named `file`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from omlx_jobs.api.errors import BadRequest, InsufficientStorage, TooLarge, Unprocessable, clip
from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.lines import MAX_LINE_BYTES

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16
MAX_HEADER_BYTES = 8192
"""A part's header name or value; more is a malformed (or hostile) body."""
MAX_BOUNDARY_CHARS = 70
"""RFC 2046's limit (python-multipart refuses more than 256 with an exception of its own)."""
MULTIPART_SLACK = 64 * 1024
"""Headers and boundaries around the file's bytes, allowed on top of the byte cap in Content-Length."""
DRAIN_LIMIT = 256 * 1024**2
"""At most this much of a refused upload is read and dropped before the 413 (see drain)."""
_UNSAFE_NAME = re.compile(r"[\x00-\x1f\x7f/\\]")


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    """The file's bytes, in a temporary file under the server's folder (the caller renames or removes it)."""
    filename: str = ""
    bytes: int = 0
    newlines: int = 0
    last_byte: bytes = b""
    line_bytes: int = 0
    """Bytes of the line being received so far (a line is capped as submit caps it)."""

    @property
    def lines(self) -> int:
        """Lines in the file, counting a last line without a newline."""
        return self.newlines + (1 if self.bytes and self.last_byte != b"\n" else 0)

    def discard(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.path = None


def safe_filename(name: str) -> str:
    """The client's file name, for display only: its last path part, without control characters, cut to 255."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return _UNSAFE_NAME.sub("", base)[:255] or "upload.jsonl"


class _Receiver:
    """python-multipart callbacks: text fields into memory (capped), the file part into `upload.path`."""

    def __init__(self, upload: Upload, folder: Path, max_bytes: int, max_lines: int) -> None:
        self.upload, self.folder, self.max_bytes, self.max_lines = upload, folder, max_bytes, max_lines
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._name: str | None = None
        self._data = bytearray()
        self._fh: Any = None

    def on_part_begin(self) -> None:
        self._disposition, self._name, self._data = b"", None, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]
        _check_header(self._header_name)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        _check_header(self._header_value)

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name, self._header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise Unprocessable("a multipart part has no name in its Content-Disposition header")
        self._name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            if self._name != "file" or self.upload.path is not None:
                raise BadRequest("send exactly one file, in the form field 'file'", param="file")
            self.upload.filename = safe_filename(options[b"filename"].decode("utf-8", "replace"))
            self.upload.path = self.folder / f".upload-{secrets.token_hex(12)}.part"
            fd = os.open(self.upload.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            self._fh = os.fdopen(fd, "wb")
        elif len(self.upload.fields) >= MAX_FIELDS:
            raise Unprocessable(f"too many form fields; at most {MAX_FIELDS}")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._fh is None:
            if len(self._data) + len(chunk) > MAX_FIELD_BYTES:
                raise Unprocessable(
                    f"form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes", param=self._name
                )
            self._data += chunk
            return
        up = self.upload
        up.bytes += len(chunk)
        if up.bytes > self.max_bytes:
            raise TooLarge(
                f"the file is larger than this server's limit of {self.max_bytes:,} bytes; split it into several "
                "batches (or raise `serve --max-upload-bytes`)",
                param="file",
                code="file_too_large",
            )
        check_line_lengths(up, chunk)
        up.newlines += chunk.count(b"\n")
        if up.newlines > self.max_lines:
            raise TooLarge(
                f"the file has more than this server's limit of {self.max_lines:,} lines; split it into several "
                "batches (or raise `serve --max-upload-lines`)",
                param="file",
                code="too_many_lines",
            )
        if chunk:
            up.last_byte = chunk[-1:]
            self._fh.write(chunk)

    def on_part_end(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
            if self.upload.lines > self.max_lines:
                raise TooLarge(
                    f"the file has more than this server's limit of {self.max_lines:,} lines",
                    param="file",
                    code="too_many_lines",
                )
        elif self._name is not None:
            self.upload.fields[self._name] = self._data.decode("utf-8", "replace")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _check_header(value: bytes) -> None:
    if len(value) > MAX_HEADER_BYTES:
        raise Unprocessable(f"a multipart part header is longer than {MAX_HEADER_BYTES:,} bytes")


def check_line_lengths(up: Upload, chunk: bytes) -> None:
    """TooLarge (line_too_long) when a line of the upload passes submit's 1 MiB per line; `up.line_bytes`
    carries the open line from chunk to chunk (a line ending in \r\n may have one byte more)."""
    limit = MAX_LINE_BYTES + 1
    if up.line_bytes + len(chunk) <= limit:  # no line in this chunk can be too long
        last = chunk.rfind(b"\n")
        up.line_bytes = up.line_bytes + len(chunk) if last < 0 else len(chunk) - last - 1
        return
    start, line = 0, up.newlines + 1  # the number of the open line
    while True:
        nl = chunk.find(b"\n", start)
        if up.line_bytes + (nl if nl >= 0 else len(chunk)) - start > limit:
            raise TooLarge(
                f"line {line} of the file is over {MAX_LINE_BYTES:,} bytes, the limit of one line (as `submit` "
                "has); put large images in files or URLs rather than data: URIs, or shorten the line",
                param="file",
                code=ErrorCode.LINE_TOO_LONG,
            )
        if nl < 0:
            up.line_bytes += len(chunk) - start
            return
        up.line_bytes, start, line = 0, nl + 1, line + 1


async def receive(request: Request, folder: Path, *, max_bytes: int, max_lines: int) -> Upload:
    """Parse a multipart/form-data request body as it arrives; the file part goes to disk under `folder`."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise Unprocessable("upload a file as multipart/form-data with the fields 'file' and 'purpose'")
    if not 1 <= len(params[b"boundary"]) <= MAX_BOUNDARY_CHARS:
        raise Unprocessable(f"the multipart boundary must be 1 to {MAX_BOUNDARY_CHARS} characters (RFC 2046)")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes + MULTIPART_SLACK:
        await drain(request.stream(), max_bytes)
        raise TooLarge(
            f"the upload is {int(length):,} bytes; this server takes files up to {max_bytes:,} bytes. "
            "Split it into several batches (or raise `serve --max-upload-bytes`)",
            param="file",
            code="file_too_large",
        )
    upload = Upload()
    receiver = _Receiver(upload, folder, max_bytes, max_lines)
    callbacks = {
        name: getattr(receiver, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(params[b"boundary"], callbacks)  # type: ignore[arg-type]
    stream = request.stream()
    try:
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
    except Exception as exc:
        receiver.close()
        upload.discard()
        if isinstance(exc, TooLarge):
            await drain(stream, max_bytes)
        if isinstance(exc, (BadRequest, TooLarge, Unprocessable)):
            raise
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientStorage(
                "the server's disk is full (its --files-dir): nothing was stored; free space there and upload again",
                code="insufficient_storage",
            ) from exc
        if isinstance(exc, OSError):
            raise
        raise Unprocessable(f"the multipart body could not be read: {clip(str(exc))}") from exc
    receiver.close()
    return upload


async def drain(stream: AsyncIterator[bytes], max_bytes: int) -> None:
    """Read and drop the rest of a refused body (up to a bound), so the client gets to read the 413.

    A server that answers before the body is read closes the connection, and a client still sending sees a
    reset instead of the error. Past the bound, the connection is closed anyway.
    """
    limit = max(max_bytes, DRAIN_LIMIT)
    seen = 0
    with contextlib.suppress(Exception):
        async for chunk in stream:
            seen += len(chunk)
            if seen > limit:
                break
