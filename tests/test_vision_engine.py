"""Image requests through the real engine on tiny random Qwen2-VL / Qwen2.5-VL models: batched with each other
and with text, greedy token ids equal to single-request mlx-vlm generation; prefix reuse keyed by image identity;
the serial fallback; cached_tokens."""

from __future__ import annotations

import base64
import copy
import io
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm")

from omlx_jobs.errors import ErrorCode  # noqa: E402
from omlx_jobs.jobs.formats import CHAT_URL, COMPLETIONS_URL, SamplingParams  # noqa: E402
from omlx_jobs.jobs.images import ImageAccess  # noqa: E402
from omlx_jobs.jobs.params import OutputParams  # noqa: E402
from omlx_jobs.worker import loading  # noqa: E402
from omlx_jobs.worker.engine.config import EngineConfig  # noqa: E402
from omlx_jobs.worker.engine.loop import Engine  # noqa: E402
from omlx_jobs.worker.engine.results import ItemResult  # noqa: E402
from omlx_jobs.worker.engine.sequence import WorkItem  # noqa: E402
from omlx_jobs.worker.prompts import PromptError, common_prefix  # noqa: E402
from omlx_jobs.worker.vision.inputs.media import vision_prompt  # noqa: E402
from omlx_jobs.worker.vision.loaded import TemplatePrompt, VisionLoaded  # noqa: E402
from omlx_jobs.worker.vision.prefill import prefill  # noqa: E402
from omlx_jobs.worker.vision.serial import SerialEngine  # noqa: E402
from tests.test_vision import generate_text, picture  # noqa: E402
from tests.tiny_vlm import build_tiny_vlm  # noqa: E402

N_TOKENS = 8
SYSTEM = "You are a helpful assistant. Answer briefly and clearly."


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionLoaded:
    path = build_tiny_vlm(tmp_path_factory.mktemp(request.param), model_type=request.param)
    out = loading.load(str(path))
    assert isinstance(out, VisionLoaded) and out.vision is not None and out.vision.batched
    return out


def png(w: int, h: int, kind: int) -> bytes:
    buf = io.BytesIO()
    picture(w, h, kind).pixels.save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(question: str, *images: bytes, system: bool = False, after: bool = False) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_uri(d)}} for d in images]
    text = [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": text + parts if after else parts + text}]
    if system:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"messages": messages, "max_tokens": N_TOKENS, "temperature": 0}


def items(loaded: VisionLoaded, bodies: list[dict[str, Any]]) -> list[WorkItem]:
    out = []
    for i, body in enumerate(bodies):
        prompt = loaded.prompt(CHAT_URL, body)
        out.append(WorkItem(i, prompt.tokens, SamplingParams.from_body(body), prompt))
    return out


