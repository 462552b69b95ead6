"""Image references in chat messages: which URLs are allowed, and the checks that need no image decoder.

Pure logic (no MLX, no Pillow, no network): submit and the worker both call it, so a path is confined the same
way on both sides, and the worker re-checks rather than trusting what submit stored.

Accepted `image_url.url` forms:
- `data:image/<png|jpeg|webp|gif>;base64,<data>`, always;
- an absolute path or a `file://` URL, only inside a folder the user allowed (`--allow-files-from DIR`); symlinks
  and `..` are resolved first, so a link pointing out of an allowed folder is refused;
- `http://` / `https://`, only with `--allow-remote-images` (fetched by the worker, with a timeout and a size cap).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlsplit

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import beneath
from omlx_jobs.jobs.remote_hosts import RemoteHosts, literal_address

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's limit per image
DEFAULT_REMOTE_TIMEOUT = 10.0
DETAILS = ("auto", "low", "high")
NO_REMOTE_HOSTS = RemoteHosts()
# OpenAI's image formats; the worker's decoder opens these and nothing else.
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}


_DATA_URI = re.compile(r"data:([\w.+-]+/[\w.+-]+)((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,", re.ASCII)


class ImageSourceError(Exception):
    """A reference to an image that cannot be used: `code` is one of errors.IMAGE_SOURCE_CODES; `message` says
    what to do."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ImageAccess:
    """Where images may come from: the folders the user allowed, whether remote URLs may be fetched (within one
    deadline per image, from public addresses and the hosts allowed), and the byte cap."""

    allowed_dirs: tuple[Path, ...] = ()
    allow_remote: bool = False
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    remote_timeout: float = DEFAULT_REMOTE_TIMEOUT
    """Seconds one remote image may take in all: resolving, connecting, redirects and every read."""
    remote_hosts: RemoteHosts = NO_REMOTE_HOSTS
    """Hosts and networks a remote image may come from although they are not public (--allow-remote-hosts)."""

    @classmethod
    def create(
        cls,
        allowed_dirs: tuple[str | Path, ...] | list[str | Path] = (),
        *,
        allow_remote: bool = False,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        remote_timeout: float = DEFAULT_REMOTE_TIMEOUT,
        allow_remote_hosts: tuple[str, ...] | list[str] = (),
    ) -> ImageAccess:
        """Resolve each allowed folder once (symlinks too); a folder that does not exist is an error."""
        dirs = []
        for d in allowed_dirs:
            path = Path(d).expanduser()
            if not path.is_dir():
                raise ValueError(f"--allow-files-from {d}: not a folder")
            dirs.append(path.resolve())
        if max_bytes < 1 or remote_timeout <= 0:
            raise ValueError("the image byte cap and the remote timeout must be positive")
        if allow_remote_hosts and not allow_remote:
            raise ValueError("--allow-remote-hosts needs --allow-remote-images (it names exceptions to its rules)")
        return cls(tuple(dirs), allow_remote, max_bytes, remote_timeout, RemoteHosts.parse(allow_remote_hosts))


@dataclass(frozen=True)
class DataImage:
    media_type: str
    data: bytes


@dataclass(frozen=True)
class FileImage:
    path: Path
    """Resolved: no symlinks, no `..`, inside an allowed folder."""


@dataclass(frozen=True)
class RemoteImage:
    url: str


ImageSource = DataImage | FileImage | RemoteImage


def classify(url: str, access: ImageAccess) -> ImageSource:
    """Check a URL against `access` without reading a file or the network; raise ImageSourceError if refused.

    A data URI is decoded (base64) and its size checked; a path is resolved and confined, and must be a file.
    """
    if url.startswith("data:"):
        return _data_image(url, access.max_bytes)
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in ("http", "https"):
        if not access.allow_remote:
            raise ImageSourceError(
                ErrorCode.REMOTE_IMAGES_DISABLED,
                "remote image URLs are off; pass --allow-remote-images to fetch them, or send the image as a "
                "data: URI or a file under --allow-files-from",
            )
        host = urlsplit(url).hostname
        if not host:
            raise ImageSourceError(ErrorCode.INVALID_IMAGE_URL, f"{short(url)} has no host name")
        _check_literal_host(url, host, access)
        return RemoteImage(url)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageSourceError(
                ErrorCode.INVALID_IMAGE_URL, "file:// URLs must name a local file (file:///path/to/img.png)"
            )
        return FileImage(confine(unquote(parts.path), access))
    if scheme:
        raise ImageSourceError(
            ErrorCode.INVALID_IMAGE_URL,
            f"URL scheme {scheme!r} is not supported; use data:, file://, a path, or http(s)",
        )
    return FileImage(confine(url, access))


def _check_literal_host(url: str, host: str, access: ImageAccess) -> None:
    """What can be judged without resolving: an address in the URL itself, or a localhost name."""
    address = literal_address(host)
    if address is None and (host == "localhost" or host.endswith(".localhost")):
        address = literal_address("127.0.0.1")
    if address is not None and not access.remote_hosts.allows(host, address):
        raise ImageSourceError(
            ErrorCode.IMAGE_HOST_NOT_ALLOWED,
            f"{short(url)} names a loopback, private, link-local or reserved address, which remote images may "
            "not reach; allow it with --allow-remote-hosts (on submit and the worker) if it is meant to be fetched",
        )


