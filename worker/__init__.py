"""The worker side: it loads a model once and runs shards of jobs through the engine.

Subpackages, lower first: cache/ (prefixes kept for reuse), attention/ (the model's attention as the engine routes
it), backend/ (the only door to mlx-lm's internals), speculation/ (drafts verified in the batch), tools/ (tool-call
markup: families, parsers, grammars), reasoning/ (thinking: markers, split, budget, and a chat request's plan),
models/ (text models on disk), extras/ (what a request asks beyond decoding), vision/ (images), embeddings/
(vectors: pooling from the model's files and a prefill-only runner), engine/ (continuous batching), runtime/ (the
worker process). At the top: prompts.py (a prompt and its prefix key), loading.py (a --model string -> the engine
that runs it) and entry.py (the RQ entry point `run_shard`, whose import path queued messages name).

Importing this package first loads a fast BLAS for MLX's CPU backend (models/blas.py), which must happen before
`mlx.core` is imported: the one place where the environment (OMLX_JOBS_BLAS) is read at import.
"""

from omlx_jobs.worker.models.blas import preload_blas

preload_blas()
