"""Benchmarks of one step or one layer: decode attention (ragged kernel), cascade attention over a shared prefix,
CPU prefill in causal blocks. Each prints its timings side by side with the path it replaces."""
