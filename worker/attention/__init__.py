"""Attention as the engine runs it: one routing wrapper of the model's attention call, and what it routes to.

Owns: the routing (routing.py: which path a call takes, from the engine's switches), ragged decode on CUDA
(ragged.py), cascade attention over shared prefix levels (cascade.py, cascade_decode.py, fused.py, merged by
log-sum-exp in parts.py), the CUDA kernels and their mx-ops references (cuda.py, suffix_kernel.py,
prefix_kernel.py), and CPU prefill in causal blocks (cpu_prefill.py). Nothing here drives mlx-lm's batches.
"""
