"""Benchmark: images in prompts. 64 questions over 8 images (8 per image), greedy, EOS ignored.

Side by side in one process, on the same loaded model (each variant gets an unmeasured warm-up pass, then the
variants run interleaved, --runs times; medians are reported):

  engine                      the real engine (worker/engine.py, as `omlx-jobs run` drives it): prompts built
                              from data: URIs, the planner warms up each image's shared prefix (system prompt +
                              image) once, questions batched; prefix cache and feature cache on
  engine, no prefix cache     the same with the prefix cache off: every prompt's image positions computed for it
                              (from embeddings), features from the feature cache (8 encoder calls)
  engine, no prefix/features  prefix cache and feature cache off (64 encoder calls)
  mlx-vlm batch               mlx-vlm's BatchGenerator (what mlx_vlm.batch_generate runs), same prompts and pixels
  mlx-vlm loop                mlx_vlm.generate, one request at a time (also the reference for the token check)

Printed: wall time per variant, ratios to "engine", vision-encoder calls, prompt tokens computed, and how many of
the 64 greedy outputs equal the mlx-vlm loop's token for token.

    .venv/bin/python bench/engine/vision.py --quick                              # tiny fixture, CPU, seconds
    .venv/bin/python bench/engine/vision.py                                      # tiny fixture, the 64 x 8 job
    python3 bench/engine/vision.py --model random:qwen2-vl-7b --dtype bfloat16   # a GPU: Qwen2-VL-7B's shape
    .venv/bin/python bench/engine/vision.py --model random:qwen2-vl-mini --quick # that code path, small, on a CPU
    .venv/bin/python bench/engine/vision.py --model tiny:gemma3 --quick          # Gemma 3 tiny fixture (or tiny:llava)
    python3 bench/engine/vision.py --model random:gemma3-4b --dtype bfloat16     # a GPU: Gemma-3-4B's shape
    .venv/bin/python bench/engine/vision.py --model random:gemma3-mini --quick   # that code path, small, on a CPU
    .venv/bin/python bench/engine/vision.py --model tiny:mistral3 --quick        # or tiny:pixtral, tiny:llava_next
    python3 bench/engine/vision.py --model random:mistral3-24b --dtype bfloat16  # a GPU: Mistral-Small-3.1-24B
    python3 bench/engine/vision.py --model random:ministral3-8b --dtype bfloat16 # a GPU: Ministral-3-8B's shape
    .venv/bin/python bench/engine/vision.py --model random:mistral3-mini --quick # that code path, small, on a CPU
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import omlx_jobs.worker  # noqa: F401  (fast BLAS before mlx)

# Qwen2-VL-7B-Instruct's shape (text and vision tower), with random weights.
QWEN2_VL_7B: dict[str, Any] = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vision_dim": 1280,
    "vision_depth": 32,
    "vision_heads": 16,
    "vision_mlp_ratio": 4,
}
RANDOM_SHAPES = {
    "qwen2-vl-7b": QWEN2_VL_7B,
    # the same code path at a size a CPU runs in seconds (to check the GPU command before using GPU time)
    "qwen2-vl-mini": {
        **QWEN2_VL_7B,
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vision_dim": 256,
        "vision_depth": 4,
        "vision_heads": 4,
    },
}
_GEMMA3_4B = {
    "text": {
        "hidden_size": 2560,
        "num_hidden_layers": 34,
        "intermediate_size": 10240,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "mm_tokens_per_image": 256,
    },
    "vision": {"num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16},
    "image_size": 896,
    "model_vocab": 262208,
}
GEMMA3_SHAPES = {
    "gemma3-4b": _GEMMA3_4B,  # Gemma-3-4B-it's shape
    "gemma3-mini": {  # the same code path, CPU-sized: 64 image tokens per picture, 6 layers (1 global)
        "text": {
            **_GEMMA3_4B["text"],
            "hidden_size": 256,
            "num_hidden_layers": 6,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 64,
            "mm_tokens_per_image": 64,
        },
        "vision": {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2},
        "image_size": 224,
        "model_vocab": 4096,
    },
}
_PIXTRAL_TOWER = {  # Mistral Small 3.1's and Ministral 3's vision tower: 24 x 1024, 14-pixel patches, 2-D RoPE
    "num_hidden_layers": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "head_dim": 64,
}
_MISTRAL_TEXT = {"num_key_value_heads": 8, "head_dim": 128, "num_attention_heads": 32, "rms_norm_eps": 1e-5}
MISTRAL3_SHAPES = {  # tests/vision_fixtures_mistral.mistral3_files' shapes; images are not resized below 1540
    "mistral3-24b": {  # Mistral-Small-3.1-24B-Instruct's shape: a Mistral (Llama-like) text model
        "text_type": "mistral",
        "text": {
            **_MISTRAL_TEXT,
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "intermediate_size": 32768,
            "rope_theta": 1e9,
            "max_position_embeddings": 131072,
        },
        "vision": _PIXTRAL_TOWER,
        "edge": 1540,
        "patch": 14,
        "model_vocab": 131072,
    },
    "ministral3-8b": {  # Ministral-3-8B-Instruct's shape: Llama 4 attention scaling, YaRN
        "text_type": "ministral3",
        "text": {
            **_MISTRAL_TEXT,
            "hidden_size": 4096,
            "num_hidden_layers": 34,
            "intermediate_size": 14336,
            "max_position_embeddings": 262144,
        },
        "rope": {"rope_theta": 1e9, "factor": 16.0, "original_max_position_embeddings": 16384},
        "vision": _PIXTRAL_TOWER,
        "edge": 1540,
        "patch": 14,
        "model_vocab": 131072,
    },
    "mistral3-mini": {  # the same code path as ministral3-8b, CPU-sized: 4 layers, 2 tower layers
        "text_type": "ministral3",
        "text": {
            **_MISTRAL_TEXT,
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 8192,
        },
        "rope": {"original_max_position_embeddings": 64},
        "vision": {
            **_PIXTRAL_TOWER,
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_attention_heads": 2,
        },
        "edge": 448,
        "patch": 14,
        "model_vocab": 4096,
    },
}
SYSTEM = "You are a careful visual assistant. Look at the picture and answer the question in a few words."
QUESTIONS = [
    "What is in this picture?",
    "What colors do you see?",
    "How many objects are there?",
    "Is there any text in the image? If so, read it out exactly as written.",
    "Describe the picture in one sentence.",
    "Which part of the image is the brightest?",
    "Is this a photo or a drawing?",
    "What would you title this picture, if it hung in a museum next to other pictures like it?",
]


@dataclass
class Job:
    messages: list[list[dict[str, Any]]]
    images: list[Any]  # DecodedImage per request (8 distinct, each used by 8 requests)
    max_tokens: int
    pngs: list[bytes] = field(default_factory=list)  # the encoded image per request (data: URIs for the engine)


@dataclass
class Outcome:
    seconds: float
    tokens: list[list[int]]
    encoder_calls: int = 0
    prefill_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def load_model(spec: str, dtype: str | None, side: int) -> Any:
    from omlx_jobs.worker.vision.model import VisionModel
    from tests import tiny_vlm

    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    if spec == "tiny":
        pixels = side * side  # images are not resized: the figure is about the side asked for
        return VisionModel.load(
            tiny_vlm.build_tiny_vlm(root / "tiny", context_length=8192, min_pixels=pixels, max_pixels=pixels)
        )
    if spec.startswith("random:gemma3"):
        return random_gemma3(root, spec.split(":", 1)[1], dtype)
    if spec.split(":", 1)[-1] in MISTRAL3_SHAPES:
        return random_mistral3(root, spec.split(":", 1)[1], dtype)
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        config = tiny_vlm.write_vlm_files(
            root / name,
            model_vocab=152064,
            context_length=32768,
            shape=RANDOM_SHAPES[name],
            min_pixels=side * side,
            max_pixels=side * side,  # 448: 32 x 32 patches, 256 image tokens per picture
        )
        model = tiny_vlm.random_vlm(config, attention_scale=1.0, dtype=dtype or "bfloat16")
        return VisionModel.with_weights(root / name, model)
    if spec.startswith("tiny:"):  # another family's tiny fixture (tests/vision_fixtures*.py)
        from tests import vision_fixtures, vision_fixtures_mistral

        family = spec.split(":", 1)[1]
        builders = {**vision_fixtures.BUILDERS, **vision_fixtures_mistral.BUILDERS}
        return VisionModel.load(builders[family](root / family))
    return VisionModel.load(spec)


def random_gemma3(root: Path, name: str, dtype: str | None) -> Any:
    """Gemma 3 of GEMMA3_SHAPES[name] with random weights (bfloat16 unless told), the tokenizer padded to its
    vocabulary, the processor's files written offline."""
    from omlx_jobs.worker.vision.model import VisionModel
    from tests import vision_fixtures

    path, config, _, _ = vision_fixtures.gemma3_files(root / name, shape=GEMMA3_SHAPES[name])
    model = vision_fixtures.random_model(config, dtype=dtype or "bfloat16")
    return VisionModel.with_weights(path, model)


