"""Vision pieces on tiny random Qwen2-VL and Qwen2.5-VL models (mRoPE): prompts, features and their cache,
embeddings prefill, and decoding in mlx-lm's BatchGenerator, checked token for token against single-request
mlx-vlm generation."""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from omlx_jobs.worker.cache.positioned import PositionedKVCache, positioned  # noqa: E402
from omlx_jobs.worker.prompts import ImageError  # noqa: E402
from omlx_jobs.worker.vision.feature_cache import FeatureCache  # noqa: E402
from omlx_jobs.worker.vision.inputs import images  # noqa: E402
from omlx_jobs.worker.vision.model import VisionModel, is_batched, vision_model_type  # noqa: E402
from omlx_jobs.worker.vision.prefill import prefill  # noqa: E402
from tests.tiny_vlm import build_tiny_vlm  # noqa: E402

N_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), model_type=request.param)


@pytest.fixture(scope="module")
def vm(vlm_dir: Path) -> VisionModel:
    return VisionModel.load(vlm_dir)


def picture(w: int, h: int, kind: int) -> images.DecodedImage:
    """Distinct, structured pictures (bands, blocks, gradients), decoded the way the worker decodes them."""
    img = Image.new("RGB", (w, h))
    px = img.load()
    for y in range(h):
        for x in range(w):
            if kind == 0:
                px[x, y] = (255, 40, 40) if (x // 8) % 2 else (20, 20, 200)
            elif kind == 1:
                px[x, y] = (x * 255 // w, y * 255 // h, 128)
            elif kind == 2:
                px[x, y] = (0, 255, 0) if (x // 16 + y // 16) % 2 else (250, 250, 250)
            else:
                px[x, y] = ((x * y) % 256, (x + 2 * y) % 256, (3 * x) % 256)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return images.decode(buf.getvalue())


def user(text: str, n_images: int = 1, before: bool = True) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": "u", "detail": "auto"}}] * n_images
    text_part = [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts + text_part if before else text_part + parts}]


def reference(vm: VisionModel, messages: list[dict[str, Any]], pics: list[images.DecodedImage]) -> list[int]:
    """Single-request greedy generation by mlx-vlm itself, from the same prompt text and the same pixels."""

    from omlx_jobs.worker.vision.model import _template_messages

    msgs, _ = _template_messages(messages)
    return generate_text(vm, vm.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), pics)


def generate_text(vm: VisionModel, text: str, pics: list[images.DecodedImage]) -> list[int]:
    from mlx_vlm import generate

    result = generate(
        vm.model,
        vm.processor,
        text,
        image=[p.pixels for p in pics] or None,
        max_tokens=N_TOKENS,
        temperature=0.0,
        verbose=False,
    )
    return list(result.token_ids)


def batched(vm: VisionModel, rows: list[tuple[list[dict[str, Any]], list[images.DecodedImage]]]) -> list[list[int]]:
    """Our path: image rows prefilled from embeddings, text rows by BatchGenerator; all decoded in one batch."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(vm.decode_model(), stop_tokens=[], completion_batch_size=8, prefill_batch_size=8)
    out: dict[int, list[int]] = {}
    for messages, pics in rows:
        prompt = vm.build_prompt(messages, pics)
        if pics:
            pf = prefill(vm, prompt)
            first = int(mx.argmax(pf.logits).item())
            (uid,) = gen.insert([[first]], [N_TOKENS - 1], caches=[pf.caches], all_tokens=[list(prompt.tokens)])
            out[uid] = [first]
        else:
            (uid,) = gen.insert([list(prompt.tokens)], [N_TOKENS])
            out[uid] = []
    while any(len(v) < N_TOKENS for v in out.values()):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return list(out.values())


# ---- recognising and loading ------------------------------------------------------------------------


def test_recognises_a_vision_config(vlm_dir: Path, tiny_model_dir: Path) -> None:
    config = json.loads((vlm_dir / "config.json").read_text())
    assert vision_model_type(config) == config["model_type"] in ("qwen2_vl", "qwen2_5_vl")
    assert vision_model_type(json.loads((tiny_model_dir / "config.json").read_text())) is None
    assert vision_model_type({"model_type": "no_such_vlm", "vision_config": {}}) is None
    assert is_batched(config["model_type"]) and is_batched("llava") and not is_batched("idefics3")


def test_decode_model_shares_the_weights(vm: VisionModel) -> None:
    dec = vm.decode_model()
    src = vm.model.language_model
    assert dec.language_model.model.embed_tokens.weight is src.model.embed_tokens.weight
    assert dec.language_model.model.layers[1].self_attn.q_proj.weight is src.model.layers[1].self_attn.q_proj.weight
    assert isinstance(dec.make_cache()[0], PositionedKVCache)


# ---- prompts ------------------------------------------------------------------------------------------


def test_prompt_tokens_equal_the_processor(vm: VisionModel) -> None:
    pics = [picture(100, 70, 0), picture(60, 60, 1)]
    messages = user("Compare these two pictures.", n_images=2)
    prompt = vm.build_prompt(messages, pics)
    from omlx_jobs.worker.vision.model import _template_messages

    text = vm.processor.apply_chat_template(_template_messages(messages)[0], add_generation_prompt=True, tokenize=False)
    expected = vm.processor(text=[text], images=[p.pixels for p in pics])["input_ids"]
    assert list(prompt.tokens) == mx.array(expected).tolist()[0]
    counts = [vm.image_tokens(p) for p in pics]
    assert [s.length for s in prompt.spans] == counts
    assert [vm.image_features(p).tokens for p in pics] == counts  # known before encoding: planning can count them
    assert all(prompt.tokens[s.start] == vm.image_token_id for s in prompt.spans)


def test_key_units_carry_image_identity(vm: VisionModel) -> None:
    a, b = picture(100, 70, 0), picture(100, 70, 2)  # same size: same number of image tokens
    pa = vm.build_prompt(user("What is this?"), [a])
    pa2 = vm.build_prompt(user("What is this?"), [a])
    pb = vm.build_prompt(user("What is this?"), [b])
    assert pa.tokens == pb.tokens  # the ids alone cannot tell the images apart
    ka, kb = pa.key_units(), pb.key_units()
    first = pa.first_image
    assert ka == pa2.key_units()
    assert ka[:first] == list(pa.tokens[:first]) == kb[:first]
    assert all(x != y for x, y in zip(ka[first : pa.spans[0].end], kb[first : pb.spans[0].end], strict=True))
    assert all(u >= 1 << 31 for u in ka[first : pa.spans[0].end])


def test_prepare_a_stored_body(vm: VisionModel, tmp_path: Path) -> None:
    import base64

    from omlx_jobs.jobs.images import ImageAccess

    buf = io.BytesIO()
    picture(100, 70, 0).pixels.save(buf, "PNG")
    (tmp_path / "b.png").write_bytes(buf.getvalue())
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "text", "text": "Same picture twice:"},
        {"type": "image_url", "image_url": {"url": uri, "detail": "auto"}},
        {"type": "image_url", "image_url": {"url": str(tmp_path / "b.png"), "detail": "low"}},
    ]
    messages = [{"role": "user", "content": content}]
    prompt = vm.prepare(messages, ImageAccess.create([tmp_path]))
    assert len(prompt.spans) == 2 and prompt.spans[0].digest == prompt.spans[1].digest
    with pytest.raises(ImageError) as exc:
        vm.prepare(messages, ImageAccess())  # this worker allows no folder
    assert exc.value.code == "image_path_not_allowed"


def test_text_in_the_prompt_cannot_fake_an_image(vm: VisionModel) -> None:
    with pytest.raises(ImageError) as exc:
        vm.build_prompt(user("look: <|image_pad|>"), [picture(60, 60, 1)])
    assert exc.value.code == "invalid_image"


# ---- the feature cache --------------------------------------------------------------------------------


def test_feature_cache_encodes_each_image_once(vm: VisionModel) -> None:
    vm.features = FeatureCache()
    a, b = picture(100, 70, 0), picture(60, 60, 1)
    for _ in range(3):
        vm.image_features(a)
        vm.image_features(b)
    assert (vm.features.stats.encoder_calls, vm.features.stats.hits) == (2, 4)
    again = vm.image_features(a).features
    assert mx.array_equal(again, vm.encode(a).features)


def test_feature_cache_is_bounded_in_bytes(vm: VisionModel) -> None:
    a, b, c = picture(100, 70, 0), picture(100, 70, 1), picture(100, 70, 2)
    one = vm.encode(a).nbytes
    vm.features = FeatureCache(max_bytes=2 * one)
    for p in (a, b, c):
        vm.image_features(p)
    assert len(vm.features) == 2 and vm.features.nbytes <= 2 * one
    assert a.digest not in vm.features and vm.features.stats.evictions == 1
    vm.features = FeatureCache(max_bytes=0)  # off: every request encodes
    vm.image_features(a)
    vm.image_features(a)
    assert vm.features.stats.encoder_calls == 2 and len(vm.features) == 0
    vm.features = FeatureCache()


# ---- equivalence with mlx-vlm ------------------------------------------------------------------------


def test_batched_decode_equals_single_request_mlx_vlm(vm: VisionModel) -> None:
    rows = [
        (user("Name three primary colors.", n_images=0), []),  # a text row first: its caches set the merge
        (user("Describe this image."), [picture(100, 70, 0)]),
        (user("What color is the square in the picture? Answer briefly, in one word please."), [picture(60, 60, 1)]),
        (user("How many?", before=False), [picture(120, 112, 2)]),
        (user("Which one is brighter, and why?", n_images=2), [picture(84, 56, 3), picture(56, 84, 0)]),
    ]
    prompts = [vm.build_prompt(m, p) for m, p in rows]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts of different lengths: rows are left-padded"
    deltas = [prefill(vm, p).rope_delta for p in prompts[1:]]
    assert all(d < 0 for d in deltas), "mRoPE: positions after an image run behind the token index"
    expected = [reference(vm, m, p) for m, p in rows]
    assert batched(vm, rows) == expected


def test_positions_matter(vm: VisionModel) -> None:
    """Without the per-request delta, decoding goes wrong: the equivalence above can fail."""
    messages, pics = user("Describe this image in detail, please."), [picture(120, 112, 2)]
    prompt = vm.build_prompt(messages, pics)
    pf = prefill(vm, prompt)
    right = _decode_alone(vm, pf.caches, pf.logits)
    wrong = _decode_alone(vm, positioned(pf.caches, ()), pf.logits)
    assert right == reference(vm, messages, pics)
    assert wrong != right


def _decode_alone(vm: VisionModel, caches: list[Any], logits: Any) -> list[int]:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(vm.decode_model(), stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
    first = int(mx.argmax(logits).item())
    (uid,) = gen.insert([[first]], [N_TOKENS - 1], caches=[caches])
    out = [first]
    while len(out) < N_TOKENS:
        _, responses = gen.next()
        out += [r.token for r in responses if r.uid == uid]
    gen.close()
    return out


def test_different_images_same_text_give_different_logits(vm: VisionModel) -> None:
    a, b = picture(100, 70, 0), picture(100, 70, 2)
    la = prefill(vm, vm.build_prompt(user("What is this?"), [a])).logits
    lb = prefill(vm, vm.build_prompt(user("What is this?"), [b])).logits
    la2 = prefill(vm, vm.build_prompt(user("What is this?"), [a])).logits
    assert mx.allclose(la, la2).item()
    assert mx.abs(la - lb).max().item() > 1e-2


def test_prefill_continues_from_a_cached_prefix(vm: VisionModel) -> None:
    """Text before the first image from the text path, the rest from embeddings: same logits as in one go."""
    from mlx_lm.models.cache import make_prompt_cache

    pics = [picture(100, 70, 0), picture(60, 60, 1)]
    prompt = vm.build_prompt(user("Here are two pictures. Compare them.", n_images=2, before=False), pics)
    whole = prefill(vm, prompt)
    # the text prefix, computed by the decode model as a text warm-up would
    dec = vm.decode_model()
    cut = prompt.first_image
    caches = make_prompt_cache(dec)
    dec(mx.array([prompt.tokens[:cut]]), cache=caches)
    rest = prefill(vm, prompt, caches=caches, start=cut)
    assert rest.computed == len(prompt) - cut and rest.rope_delta == whole.rope_delta
    assert mx.allclose(rest.logits, whole.logits, atol=1e-4).item()
    # a prefix that ends after the first image: that image is not encoded again
    vm.features = FeatureCache()
    mid = prompt.spans[0].end + 1
    head = prefill(vm, _truncated(prompt, mid))
    vm.features = FeatureCache()
    tail = prefill(vm, prompt, caches=[_plain(c) for c in head.caches], start=mid)
    assert vm.features.stats.encoder_calls == 1  # only the second image
    assert mx.allclose(tail.logits, whole.logits, atol=1e-4).item()


def _truncated(prompt: Any, n: int) -> Any:
    from omlx_jobs.worker.vision.prompt import VisionPrompt

    spans = tuple(s for s in prompt.spans if s.end <= n)
    return VisionPrompt(prompt.tokens[:n], spans, {"images": prompt.extra["images"][: len(spans)]})


def _plain(c: Any) -> Any:
    from mlx_lm.models.cache import KVCache

    k = KVCache()
    k.keys, k.values, k.offset = c.keys, c.values, c.offset
    return k


def test_prefill_in_chunks_equals_one_pass(vm: VisionModel) -> None:
    prompt = vm.build_prompt(user("Describe this image."), [picture(120, 112, 2)])
    one = prefill(vm, prompt)
    chunked = prefill(vm, prompt, step=7)  # chunk borders inside the image
    assert mx.allclose(one.logits, chunked.logits, atol=1e-4).item()


# ---- checking the claim about mlx-vlm's own batch path ---------------------------------------


def test_mlx_vlm_batch_generator_positions_match_single_requests(vm: VisionModel) -> None:
    """mlx-vlm 0.7.10's BatchGenerator: left-padded rows of different lengths and image sizes decode exactly as
    single requests (the issue suspected a one-position shift for qwen2_vl; it does not reproduce)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    ar = importlib.import_module("mlx_vlm.generate.ar")
    questions = ["Describe this image.", "What color is the square? Answer in one word, briefly.", "How many?"]
    pics = [picture(100, 70, 0), picture(60, 60, 1), picture(120, 112, 2)]
    texts = [apply_chat_template(vm.processor, vm.model.config, q, num_images=1) for q in questions]
    expected = [generate_text(vm, text, [p]) for text, p in zip(texts, pics, strict=True)]
    gen = ar.BatchGenerator(vm.model.language_model, vm.processor, prefill_batch_size=8, completion_batch_size=8)
    uids = []
    for text, p in zip(texts, pics, strict=True):
        inp = vm.processor(text=[text], images=[p.pixels], return_tensors="mlx")
        emb = vm.model.get_input_embeddings(inp["input_ids"], inp["pixel_values"], image_grid_thw=inp["image_grid_thw"])
        kw = {"image_grid_thw": inp["image_grid_thw"], **{k: v for k, v in emb.to_dict().items() if v is not None}}
        uids += gen.insert(mx.array(inp["input_ids"]).tolist(), N_TOKENS, prompt_kwargs=[kw])
    got: dict[int, list[int]] = {u: [] for u in uids}
    while gen.has_work:
        for r in gen.next()[1]:
            if r.finish_reason != "stop":
                got[r.uid].append(r.token)
    gen.close()
    assert [got[u] for u in uids] == expected


def test_prefill_rows_in_one_batch_equal_one_at_a_time(vm: VisionModel) -> None:
    """Rows of different lengths right-padded in one batch, from no base and from a shared text prefix: the
    same logits, caches and RoPE breaks as prefill() row by row."""
    from mlx_lm.models.cache import make_prompt_cache

    from omlx_jobs.worker.vision.prefill import prefill_rows

    rows = [
        vm.build_prompt(user("Describe this image."), [picture(100, 70, 0)]),
        vm.build_prompt(user("What color is it? One word.", n_images=2), [picture(60, 60, 1), picture(84, 56, 3)]),
        vm.build_prompt(user("How many?", before=False), [picture(120, 112, 2)]),
    ]
    ends = [len(p) - 2 for p in rows]
    alone = [prefill(vm, p, end=e, want={3}) for p, e in zip(rows, ends, strict=True)]
    together = prefill_rows(vm, rows, [None, None, None], ends, [{3}, {3}, {3}])
    for a, b in zip(alone, together, strict=True):
        assert mx.allclose(a.logits, b.logits, atol=1e-4).item() and mx.allclose(a.picked[3], b.picked[3], atol=1e-4)
        assert a.caches[0].breaks == b.caches[0].breaks and a.caches[1].offset == b.caches[1].offset
        n = a.caches[1].offset
        assert mx.allclose(a.caches[1].keys[..., :n, :], b.caches[1].keys[..., :n, :], atol=1e-4).item()
    # on text prefixes of one length (each row's own first tokens), computed by the decode model
    cut = min(p.first_image for p in rows)
    dec = vm.decode_model()
    views = []
    for p in rows:
        base = make_prompt_cache(dec)
        dec(mx.array([p.tokens[:cut]]), cache=base)
        views.append([_plain(c) for c in base])
    together = prefill_rows(vm, rows, views, ends, [set(), set(), set()])
    for a, b in zip(alone, together, strict=True):
        assert mx.allclose(a.logits, b.logits, atol=1e-4).item() and b.computed == a.computed - cut
