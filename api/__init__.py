"""`omlx-jobs serve`: OpenAI's Files and Batches API over HTTP, a web page to watch jobs, and /metrics.

A client of jobs/ and store/ like the CLI: it holds no model and never imports MLX.
"""

from omlx_jobs.api.app import create_app
from omlx_jobs.api.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]
