"""Speculative decoding in the batch: drafts from each row's own history, verified exactly by the target model.

Owns: the n-gram (prompt-lookup) proposer over a row's prompt and generated tokens (proposer.py); the
acceptance rules, greedy and sampled (acceptance.py: pure); the verification of one row's drafted positions
from the model's logits (verify.py); and the cost controller that keeps speculation on per row only while it
pays (controller.py: pure). The batch step that runs them and the KV-cache rollback live in backend/ (the one
door to mlx-lm's internals): backend/speculative.py, backend/rollback.py.
"""
