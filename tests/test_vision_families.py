"""The families beside Qwen2-VL batched through the one engine (vision/families/): LLaVA, Gemma 3, Qwen3-VL,
and (tests/vision_fixtures_mistral.py) Mistral 3, Pixtral and LLaVA-NeXT, on tiny random checkpoints
(tests/vision_fixtures.py). Greedy token ids equal single-request mlx_vlm.generate on the
same prompt, batched and alone, with and without prefix reuse; a repeated image after the same text is reused;
text-only requests equal the text path; the prompt comes from the tokenizer's chat template (these processors
keep none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm")

from omlx_jobs.jobs.formats import CHAT_URL, SamplingParams  # noqa: E402
from omlx_jobs.worker import loading  # noqa: E402
from omlx_jobs.worker.engine.config import EngineConfig  # noqa: E402
from omlx_jobs.worker.engine.loop import Engine  # noqa: E402
from omlx_jobs.worker.engine.sequence import WorkItem  # noqa: E402
from omlx_jobs.worker.vision.inputs.media import vision_prompt  # noqa: E402
from omlx_jobs.worker.vision.loaded import VisionLoaded  # noqa: E402
from omlx_jobs.worker.vision.model import template_text  # noqa: E402
from tests.test_vision import generate_text  # noqa: E402
from tests.test_vision_engine import N_TOKENS, chat, mixed_bodies, png, run  # noqa: E402
from tests.vision_fixtures import BUILDERS  # noqa: E402
from tests.vision_fixtures_mistral import BUILDERS as MISTRAL_BUILDERS  # noqa: E402

FIXTURES = {**BUILDERS, **MISTRAL_BUILDERS}
TOKENIZER_TEMPLATE_ONLY = ("llava", "llava_next", "gemma3", "mistral3", "mistral3_small", "pixtral")


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionLoaded:
    path: Path = FIXTURES[request.param](tmp_path_factory.mktemp(request.param))
    out = loading.load(str(path))
    assert isinstance(out, VisionLoaded) and out.vision is not None and out.vision.batched
    if request.param in TOKENIZER_TEMPLATE_ONLY:  # as real checkpoints: only the tokenizer keeps the template
        assert not getattr(out.vision.processor, "chat_template", None), "the fixture must lack a processor template"
    return out


def items(loaded: VisionLoaded, bodies: list[dict[str, Any]]) -> list[WorkItem]:
    out = []
    for i, body in enumerate(bodies):
        prompt = loaded.prompt(CHAT_URL, body)
        out.append(WorkItem(i, prompt.tokens, SamplingParams.from_body(body), prompt))
    return out


def reference(loaded: VisionLoaded, body: dict[str, Any]) -> list[int]:
    """mlx_vlm.generate alone, on the same template text (the tokenizer's template) and the same pixels."""
    vm = loaded.vision
    assert vm is not None
    text = template_text(vm, body["messages"])
    pics = [p.ref.decoded() for p in vision_prompt(loaded.prompt(CHAT_URL, body)).extra["images"]]
    try:
        ids = generate_text(vm, text, pics)
    except ValueError as exc:  # transformers 5's LLaVA image processor refuses what mlx-vlm's processor passes
        if "Failed to process inputs" not in str(exc):
            raise
        ids = prepared_generate(vm, text, pics)
    eos = set(loaded.tokenizer.eos_token_ids)
    return [t for t in ids if t not in eos][:N_TOKENS]


def prepared_generate(vm: Any, text: str, pics: list[Any]) -> list[int]:
    """mlx_vlm.generate from caller-prepared tensors: the processor's own text expansion (each image token
    repeated as many times as the tower gives features) and its image processor's pixels."""
    import numpy as np
    from mlx_vlm import generate

    token = vm.processor.image_token
    counts = [vm.image_tokens(p) for p in pics]
    expanded = vm.family.expand_text(vm, text)
    for n in counts:
        expanded = expanded.replace(token, "\0" * n, 1)
    ids = mx.array([vm.tokenizer(expanded.replace("\0", token))["input_ids"]])
    pixels = (
        mx.array(np.asarray(vm.processor.image_processor([p.pixels for p in pics])["pixel_values"])) if pics else None
    )
    result = generate(
        vm.model,
        vm.processor,
        "",
        input_ids=ids,
        pixel_values=pixels,
        max_tokens=N_TOKENS,
        temperature=0.0,
        verbose=False,
    )
    return list(result.token_ids)


def bodies(loaded: VisionLoaded) -> list[dict[str, Any]]:
    """test_vision_engine's mixed job without its last two rows (a second image's system group): each family's
    fixture runs it batched and single, so it stays a few seconds."""
    limit = loaded.vision.family.max_images if loaded.vision is not None else None  # LLaVA-NeXT: one image
    return [b for b in mixed_bodies()[:-2] if limit is None or len(images_of(b)) <= limit]


def images_of(body: dict[str, Any]) -> list[Any]:
    parts = [m["content"] for m in body["messages"] if isinstance(m["content"], list)]
    return [p for content in parts for p in content if p["type"] == "image_url"]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_image_job_equals_single_request_mlx_vlm(loaded: VisionLoaded, prefix_cache: bool) -> None:
    work = items(loaded, bodies(loaded))
    assert len({len(w.prompt) for w in work}) > 5, "rows of different lengths"
    config = EngineConfig(prefix_cache=prefix_cache, completion_batch_size=5, prefill_batch_size=3, min_shared_tokens=8)
    results, stats = run(Engine(loaded, config), work)
    got = [results[i].choices[0].token_ids for i in range(len(work))]
    assert got == [reference(loaded, b) for b in bodies(loaded)]
    assert all(results[i].prompt_tokens == len(w.prompt) for i, w in enumerate(work))  # image tokens count
    if prefix_cache:  # the system prompt and its image, shared by 3 questions
        assert stats.prefill_tokens < sum(len(w.prompt) for w in work)


def test_a_single_image_request_equals_mlx_vlm(loaded: VisionLoaded) -> None:
    body = chat("Describe this image.", png(60, 60, 3))
    results, stats = run(Engine(loaded, EngineConfig(min_shared_tokens=8)), items(loaded, [body]))
    assert results[0].choices[0].token_ids == reference(loaded, body)
    assert results[0].cached_tokens == 0 and stats.prefill_tokens == results[0].prompt_tokens


def test_same_image_after_the_same_text_is_reused(loaded: VisionLoaded) -> None:
    a = png(100, 70, 0)
    first = [chat(q, a, system=True) for q in ("What is this?", "Is it a photo?")]
    engine = Engine(loaded, EngineConfig(min_shared_tokens=8))
    work = items(loaded, first)
    image_end = max(m.start + m.length for m in work[0].prompt.media)
    results, _ = run(engine, work)
    assert [results[i].choices[0].token_ids for i in range(2)] == [reference(loaded, b) for b in first]
    later = chat("How many objects?", a, system=True)
    again, _ = run(engine, items(loaded, [later]))
    assert again[0].cached_tokens >= image_end  # the system prompt and the image's positions
    assert again[0].choices[0].token_ids == reference(loaded, later)


def test_text_only_requests_equal_the_text_path(loaded: VisionLoaded) -> None:
    """A text request on the vision model decodes as mlx-lm's own generation on the decode twin."""
    from mlx_lm.generate import generate_step

    body = chat("Name three primary colors, and say why.")
    work = items(loaded, [body])
    results, _ = run(Engine(loaded), work)

    def greedy(logprobs: Any) -> Any:
        return mx.argmax(logprobs, axis=-1)

    steps = generate_step(mx.array(list(work[0].tokens)), loaded.model, max_tokens=N_TOKENS, sampler=greedy)
    eos = set(loaded.tokenizer.eos_token_ids)
    expected = []
    for token, _ in steps:
        if int(token) in eos:
            break
        expected.append(int(token))
    assert results[0].choices[0].token_ids == expected == reference(loaded, body)
