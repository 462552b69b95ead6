"""The store: jobs and one row per request, in SQLite (default) or any SQLAlchemy database."""

from omlx_jobs.store.db import Store, StoreError, default_database_url, open_store
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
    "default_database_url",
    "open_store",
]
