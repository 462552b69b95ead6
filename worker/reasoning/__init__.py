"""Thinking models: where a family's thinking starts and ends, the thinking split from the answer, and the
thinking budget that forces the close sequence.

Owns: the family's think markers, found from its chat template and tokenizer (markers.py), the split of an output
into reasoning_content and content with its reasoning tokens counted (split.py), and the per-choice tracker and
logits processor that force the close sequence once the budget is spent (budget.py).
"""
