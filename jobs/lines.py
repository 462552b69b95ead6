"""Reading a JSONL file as a stream of lines: BOM, CRLF, blank lines, encodings and over-long lines."""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.errors import InputError

MAX_LINE_BYTES = 1024 * 1024
UTF8_BOM = b"\xef\xbb\xbf"


def _too_long(line_no: int, size: int, limit: int) -> InputError:
    return InputError(
        line_no,
        f"line is {size:,} bytes; the limit is {limit:,} bytes per line. Shorten this request",
        code=ErrorCode.LINE_TOO_LONG,
    )


def _not_utf8(line_no: int, raw: bytes, exc: UnicodeDecodeError) -> InputError:
    if line_no == 1 and raw[:2] == b"\x1f\x8b":
        what = "the file looks gzip-compressed; decompress it first"
    else:
        what = f"byte 0x{raw[exc.start]:02x} at offset {exc.start} is not valid UTF-8; save the file as UTF-8"
    return InputError(line_no, what, code=ErrorCode.INVALID_ENCODING)


def iter_lines(stream: IO[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str | InputError]]:
    """Yield (line number, text or InputError) for each non-blank line, reading the file as a stream.

    Handles a UTF-8 BOM and CRLF endings. An over-long line is skipped in chunks, never held whole.
    A UTF-16 file is reported once, on line 1, and not read further.
    """
    line_no = 0
    while True:
        raw = stream.readline(max_line_bytes + 2)  # room for the content plus "\r\n"
        if not raw:
            return
        line_no += 1
        if not raw.endswith(b"\n") and len(raw) > max_line_bytes:
            size = len(raw)
            while more := stream.readline(1024 * 1024):
                size += len(more)
                if more.endswith(b"\n"):
                    break
            yield line_no, _too_long(line_no, size, max_line_bytes)
            continue
        if line_no == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            yield line_no, InputError(line_no, "the file is UTF-16; save it as UTF-8", code=ErrorCode.INVALID_ENCODING)
            return
        # A BOM starts a UTF-8 file; one at the start of a later line comes from joining files with cat.
        content = raw[3:] if raw.startswith(UTF8_BOM) else raw
        content = content[:-2] if content.endswith(b"\r\n") else content.rstrip(b"\n")
        if len(content) > max_line_bytes:
            yield line_no, _too_long(line_no, len(raw), max_line_bytes)
            continue
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield line_no, _not_utf8(line_no, content, exc)
            continue
        if text.strip():
            yield line_no, text
