"""Prefixes kept for reuse: the in-memory prefix cache, its entries' lifetimes, the disk tier and KV views.

Owns: entries and lookups by prefix key (prefix_cache.py, pure), who may evict what and when (lifetimes.py,
pure, the only writer of pins), cache files on disk (disk.py), cheap views and sizes of mlx-lm KV caches
(kv.py), and the KV cache that carries a vision prompt's RoPE breaks (positioned.py).
"""