def random_mistral3(root: Path, name: str, dtype: str | None) -> Any:
    """Mistral 3 of MISTRAL3_SHAPES[name] with random weights (bfloat16 unless told), as random_gemma3."""
    from omlx_jobs.worker.vision.model import VisionModel
    from tests import vision_fixtures, vision_fixtures_mistral

    path, config, _, _ = vision_fixtures_mistral.mistral3_files(root / name, shape=MISTRAL3_SHAPES[name])
    model = vision_fixtures.random_model(config, dtype=dtype or "bfloat16")
    return VisionModel.with_weights(path, model)


def make_job(side: int, max_tokens: int, n_images: int = 8, per_image: int = 8) -> Job:
    from PIL import Image

    from omlx_jobs.worker.vision.inputs import images

    pics, pngs = [], []
    for k in range(n_images):
        img = Image.new("RGB", (side, side))
        img.putdata(
            [
                ((x * (k + 3) + y * k) % 256, (y * (k + 5)) % 256, (x ^ y) * (k + 1) % 256)
                for y in range(side)
                for x in range(side)
            ]
        )
        buf = io.BytesIO()
        img.save(buf, "PNG")
        pics.append(images.decode(buf.getvalue()))
        pngs.append(buf.getvalue())
    messages, imgs, encoded = [], [], []
    for k in range(n_images):
        for q in QUESTIONS[:per_image]:
            part = {"type": "image_url", "image_url": {"url": f"image-{k}", "detail": "auto"}}
            messages.append(
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": [part, {"type": "text", "text": q}]},
                ]
            )
            imgs.append(pics[k])
            encoded.append(pngs[k])
    return Job(messages, imgs, max_tokens, encoded)


