"""Attention as the engine runs it: one routing wrapper of the model's attention call, and what it routes to.

Owns: the routing (routing.py: which path a call takes, from the engine's switches as options.py holds them),
cascade attention over shared prefix levels (cascade.py, cascade_decode.py, fused.py, merged by log-sum-exp in
parts.py), CPU prefill in causal blocks (cpu_prefill.py), and the CUDA kernels with their mx-ops references
(kernels/: ragged decode, the cascade suffix and prefix kernels). Nothing here drives mlx-lm's batches.
"""
