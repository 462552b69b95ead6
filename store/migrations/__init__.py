"""Alembic migrations of the store, shipped in the package so an installed wheel can upgrade its database.

Revisions are linear, with readable ids (0001_baseline, 0002_...). `omlx_jobs.store.schema.upgrade` runs them
when a store opens; add a revision here and bump HEAD with it.
"""

BASELINE = "0001_baseline"
HEAD = "0008_embeddings"