def confine(path: str, access: ImageAccess) -> Path:
    """The real path of `path` (symlinks and `..` resolved) if it is a regular file inside an allowed folder."""
    if not access.allowed_dirs:
        raise ImageSourceError(
            ErrorCode.IMAGE_PATH_NOT_ALLOWED,
            "local image files are off; pass --allow-files-from DIR (on submit, run and worker) for the folder "
            "that holds them, or send the image as a data: URI",
        )
    if "\x00" in path:
        raise ImageSourceError(ErrorCode.INVALID_IMAGE_URL, "the path holds a NUL byte")
    if not os.path.isabs(path):
        raise ImageSourceError(
            ErrorCode.INVALID_IMAGE_URL, f"{short(path)} is a relative path; give an absolute path or a file:// URL"
        )
    try:
        real = Path(path).resolve(strict=True)
    except FileNotFoundError:
        raise ImageSourceError(ErrorCode.IMAGE_NOT_FOUND, f"{short(path)} does not exist") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, a permission error on a parent
        raise ImageSourceError(ErrorCode.IMAGE_NOT_FOUND, f"{short(path)} cannot be resolved: {exc}") from None
    if not any(real.is_relative_to(d) for d in access.allowed_dirs):
        shown = ", ".join(str(d) for d in access.allowed_dirs)
        via = f" (it resolves to {real})" if str(real) != os.path.normpath(path) else ""
        raise ImageSourceError(
            ErrorCode.IMAGE_PATH_NOT_ALLOWED,
            f"{short(path)}{via} is outside the allowed folders ({shown}); move it there or allow its folder "
            "with --allow-files-from",
        )
    try:
        mode = real.stat().st_mode
    except OSError as exc:
        raise ImageSourceError(ErrorCode.IMAGE_NOT_FOUND, f"{short(path)} cannot be read: {exc}") from None
    if not stat.S_ISREG(mode):
        raise ImageSourceError(ErrorCode.INVALID_IMAGE, f"{short(path)} is not a regular file")
    return real


def open_confined(source: FileImage, access: ImageAccess) -> IO[bytes]:
    """A confined file, open for reading: checked again, then opened beneath its allowed folder's descriptor,
    so no link swapped in after the check is followed (jobs/beneath.py), and never a FIFO or a device."""
    path = confine(str(source.path), access)
    folder = max((d for d in access.allowed_dirs if path.is_relative_to(d)), key=lambda d: len(d.parts))
    try:
        fd = beneath.open_beneath(folder, path.relative_to(folder))
    except beneath.NotAFile:
        raise ImageSourceError(ErrorCode.INVALID_IMAGE, f"{short(str(path))} is not a regular file") from None
    except beneath.EscapeRefused as exc:
        raise ImageSourceError(
            ErrorCode.IMAGE_PATH_NOT_ALLOWED,
            f"{short(str(path))} was not opened: {exc.strerror} (inside --allow-files-from folders, links are "
            "resolved only by the check before, never while opening, and mounts inside them are not crossed)",
        ) from None
    except OSError as exc:
        raise ImageSourceError(
            ErrorCode.IMAGE_NOT_FOUND, f"{short(str(path))} cannot be opened: {exc.strerror}"
        ) from None
    return os.fdopen(fd, "rb")


def read_confined(source: FileImage, access: ImageAccess) -> bytes:
    """Read a confined file (see open_confined), at most `max_bytes`."""
    with open_confined(source, access) as fh:
        return read_capped(fh, access.max_bytes, str(source.path))


def read_capped(stream: IO[bytes], max_bytes: int, what: str) -> bytes:
    """At most max_bytes from a stream; ImageSourceError (image_too_large) if there is more."""
    data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageSourceError(
            ErrorCode.IMAGE_TOO_LARGE, f"{short(what)} is over {max_bytes:,} bytes; send a smaller or re-encoded image"
        )
    return data


def sniff(data: bytes) -> str | None:
    """The image format from the first bytes (PNG, JPEG, WEBP, GIF), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


def check_format(data: bytes, what: str) -> str:
    """The format of `data`, or ImageSourceError (invalid_image) naming the formats accepted."""
    kind = sniff(data)
    if kind is None:
        raise ImageSourceError(ErrorCode.INVALID_IMAGE, f"{short(what)} is not a PNG, JPEG, WebP or GIF image")
    return kind


def _data_image(url: str, max_bytes: int) -> DataImage:
    m = _DATA_URI.match(url)
    if not m:
        raise ImageSourceError(
            ErrorCode.INVALID_IMAGE_URL, "a data URI must look like data:image/png;base64,<base64 data>"
        )
    media_type = m.group(1).lower()
    if media_type not in MEDIA_TYPES:
        raise ImageSourceError(
            ErrorCode.INVALID_IMAGE_URL,
            f"data URI media type {media_type!r} is not supported; use image/png, image/jpeg, image/webp or image/gif",
        )
    if not m.group(3):
        raise ImageSourceError(
            ErrorCode.INVALID_IMAGE_URL, "the data URI must be base64-encoded (data:image/png;base64,...)"
        )
    payload = url[m.end() :]
    if len(payload) // 4 * 3 > max_bytes + 2:  # judged before decoding: base64 is 4 characters per 3 bytes
        raise ImageSourceError(
            ErrorCode.IMAGE_TOO_LARGE, f"the image is over {max_bytes:,} bytes; send a smaller or re-encoded image"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageSourceError(
            ErrorCode.INVALID_IMAGE_URL,
            "the data URI's base64 data is invalid (only A-Z a-z 0-9 + / and = padding; no spaces or newlines)",
        ) from None
    if len(data) > max_bytes:
        raise ImageSourceError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"the image is {len(data):,} bytes, over {max_bytes:,} bytes; send a smaller image",
        )
    if not data:
        raise ImageSourceError(ErrorCode.INVALID_IMAGE, "the data URI holds no data")
    return DataImage(media_type, data)


def short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
