"""Continuous batching with planned prefix reuse: the loop (schedule -> step -> collect) and its pure parts.

Owns: the loop (loop.py) and its config (config.py); the contract the runtime runs engines through (contract.py:
Control, Hooks, EngineLike) and the limits every engine checks (limits.py); the scheduler (scheduler.py) and the
planner under it (planner.py: token trie order, warm-up points); warm-ups (warmup.py); what a request is
charged as cached (charges.py); sequences (sequence.py) and stop strings (stopping.py); results and the run's
accounting (results.py); and a test hook into admission (faults.py). Pure except through backend/ and extras/.
"""
