"""Helpers the benchmarks share: models to measure (lib.models), decode-step timing (lib.steps), child processes
and their peak memory (lib.processes). Nothing here imports MLX at import time."""