# ---- our path --------------------------------------------------------------------------------------


def run_engine(loaded: Any, job: Job, batch: int, prefix_cache: bool, features: bool) -> Outcome:
    """The job through the real engine, from request bodies (data: URIs) to results, as a shard runs it."""
    import base64

    from omlx_jobs.jobs.formats import CHAT_URL, SamplingParams
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.engine.sequence import WorkItem
    from omlx_jobs.worker.vision.feature_cache import FeatureCache
    from omlx_jobs.worker.vision.inputs.media import ImageMemo

    vm = loaded.vision
    vm.features = FeatureCache() if features else FeatureCache(max_bytes=0)
    loaded.memo = ImageMemo()  # nothing remembered from the last run: each image is decoded here once
    config = EngineConfig(completion_batch_size=batch, prefill_batch_size=8, prefix_cache=prefix_cache, ignore_eos=True)
    engine = Engine(loaded, config)  # a new one each run: nothing cached from the last
    started = time.perf_counter()
    items = []
    for i, (messages, data) in enumerate(zip(job.messages, job.pngs, strict=True)):
        uri = "data:image/png;base64," + base64.b64encode(data).decode()
        body = {"messages": _with_url(messages, uri), "max_tokens": job.max_tokens, "temperature": 0}
        prompt = loaded.prompt(CHAT_URL, body)
        items.append(WorkItem(i, prompt.tokens, SamplingParams.from_body(body), prompt))
    results: dict[int, Any] = {}
    stats = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    seconds = time.perf_counter() - started
    tokens = [results[i].choices[0].token_ids for i in range(len(items))]
    cached = sum(r.cached_tokens for r in results.values())
    extra = {"warmups": stats.warmups, "cached_tokens": cached, "decode_s": round(stats.decode_seconds, 3)}
    return Outcome(seconds, tokens, vm.features.stats.encoder_calls, stats.prefill_tokens, extra)


