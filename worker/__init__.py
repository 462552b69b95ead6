"""The worker side: model, engine adapter over mlx-lm, prefix planner and cache, RQ worker.

Importing this package first loads a fast BLAS for MLX's CPU backend (see blas.py), which must happen
before `mlx.core` is imported.
"""

from omlx_jobs.worker.blas import preload_blas

preload_blas()
