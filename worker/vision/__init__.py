"""Images: fetch and decode under limits, vision features and their cache, image prefill, the serial path.

Owns: image bytes and pixels (images.py), image prompts and their keys (prompt.py, pure), mlx-vlm models and
their decode twins (model.py), features cached by digest (feature_cache.py, pure), prefill from embeddings
(prefill.py), a request's images in the engine (media.py), the vision backend (backend.py), the loaded vision
model (loaded.py), remote images fetched ahead (prefetch.py), and families that cannot batch, one request at a
time on mlx-vlm (serial.py). Each batched family's glue is its own adapter in the families/ subpackage.
"""
