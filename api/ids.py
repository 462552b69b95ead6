"""Object ids that sort by creation time, so a list cursor (`after` = an id) needs no lookup and survives the
deletion of the object it names. Ids are checked against a strict pattern before any use."""

from __future__ import annotations

import re
import secrets
import time

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
"""Any job id the store can hold (CLI jobs too); only looked up in the store, never used as a path."""


def new_id(prefix: str) -> str:
    """prefix + 12 hex digits of milliseconds since the epoch + 12 random hex digits."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def is_file_id(value: str) -> bool:
    return FILE_ID.fullmatch(value) is not None


def is_job_id(value: str) -> bool:
    return JOB_ID.fullmatch(value) is not None
