"""Short model names and queue keys from --model strings, on real files and symbolic links (no MLX)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omlx_jobs.jobs.model_names import display_name, is_path, model_key, resolved
from omlx_jobs.jobs.queue import legacy_queue_name, priority_queues, queue_name, worker_queues


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "models" / "Qwen3-0.6B-4bit").mkdir(parents=True)
    (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    (tmp_path / "link").symlink_to(tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_spellings_of_one_model_meet_on_one_queue(models: Path) -> None:
    gguf = models / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    spellings = [
        f"gguf:{gguf}",
        "gguf:models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "GGUF: ~/link/SmolLM2-135M-Instruct.Q4_1.gguf",
        f"gguf:{models}/link/../models/SmolLM2-135M-Instruct.Q4_1.gguf",
        str(gguf),  # the file itself: the prefix is implied
    ]
    assert {resolved(s) for s in spellings} == {f"gguf:{os.path.realpath(gguf)}"}
    assert len({queue_name(s) for s in spellings}) == 1
    directory = ["./models/Qwen3-0.6B-4bit", "~/link/Qwen3-0.6B-4bit/", str(models / "models" / "Qwen3-0.6B-4bit")]
    assert len({model_key(s) for s in directory}) == 1
    assert model_key(directory[0]) != model_key(spellings[0])
    # A Hub id is kept as given; a folder of another machine is one spelling of its absolute path.
    assert resolved(" mlx-community/Qwen3-0.6B-4bit ") == "mlx-community/Qwen3-0.6B-4bit"
    assert resolved("/srv/models//x/") == "/srv/models/x"
    assert queue_name("mlx-community/Qwen3-0.6B-4bit").startswith("omlx:mlx-community-Qwen3-0.6B-4bit-")
    assert queue_name("m", "high").endswith(":high")


def test_display_names_are_short(models: Path) -> None:
    assert display_name("gguf:models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert display_name("./models/Qwen3-0.6B-4bit/") == "Qwen3-0.6B-4bit"
    assert display_name("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    assert display_name("./models/Qwen3-0.6B-4bit", "qwen-small") == "qwen-small"
    assert is_path("./models/Qwen3-0.6B-4bit") and not is_path("mlx-community/Qwen3-0.6B-4bit")


def test_a_worker_also_serves_the_queue_its_model_had_before_keys(models: Path) -> None:
    model = str(models / "models" / "Qwen3-0.6B-4bit")
    base = queue_name(model)
    queues = worker_queues(base, model)
    assert queues[::2] == priority_queues(base)
    assert queues[1::2] == priority_queues(legacy_queue_name(model))  # jobs queued by an older submit
    assert worker_queues("omlx:custom", model) == priority_queues("omlx:custom")  # an explicit --queue: only it
