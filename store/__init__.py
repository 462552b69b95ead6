"""The store: jobs and one row per request, in SQLite (default) or any SQLAlchemy database."""

# The API's tables (files, batches) register with the metadata here, so every Store creates them.
from omlx_jobs.store import batches as _batches  # noqa: F401
from omlx_jobs.store import files as _files  # noqa: F401
from omlx_jobs.store.db import Store, StoreError, StoreUnavailable, default_database_url, open_store
from omlx_jobs.store.models import FINAL_REQUEST_STATUSES, Job, Request, RequestStatus
from omlx_jobs.store.rows import CompletionRow

__all__ = [
    "FINAL_REQUEST_STATUSES",
    "CompletionRow",
    "Job",
    "Request",
    "RequestStatus",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "default_database_url",
    "open_store",
]
