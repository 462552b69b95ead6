"""The client side of a job: input formats, lifecycle, queueing and output formats. Never imports MLX."""
