"""Text models on disk: where a --model string points, loading with mlx-lm, GGUF import, and BLAS.

Owns: paths, identity and context length (paths.py), the loaded text model and its prompts (loaded.py),
models this package can find by itself (catalog.py), GGUF files, their tokenizers and conversion (gguf_file.py,
gguf_tokenizer.py, gguf.py), and loading OpenBLAS before MLX (blas.py).
"""