def run(engine: Any, work: list[WorkItem]) -> tuple[dict[Any, ItemResult], Any]:
    results: dict[Any, ItemResult] = {}
    stats = engine.run(work, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.unfinished == []
    return results, stats


def reference(loaded: VisionLoaded, body: dict[str, Any]) -> list[int]:
    """Single-request greedy generation by mlx-vlm, from the same template text and the same pixels."""
    from omlx_jobs.worker.vision.model import _template_messages

    vm = loaded.vision
    assert vm is not None
    msgs, _ = _template_messages(body["messages"])
    text = vm.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    pics = [p.ref.decoded() for p in vision_prompt(loaded.prompt(CHAT_URL, body)).extra["images"]]
    ids = generate_text(vm, text, pics)
    eos = set(loaded.tokenizer.eos_token_ids)
    return [t for t in ids if t not in eos][:N_TOKENS]


def mixed_bodies() -> list[dict[str, Any]]:
    a, b, c = png(100, 70, 0), png(60, 60, 1), png(120, 112, 2)
    return [
        chat("Name three primary colors."),  # text only, on a vision model
        chat("Describe this image.", a),
        chat("What color is the square in the picture? Answer briefly, in one word please.", b),
        chat("How many?", c, after=True),
        chat("Which one is brighter, and why?", png(84, 56, 3), a),
        *[chat(q, a, system=True) for q in ("What is this?", "Is it a photo?", "What colors do you see here?")],
        *[chat(q, c, system=True) for q in ("What is this?", "Is it a photo?")],
    ]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_image_job_equals_single_request_mlx_vlm(loaded: VisionLoaded, prefix_cache: bool) -> None:
    bodies = mixed_bodies()
    work = items(loaded, bodies)
    assert len({len(w.prompt) for w in work}) > 6, "prompts of different lengths: rows are left-padded"
    config = EngineConfig(prefix_cache=prefix_cache, completion_batch_size=6, prefill_batch_size=3, min_shared_tokens=8)
    results, stats = run(Engine(loaded, config), work)
    got = [results[i].choices[0].token_ids for i in range(len(bodies))]
    assert got == [reference(loaded, b) for b in bodies]
    assert all(results[i].prompt_tokens == len(work[i].prompt) for i in range(len(bodies)))  # image tokens count
    if prefix_cache:  # the system prompt and its image, shared by 3 and 2 questions, were computed once
        assert stats.warmups >= 2 and stats.prefill_tokens < sum(len(w.prompt) for w in work)


def test_image_prefixes_of_a_window_are_computed_in_one_batch(loaded: VisionLoaded, monkeypatch: Any) -> None:
    """Distinct images (a captioning job): each request's image positions are its own, computed for the whole
    window in one right-padded batch, not one request at a time."""
    from omlx_jobs.worker.vision import prefill as vision_prefill

    sizes: list[int] = []
    real = vision_prefill.prefill_rows

    def counting(vm: Any, prompts: list[Any], *args: Any, **kw: Any) -> Any:
        sizes.append(len(prompts))
        return real(vm, prompts, *args, **kw)

    monkeypatch.setattr(vision_prefill, "prefill_rows", counting)
    bodies = [chat("Describe this image.", png(56 + 28 * (k % 3), 84, k)) for k in range(4)]
    config = EngineConfig(completion_batch_size=4, prefill_batch_size=4, min_shared_tokens=8)
    results, _ = run(Engine(loaded, config), items(loaded, bodies))
    assert sizes and max(sizes) == 4
    assert [results[i].choices[0].token_ids for i in range(4)] == [reference(loaded, b) for b in bodies]
    assert all(r.cached_tokens == 0 for r in results.values())


def test_same_image_is_reused_and_shows_in_cached_tokens(loaded: VisionLoaded) -> None:
    a = png(100, 70, 0)
    bodies = [chat(q, a, system=True) for q in ("What is this?", "Is it a photo?", "What colors do you see?")]
    work = items(loaded, bodies)
    image_end = max(m.start + m.length for m in work[0].prompt.media)
    engine = Engine(loaded, EngineConfig(min_shared_tokens=8))
    results, stats = run(engine, work)
    for i in range(3):
        assert results[i].choices[0].token_ids == reference(loaded, bodies[i])
    # The system prompt and the image are computed once, charged to the first request that reuses them
    # (worker/engine/charges.py); the other two have them cached.
    cached = sorted(results[i].cached_tokens for i in range(3))
    assert cached[0] < image_end <= cached[1]
    assert stats.prefill_tokens <= sum(len(w.prompt) for w in work) - 2 * image_end
    assert stats.prefill_tokens == sum(len(w.prompt) - results[i].cached_tokens for i, w in enumerate(work))
    # a later job with the same image and leading text starts from the cached image prefix
    again, _ = run(engine, items(loaded, [chat("How many objects?", a, system=True)]))
    assert again[0].cached_tokens >= image_end


def test_text_rows_from_a_cached_image_prefix_run_at_text_positions(loaded: VisionLoaded) -> None:
    """Entries of image prompts carry RoPE breaks after each image; a text prompt that shares only their
    system prompt, warmed up from a view of one, must not inherit them."""
    engine = Engine(loaded, EngineConfig(min_shared_tokens=8))
    a = png(120, 112, 2)
    run(engine, items(loaded, [chat(q, a, system=True) for q in ("What is this?", "Is it a photo?")]))
    long = "Please answer the next question in a few words, and then explain your answer"
    bodies = [chat(f"{long} {q}", system=True) for q in ("What is red?", "Why is the sky blue today?")]
    work = items(loaded, bodies)
    assert len(work[0].prompt) > max(len(w.prompt) for w in items(loaded, [chat("What is this?", a, system=True)]))
    results, stats = run(engine, work)
    assert stats.warmups >= 1 and results[0].cached_tokens > 0
    assert [results[i].choices[0].token_ids for i in range(2)] == [reference(loaded, b) for b in bodies]


def test_image_prefixes_from_the_disk_tier(loaded: VisionLoaded, tmp_path: Path) -> None:
    """A later engine (a restarted worker) finds a saved system prompt + image prefix on disk, RoPE offsets
    included, and decodes exactly as single-request mlx-vlm."""
    a = png(120, 112, 2)
    config = EngineConfig(min_shared_tokens=8, cache_dir=str(tmp_path))
    run(Engine(loaded, config), items(loaded, [chat(q, a, system=True) for q in ("What is this?", "Is it a photo?")]))
    later = [chat(q, a, system=True) for q in ("What colors do you see?", "How many objects?")]
    engine = Engine(loaded, config)
    assert engine.disk is not None and len(engine.disk) > 0
    results, stats = run(engine, items(loaded, later))
    assert stats.disk_hits >= 1
    assert [results[i].choices[0].token_ids for i in range(2)] == [reference(loaded, b) for b in later]


def test_alone_an_image_request_reports_nothing_cached(loaded: VisionLoaded) -> None:
    engine = Engine(loaded, EngineConfig(min_shared_tokens=8))
    results, stats = run(engine, items(loaded, [chat("Describe this image.", png(60, 60, 3))]))
    assert results[0].cached_tokens == 0 and stats.prefill_tokens == results[0].prompt_tokens


def test_different_images_with_the_same_text_never_share_an_entry(
    loaded: VisionLoaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Identical prompts except for the image (same size, so the same token ids): each pair is computed on its
    own, and the logits the cache keeps after each prompt are that image's, not the other's. (The run's end
    keeps every entry here, so that the test can read them: by default it keeps only each tree's top.)"""
    a, b = png(100, 70, 0), png(100, 70, 2)
    bodies = [chat("What is this?", a), chat("What is this?", a), chat("What is this?", b), chat("What is this?", b)]
    work = items(loaded, bodies)
    assert work[0].tokens == work[2].tokens and work[0].prompt.key != work[2].prompt.key
    engine = Engine(loaded, EngineConfig(min_shared_tokens=4))
    monkeypatch.setattr(engine.cache, "drop_descendants", list)
    results, _ = run(engine, work)
    entries = {e.key: e for e in engine.cache.entries()}
    ea, eb = entries[work[0].prompt.key], entries[work[2].prompt.key]  # each whole prompt, with its logits
    assert ea is not eb and ea.logits is not None and eb.logits is not None
    vm, first = loaded.vision, work[0].prompt.media[0].start
    assert vm is not None
    fresh_a = prefill(vm, vision_prompt(work[0].prompt)).logits
    fresh_b = prefill(vm, vision_prompt(work[2].prompt)).logits
    assert mx.allclose(ea.logits[0], fresh_a, atol=1e-4).item()
    assert mx.allclose(eb.logits[0], fresh_b, atol=1e-4).item()
    assert mx.abs(fresh_a - fresh_b).max().item() > 1e-2
    assert results[0].choices[0].token_ids == reference(loaded, bodies[0])
    assert results[2].choices[0].token_ids == reference(loaded, bodies[2])
    assert common_prefix(ea.key, eb.key) == first  # the keys part at the image's first position
    lookup = engine.cache.lookup(work[2].prompt.key, count=False)
    assert lookup is not None and lookup.entry is eb


def test_shard_boundaries_part_at_the_first_different_image(loaded: VisionLoaded) -> None:
    """What a shard shares with its neighbours (job accounting) is counted by key, not by token ids."""
    from omlx_jobs.worker.prompts import positions
    from omlx_jobs.worker.runtime.shard import ShardInput

    work = items(loaded, [chat("What is this?", png(100, 70, 0)), chat("What is this?", png(100, 70, 2))])
    source = ShardInput()
    source.placed = [(w, b"group") for w in work]
    assert len(list(source)) == 2
    lead, tail = source.lead, source.tail
    assert lead == tail and positions(lead) == work[0].prompt.media[0].start


def test_serial_fallback_equals_single_request_mlx_vlm(loaded: VisionLoaded) -> None:
    """A family that cannot batch runs one request at a time on mlx-vlm (forced here on a batchable one)."""
    bodies = mixed_bodies()[:5]
    expected = [reference(loaded, b) for b in bodies]
    batched_lengths = [len(w.prompt) for w in items(loaded, bodies)]
    serial = VisionLoaded(**{**loaded.__dict__, "model": loaded.vision.model})
    serial.vision = copy.copy(loaded.vision)
    serial.vision.batched = False  # prompts through mlx-vlm's processor, as for any other family
    work = items(serial, bodies)
    assert all(isinstance(w.prompt, TemplatePrompt) for w in work)
    results, stats = run(SerialEngine(serial), work)
    assert [results[i].choices[0].token_ids for i in range(5)] == expected
    assert [results[i].prompt_tokens for i in range(5)] == batched_lengths  # image tokens counted
    assert all(r.cached_tokens == 0 for r in results.values()) and stats.generation_tokens > 0


def test_serial_fallback_fails_extras_it_cannot_give_alone(loaded: VisionLoaded) -> None:
    """The shard runner checks every request with its engine's check: on the serial engine that raised
    AttributeError (no Outputs) for every request, and extras it cannot give must fail that request alone."""
    serial = VisionLoaded(**{**loaded.__dict__, "model": loaded.vision.model})
    serial.vision = copy.copy(loaded.vision)
    serial.vision.batched = False
    engine, params = SerialEngine(serial), SamplingParams()
    engine.check([1, 2, 3], params, OutputParams())  # nothing asked beyond sampling: runs
    for asked in ({"logprobs": True}, {"logit_bias": ((5, 1.0),)}, {"echo": True}):
        with pytest.raises(PromptError) as err:
            engine.check([1, 2, 3], params, OutputParams(**asked))
        assert err.value.code is ErrorCode.UNSUPPORTED_PARAMETER and next(iter(asked)) in err.value.message
    with pytest.raises(PromptError) as err:
        engine.check(list(range(5000)), params, OutputParams())
    assert err.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_n_choices_of_an_image_request(loaded: VisionLoaded, prefix_cache: bool) -> None:
    body = {**chat("Describe this image.", png(100, 70, 1)), "n": 2}
    results, _ = run(Engine(loaded, EngineConfig(prefix_cache=prefix_cache)), items(loaded, [body]))
    expected = reference(loaded, body)
    assert [c.token_ids for c in results[0].choices] == [expected, expected]


def test_a_completions_prompt_on_a_vision_model(loaded: VisionLoaded) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": N_TOKENS, "temperature": 0}
    prompt = loaded.prompt(COMPLETIONS_URL, body)
    assert loaded.encode(COMPLETIONS_URL, body) == prompt.tokens and not prompt.media
    results, _ = run(Engine(loaded), [WorkItem(0, prompt.tokens, SamplingParams.from_body(body), prompt)])
    assert loaded.vision is not None
    eos = set(loaded.tokenizer.eos_token_ids)
    expected = [t for t in generate_text(loaded.vision, body["prompt"], []) if t not in eos][:N_TOKENS]
    assert results[0].choices[0].token_ids == expected


def test_a_text_model_refuses_images(tiny_loaded: Any) -> None:
    from omlx_jobs.worker.prompts import PromptError

    with pytest.raises(PromptError) as exc:
        tiny_loaded.prompt(CHAT_URL, chat("What is this?", png(60, 60, 0)))
    assert exc.value.code == "images_not_supported"


def test_one_image_asked_about_many_times_is_loaded_once(loaded: VisionLoaded, monkeypatch: Any) -> None:
    from omlx_jobs.jobs import fetch
    from omlx_jobs.jobs.images import ImageSourceError
    from omlx_jobs.worker.prompts import ImageError
    from omlx_jobs.worker.vision.inputs.media import ImageMemo

    calls: list[str] = []

    def unreachable(url: str, access: Any) -> bytes:
        calls.append(url)
        raise ImageSourceError("image_unreachable", f"could not fetch {url}")

    monkeypatch.setattr(fetch, "fetch_remote", unreachable)
    access = ImageAccess.create(allow_remote=True, allow_remote_hosts=["127.0.0.1"])
    remote = VisionLoaded(**{**loaded.__dict__, "access": access, "memo": ImageMemo()})
    url = "http://127.0.0.1:9/x.png"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    for _ in range(3):
        with pytest.raises(ImageError) as exc:
            remote.prompt(CHAT_URL, body)
        assert exc.value.code == "image_unreachable"
    assert calls == [url]  # one attempt, not one timeout per question
    first, again = (remote.prompt(CHAT_URL, chat(q, png(60, 60, 0))) for q in ("a?", "b?"))
    assert first.media[0].image is again.media[0].image  # the same data: URI, decoded once


def test_worker_access_is_checked_again(loaded: VisionLoaded, tmp_path: Path) -> None:
    from omlx_jobs.worker.prompts import ImageError

    (tmp_path / "a.png").write_bytes(png(60, 60, 0))
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(tmp_path / "a.png")}}]}
        ]
    }
    with pytest.raises(ImageError) as exc:
        loaded.prompt(CHAT_URL, body)  # this loaded model's worker allows no folder
    assert exc.value.code == "image_path_not_allowed"
    allowed = VisionLoaded(**{**loaded.__dict__, "access": ImageAccess.create([tmp_path])})
    assert len(allowed.prompt(CHAT_URL, body).media) == 1
