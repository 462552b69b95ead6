"""Open a file beneath a folder without following any symbolic link on the way, whatever changes meanwhile.

A path checked first and opened later can be raced: someone who can write inside an allowed folder swaps a
directory on the path for a link to elsewhere between the two. So the file is opened relative to a descriptor
of the folder: on Linux 5.6+ with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV), which the
kernel enforces in one step; elsewhere (macOS, older kernels, a seccomp filter that refuses openat2) by walking
the path one component at a time, each opened with O_NOFOLLOW relative to the descriptor of its parent. The
file itself is opened non-blocking (a FIFO cannot hang the reader) and must be a regular file on the folder's
file system. Pure standard library (ctypes for the syscall).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import stat
import sys
from pathlib import PurePath

# openat2(2): struct open_how {u64 flags; u64 mode; u64 resolve;}; the syscall number is 437 on every
# architecture that has it (the unified syscall table).
SYS_OPENAT2 = 437
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_OPENAT2_RETRIES = 8  # EAGAIN: the kernel saw a concurrent rename and could not vouch for the walk; try again
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class EscapeRefused(OSError):
    """The path met a symbolic link or another file system, or kept changing while it was opened."""


class NotAFile(OSError):
    """What the path names is not a regular file (a folder, a FIFO, a device, a socket)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_state = {"openat2": sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")}
"""Whether to try openat2 first; cleared once the kernel says it has none (ENOSYS, or EPERM from seccomp)."""


def open_beneath(folder: str | os.PathLike[str], relative: str | PurePath) -> int:
    """A read-only descriptor of `folder/relative`, a regular file reached without any link or mount crossing.

    `relative` must be a plain relative path (no `..`, not absolute). Raises EscapeRefused for a link, a
    crossing, or something that is not a regular file; other OSErrors (ENOENT, EACCES) as they come.
    """
    parts = PurePath(relative).parts
    if not parts or PurePath(relative).is_absolute() or any(p in ("..", ".") for p in parts):
        raise EscapeRefused(errno.EINVAL, f"{relative}: not a plain path inside the folder")
    root = os.open(folder, _DIR_FLAGS)
    try:
        fd = _openat2(root, os.path.join(*parts)) if _state["openat2"] else None
        if fd is None:
            fd = _walk(root, parts)
        try:
            _check_file(fd, os.fstat(root).st_dev)
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(root)


@functools.cache
def _syscall() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn


def _openat2(root: int, relative: str) -> int | None:
    """The descriptor from openat2, or None when this kernel cannot do it (then the walk is used, for good)."""
    how = _OpenHow(flags=_FILE_FLAGS, mode=0, resolve=_RESOLVE)
    for _ in range(_OPENAT2_RETRIES):
        fd = _syscall()(
            ctypes.c_long(SYS_OPENAT2), ctypes.c_int(root), os.fsencode(relative), ctypes.byref(how), ctypes.sizeof(how)
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):
            _state["openat2"] = False
            return None
        if err in (errno.ELOOP, errno.EXDEV):
            raise EscapeRefused(err, f"{relative}: a symbolic link or another file system is on the way")
        if err != errno.EAGAIN:
            raise OSError(err, os.strerror(err), relative)
    raise EscapeRefused(errno.EAGAIN, f"{relative}: kept changing while it was opened")


def _walk(root: int, parts: tuple[str, ...]) -> int:
    """Open each folder on the way with O_NOFOLLOW | O_DIRECTORY relative to its parent, then the file."""
    current = os.dup(root)
    try:
        for name in parts[:-1]:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=current)
            except OSError as exc:
                raise _refusal(exc, name) from None
            os.close(current)
            current = child
            if os.fstat(current).st_dev != os.fstat(root).st_dev:
                raise EscapeRefused(errno.EXDEV, f"{name}: another file system is on the way")
        try:
            return os.open(parts[-1], _FILE_FLAGS, dir_fd=current)
        except OSError as exc:
            raise _refusal(exc, parts[-1]) from None
    finally:
        os.close(current)


def _refusal(exc: OSError, name: str) -> OSError:
    # O_NOFOLLOW on a link: ELOOP on Linux and macOS (EMLINK on FreeBSD); O_DIRECTORY on a non-folder: ENOTDIR.
    if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
        return EscapeRefused(exc.errno, f"{name}: a symbolic link (or not a folder) is on the way")
    return exc


def _check_file(fd: int, device: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(errno.EINVAL, "not a regular file")
    if st.st_dev != device:
        raise EscapeRefused(errno.EXDEV, "on another file system than the allowed folder")
