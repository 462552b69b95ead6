"""Mistral 3 / Pixtral and LLaVA-NeXT prompts against mlx-vlm's own processor and embedding merge, on the tiny
fixtures (tests/vision_fixtures_mistral.py), for images of many sizes and aspect ratios: each image's token
count and ids come from its size alone and equal what mlx-vlm runs; the configurations the twins cannot compute
as mlx-vlm does stay serial. (Greedy equality with mlx_vlm.generate: tests/test_vision_families.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm")

from omlx_jobs.errors import ErrorCode  # noqa: E402
from omlx_jobs.jobs.formats import CHAT_URL  # noqa: E402
from omlx_jobs.worker import loading  # noqa: E402
from omlx_jobs.worker.prompts import ImageError  # noqa: E402
from omlx_jobs.worker.vision.loaded import VisionLoaded  # noqa: E402
from omlx_jobs.worker.vision.model import VisionModel, template_text  # noqa: E402
from tests.test_vision import picture  # noqa: E402
from tests.test_vision_engine import chat, png  # noqa: E402
from tests.vision_fixtures_mistral import BUILDERS, build_mistral3  # noqa: E402

SIZES = [(100, 70), (60, 60), (7, 5), (64, 8), (8, 64), (300, 40), (33, 200), (129, 65)]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionLoaded:
    out = loading.load(str(BUILDERS[request.param](tmp_path_factory.mktemp(request.param))))
    assert isinstance(out, VisionLoaded) and out.vision is not None and out.vision.batched
    return out


@pytest.mark.parametrize("size", SIZES)
def test_an_image_prompt_is_what_mlx_vlm_runs(loaded: VisionLoaded, size: tuple[int, int]) -> None:
    """Our ids equal the processor's (Mistral 3 / Pixtral: rows of [IMG], [IMG_BREAK], [IMG_END]); the prompt's
    length is the embedding rows mlx-vlm's model builds from the processor's output (LLaVA-NeXT: not its ids')."""
    vm = loaded.vision
    assert vm is not None
    image = picture(*size, 1)
    body = chat("What is this?", png(*size, 1))
    prompt = vm.build_prompt(body["messages"], [image])
    text = template_text(vm, body["messages"])
    out = vm.processor(text=text, images=[image.pixels])
    ids = mx.array(out["input_ids"]).reshape(1, -1)
    extra = {"image_sizes": out["image_sizes"]} if "image_sizes" in out else {}
    embeds = vm.model.get_input_embeddings(ids, mx.array(out["pixel_values"]), **extra).inputs_embeds
    assert len(prompt) == embeds.shape[1]
    if vm.model_type != "llava_next":
        assert list(prompt.tokens) == ids[0].tolist()
    (span,) = prompt.spans
    ours = vm.image_features(image).features
    assert ours.shape[0] == span.length
    assert mx.allclose(ours, embeds[0, span.start : span.end], atol=1e-5).item()  # features where mlx-vlm puts them


def test_images_of_very_different_sizes_batch_together(loaded: VisionLoaded) -> None:
    """One batch of SIZES' images (different token counts, extreme aspect ratios, rows of different lengths): the
    greedy ids equal mlx_vlm.generate's, request by request."""
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from tests.test_vision_engine import run
    from tests.test_vision_families import items, reference

    bodies = [chat("What is this?" + " Look closely." * (i % 3), png(*size, i % 4)) for i, size in enumerate(SIZES)]
    work = items(loaded, bodies)
    assert len({m.length for w in work for m in w.prompt.media}) >= 2, "images of different token counts"
    results, _ = run(Engine(loaded, EngineConfig(completion_batch_size=8, prefill_batch_size=4)), work)
    assert [results[i].choices[0].token_ids for i in range(len(work))] == [reference(loaded, b) for b in bodies]


def test_llava_next_refuses_a_second_image(loaded: VisionLoaded) -> None:
    """mlx-vlm 0.7.10's LLaVA-NeXT reads only a prompt's first image: two fail the request alone, with a reason."""
    body = chat("Which one is brighter?", png(60, 60, 1), png(84, 56, 3))
    if loaded.vision is None or loaded.vision.model_type != "llava_next":
        assert len(loaded.prompt(CHAT_URL, body).tokens) > 0
        return
    with pytest.raises(ImageError) as err:
        loaded.prompt(CHAT_URL, body)
    assert err.value.code == ErrorCode.IMAGE_REJECTED_BY_PROCESSOR and "at most 1 image" in str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
        {"use_qk_norm": True},
    ],
)
def test_what_the_twin_cannot_compute_stays_serial(tmp_path: Path, text: dict) -> None:
    path = build_mistral3(tmp_path / "m3", shape={"text": text})
    vm = VisionModel.load(path)
    assert json.loads((path / "config.json").read_text())["text_config"].items() >= text.items()
    assert vm.model_type == "mistral3" and not vm.batched


@pytest.mark.parametrize("family", ["mistral3_small", "llava_next"])
def test_a_4bit_checkpoint_decodes_as_mlx_vlm_does(tmp_path: Path, family: str) -> None:
    """mlx-community's checkpoints are quantized: the twin is quantized like the source and shares its arrays,
    and the job still equals mlx_vlm.generate on the quantized model."""
    from mlx_vlm.convert import convert

    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from tests.test_vision_engine import run
    from tests.test_vision_families import bodies, items, reference

    convert(str(BUILDERS[family](tmp_path / family)), str(tmp_path / "q"), quantize=True, q_group_size=32, q_bits=4)
    loaded = loading.load(str(tmp_path / "q"))
    assert isinstance(loaded, VisionLoaded) and loaded.vision is not None and loaded.vision.batched
    twin = getattr(loaded.model, "language_model", loaded.model)
    assert type(twin.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    work = items(loaded, bodies(loaded))
    results, _ = run(Engine(loaded, EngineConfig(min_shared_tokens=8)), work)
    got = [results[i].choices[0].token_ids for i in range(len(work))]
    assert got == [reference(loaded, b) for b in bodies(loaded)]
