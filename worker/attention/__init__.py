"""Attention as the engine runs it: one routing wrapper of the model's attention call, and what it routes to.

Owns: the routing (routing.py: which path a call takes, from the engine's switches as options.py holds them),
cascade attention over shared prefix levels (cascade.py, cascade_decode.py, fused.py, packed.py: every level of a
decode step in one call; merged by log-sum-exp in parts.py), whether a level is worth referencing
(cascade_cost.py, from the device costs calibrate.py measures), CPU prefill in causal blocks (cpu_prefill.py),
and the CUDA kernels with their mx-ops references (kernels/: ragged decode, the cascade suffix and prefix
kernels). Nothing here drives mlx-lm's batches.
"""
