"""Benchmarks of whole jobs through the engine: prefix reuse, cascade jobs, structured output, scoring, images;
each against mlx-lm's (or mlx-vlm's) own generation on the same prompts, in one run."""