def _with_url(messages: list[dict[str, Any]], url: str) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{**p, "image_url": {"url": url}} if p["type"] == "image_url" else p for p in content]
        out.append({**m, "content": content})
    return out


# ---- mlx-vlm's own paths ----------------------------------------------------------------------------


def _text(vm: Any, messages: list[dict[str, Any]]) -> str:
    from omlx_jobs.worker.vision.model import template_text

    return template_text(vm, messages)  # the processor's chat template, or the tokenizer's


def _no_eos(vm: Any) -> Any:
    """Stopping criteria with no EOS, installed on the tokenizer (generate resets it unless given one)."""
    from mlx_vlm.utils import StoppingCriteria

    class Never(StoppingCriteria):
        def __call__(self, token: Any) -> bool:
            return False

    tok = vm.processor.tokenizer
    tok.stopping_criteria = Never([], tok)
    return tok.stopping_criteria


def run_mlx_vlm_loop(vm: Any, job: Job) -> Outcome:
    from mlx_vlm import generate

    never = _no_eos(vm)
    started = time.perf_counter()
    tokens = []
    for messages, im in zip(job.messages, job.images, strict=True):
        text = _text(vm, messages)
        r = generate(
            vm.model,
            vm.processor,
            text,
            image=[im.pixels],
            max_tokens=job.max_tokens,
            verbose=False,
            stopping_criteria=never,
        )
        tokens.append(list(r.token_ids))
    return Outcome(time.perf_counter() - started, tokens, encoder_calls=len(job.messages))


def run_mlx_vlm_batch(vm: Any, job: Job, batch: int) -> Outcome:
    """mlx-vlm's BatchGenerator (what mlx_vlm.batch_generate runs) on the same prompt texts and pixels.

    As mlx-vlm does, each request's embeddings (vision tower included) are computed when it is inserted.
    """
    import importlib

    import mlx.core as mx

    _no_eos(vm)
    ar = importlib.import_module("mlx_vlm.generate.ar")
    started = time.perf_counter()
    gen = ar.BatchGenerator(
        vm.model.language_model, vm.processor, prefill_batch_size=batch, completion_batch_size=batch
    )
    uids = []
    for messages, im in zip(job.messages, job.images, strict=True):
        inp = dict(vm.processor(text=[_text(vm, messages)], images=[im.pixels], return_tensors="mlx"))
        ids, pixels, mask = inp.pop("input_ids"), inp.pop("pixel_values"), inp.pop("attention_mask", None)
        inp = {k: v for k, v in inp.items() if k != "token_type_ids"}  # Qwen2-VL: image_grid_thw
        emb = vm.model.get_input_embeddings(ids, pixels, mask=mask, **inp)
        kw = {**inp, **{k: v for k, v in emb.to_dict().items() if v is not None and k != "attention_mask_4d"}}
        uids += gen.insert(mx.array(ids).tolist(), job.max_tokens, prompt_kwargs=[kw])
    got: dict[int, list[int]] = {u: [] for u in uids}
    while gen.has_work:
        for r in gen.next()[1]:
            if r.finish_reason != "stop":
                got[r.uid].append(r.token)
    gen.close()
    return Outcome(time.perf_counter() - started, [got[u] for u in uids], encoder_calls=len(job.messages))


