"""The CUDA kernels of attention, each with its mx-ops reference (what the kernel computes, on any device).

Owns: ragged decode without a padding mask (ragged.py), a cascade decode step's own suffixes merged with its
prefix levels (suffix.py), the prefix levels on tensor cores (prefix.py), and what kernels share: names hashed by
code and the online-softmax decode loop of the first two (cuda.py). They run only on CUDA, where the routing
names them (attention/routing.py); tests run their references in their place.
"""
