"""Embedding models: how a model pools and normalizes (read from its sentence-transformers files), its inputs
tokenized and checked, the batched prefill-only runner (length-sorted batches under a token budget, padding
masked, no decode loop, no KV cache kept), decoder models through mlx-lm and encoders through mlx-embeddings,
and the engine a worker runs when its model is an embedding model.
"""