# ---- the run ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny | tiny:gemma3 | tiny:qwen3_vl | tiny:llava | tiny:llava_next | tiny:mistral3 | tiny:pixtral | "
        "random:qwen2-vl-7b | random:qwen2-vl-mini | random:gemma3-4b | random:gemma3-mini | random:mistral3-24b | "
        "random:ministral3-8b | random:mistral3-mini | a model dir",
    )
    ap.add_argument("--dtype", default=None, help="random models: bfloat16 (default) or float16/float32")
    ap.add_argument("--quick", action="store_true", help="16 questions over 4 images, 8 tokens")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--image-side", type=int, default=None, help="pixels per side, a multiple of 28 (448; 112 quick)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out, e.g. 'mlx-vlm loop'")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    import mlx.core as mx

    side = args.image_side or (112 if args.quick else 448)
    vm = load_model(args.model, args.dtype, side)
    n_images, per_image = (4, 4) if args.quick else (8, 8)
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    job = make_job(side, max_tokens, n_images, per_image)
    from omlx_jobs.worker.vision.loaded import loaded_vision

    loaded = loaded_vision(vm, args.model)
    b = args.batch_size
    variants: dict[str, Callable[[], Outcome]] = {
        "engine": lambda: run_engine(loaded, job, b, prefix_cache=True, features=True),
        "engine, no prefix cache": lambda: run_engine(loaded, job, b, prefix_cache=False, features=True),
        "engine, no prefix/features": lambda: run_engine(loaded, job, b, prefix_cache=False, features=False),
        "mlx-vlm batch": lambda: run_mlx_vlm_batch(vm, job, b),
        "mlx-vlm loop": lambda: run_mlx_vlm_loop(vm, job),
    }
    for name in filter(None, (s.strip() for s in args.skip.split(","))):
        variants.pop(name)
    print(
        f"model {args.model} ({vm.model_type}), {len(job.messages)} requests over {n_images} images of "
        f"{side}x{side} ({vm.image_tokens(job.images[0])} image tokens each), "
        f"{max_tokens} tokens out, batch {args.batch_size}; device {mx.default_device()}, "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for fn in variants.values():  # warm-up: kernels compiled, caches allocated; not measured
        fn()
    results: dict[str, list[Outcome]] = {name: [] for name in variants}
    for r in range(args.runs):
        names = list(variants)
        names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order between runs
        for name in names:
            results[name].append(variants[name]())
            mx.clear_cache()
    report(results, job, args, vm)


def report(results: dict[str, list[Outcome]], job: Job, args: argparse.Namespace, vm: Any) -> None:
    base = statistics.median(o.seconds for o in results["engine"]) if "engine" in results else None
    reference = results.get("mlx-vlm loop", [None])[0]
    rows = []
    for name, outs in results.items():
        secs = statistics.median(o.seconds for o in outs)
        last = outs[-1]
        same = None
        if reference is not None and last.tokens:
            same = sum(a == b for a, b in zip(last.tokens, reference.tokens, strict=True))
        rows.append(
            {
                "variant": name,
                "seconds": round(secs, 3),
                "runs_seconds": [round(o.seconds, 3) for o in outs],
                "vs_engine": round(secs / base, 2) if base else None,
                "encoder_calls": last.encoder_calls,
                "prefill_tokens": last.prefill_tokens or None,
                "tokens_equal_to_mlx_vlm_loop": None if same is None else f"{same}/{len(job.messages)}",
                **last.extra,
            }
        )
    width = max(len(r["variant"]) for r in rows)
    for r in rows:
        print(
            f"{r['variant']:<{width}}  {r['seconds']:8.3f} s  x{r['vs_engine']}  encoder calls "
            f"{r['encoder_calls']:>3}  prefill tokens {r['prefill_tokens'] or '-':>6}  same tokens as the "
            f"mlx-vlm loop: {r['tokens_equal_to_mlx_vlm_loop'] or '-'}"
        )
    on, off = results.get("engine, no prefix cache"), results.get("engine, no prefix/features")
    if on and off:
        saved = off[-1].encoder_calls - on[-1].encoder_calls
        ratio = statistics.median(o.seconds for o in off) / statistics.median(o.seconds for o in on)
        calls = off[-1].encoder_calls
        print(f"feature cache: {saved} of {calls} encoder calls saved; wall time cache off / on {ratio:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "machine": platform.platform(),
                    "load": os.getloadavg()[0],
                    "requests": len(job.messages),
                    "max_tokens": job.max_tokens,
                    "batch_size": args.batch_size,
                    "runs": args.runs,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
