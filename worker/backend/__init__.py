"""The backend: the only door to mlx-lm's internals (BatchGenerator, its private state, its cache classes' insides).

Owns: the model run outside a batch (model.py: cache probing, warm-up prefill), continuous decode batches
(decode.py), cascade batches whose rows reference their cached prefix (cascade_batch.py) and the batch KV cache
that holds those prefixes once (cascade_cache.py), and the rows and outputs the engine exchanges with them
(rows.py). Checked for mlx-lm 0.32.2 (pinned exactly).
"""
