# A Linux worker image: MLX on its CPU backend (the `cpu` extra) with PostgreSQL support; the same image runs
# `omlx-jobs serve` (the `serve` extra) in compose.yaml.
# On macOS, run the worker on the host instead (`omlx-jobs worker --model ...`): Metal is not reachable
# from containers. compose.yaml builds this image for its `worker` service.
FROM python:3.11-slim

# The worker preloads OpenBLAS before MLX (worker/blas.py): the mlx-cpu wheel's reference BLAS is 15-80x slower.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package is built from (the repository root is the import package `omlx_jobs`);
# README.md* matches nothing harmlessly if the file is absent.
COPY pyproject.toml README.md* ./
COPY __init__.py defaults.py errors.py py.typed ./
COPY cli ./cli
COPY jobs ./jobs
COPY store ./store
COPY worker ./worker
COPY api ./api
RUN pip install --no-cache-dir '.[cpu,postgres,serve]'

# Run as a user of its own; /models (Hugging Face downloads) and /cache (prefix caches) are volumes it writes.
RUN useradd --create-home --uid 1000 omlx && mkdir -p /models /cache /files && chown omlx:omlx /models /cache /files
USER omlx
WORKDIR /home/omlx
ENV HF_HOME=/models/huggingface \
    OMLX_JOBS_CACHE_DIR=/cache

CMD ["omlx-jobs", "--help"]
