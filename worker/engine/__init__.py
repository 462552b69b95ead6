"""Continuous batching with planned prefix reuse: the loop (schedule -> step -> collect) and its pure parts.

Owns: the loop (loop.py) and its config (config.py), the contract the runtime runs engines through (contract.py:
Control, Hooks, EngineLike), the scheduler and planner (token trie order, warm-up points), warm-ups, what a
request is charged as cached (charges.py), sequences and stop strings, results and the run's accounting, and
the limits every engine checks prompts against (limits.py). Pure except through backend/ and extras/.
"""
