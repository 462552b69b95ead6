"""An image request's inputs before any model sees them: fetched (remote images ahead of their rows, within a total
deadline) and decoded once under the limits (images.py, media.py, prefetch.py)."""
