"""omlx-jobs: queue-backed batch inference for MLX."""

__version__ = "0.1.0"
