"""Benchmark: images in prompts. 64 questions over 8 images (8 per image), greedy, EOS ignored.

Side by side in one process, on the same loaded model (each variant gets an unmeasured warm-up pass, then the
variants run interleaved, --runs times; medians are reported):

  ours, cache on      image features from the feature cache (8 encoder calls), every prompt prefilled from
                      its embeddings (worker/vision_prefill.py), decoded in mlx-lm's BatchGenerator
  ours, cache off     the same with the feature cache off (64 encoder calls)
  ours, prefix reuse  cache on, and each image's shared prefix (system prompt + image) prefilled once and
                      viewed by its 8 questions: what the engine's planner will do with image key units
  mlx-vlm batch       mlx-vlm's BatchGenerator (what mlx_vlm.batch_generate runs), same prompts and pixels
  mlx-vlm loop        mlx_vlm.generate, one request at a time (also the reference for the token check)

Printed: wall time per variant, ratios to "ours, cache on", vision-encoder calls, and how many of the 64
greedy outputs equal the mlx-vlm loop's token for token. Not yet here (phase 2): the engine-integrated run
(`omlx-jobs run` on an image job), with the planner, warm-ups and batched embeddings prefill.

    .venv/bin/python bench/vision.py --quick                              # tiny fixture, CPU, seconds
    .venv/bin/python bench/vision.py                                      # tiny fixture, the 64 x 8 job
    python3 bench/vision.py --model random:qwen2-vl-7b --dtype bfloat16   # a GPU: Qwen2-VL-7B's shape
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


@dataclass
class Outcome:
    seconds: float
    tokens: list[list[int]]
    encoder_calls: int = 0
    prefill_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def load_model(spec: str, dtype: str | None, side: int) -> Any:
    from omlx_jobs.worker.vision import VisionModel
    from tests import tiny_vlm

    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    if spec == "tiny":
        pixels = side * side  # images are not resized: the figure is about the side asked for
        return VisionModel.load(
            tiny_vlm.build_tiny_vlm(root / "tiny", context_length=8192, min_pixels=pixels, max_pixels=pixels)
        )
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
    return VisionModel.load(spec)


def make_job(side: int, max_tokens: int, n_images: int = 8, per_image: int = 8) -> Job:
    from PIL import Image

    from omlx_jobs.worker import images

    pics = []
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
    messages, imgs = [], []
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
    return Job(messages, imgs, max_tokens)


# ---- our path --------------------------------------------------------------------------------------


def run_ours(vm: Any, job: Job, batch: int, cache_on: bool, prefix_reuse: bool) -> Outcome:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from omlx_jobs.worker import kv
    from omlx_jobs.worker.vision_cache import FeatureCache
    from omlx_jobs.worker.vision_prefill import prefill

    vm.features = FeatureCache() if cache_on else FeatureCache(max_bytes=0)
    started = time.perf_counter()
    prompts = [vm.build_prompt(m, [im]) for m, im in zip(job.messages, job.images, strict=True)]
    prefixes: dict[tuple[int, ...], Any] = {}
    computed = 0
    gen = BatchGenerator(vm.decode_model(), stop_tokens=[], completion_batch_size=batch, prefill_batch_size=batch)
    out: dict[int, list[int]] = {}
    order: list[int] = []
    for prompt in prompts:
        caches, start = None, 0
        if prefix_reuse:
            # The shared prefix of the requests about one image: up to the end of its image tokens (+ the
            # template's closing tokens are per question), keyed by key units, so two images never share it.
            cut = prompt.spans[0].end
            key = tuple(prompt.key_units()[:cut])
            if key not in prefixes:
                head = _head(prompt, cut)
                prefixes[key] = prefill(vm, head).caches
                computed += cut
            caches, start = kv.view(prefixes[key], cut, cut), cut
        pf = prefill(vm, prompt, caches=caches, start=start)
        computed += pf.computed
        first = int(mx.argmax(pf.logits).item())
        (uid,) = gen.insert([[first]], [job.max_tokens - 1], caches=[pf.caches], all_tokens=[list(prompt.tokens)])
        out[uid] = [first]
        order.append(uid)
    while any(len(v) < job.max_tokens for v in out.values()):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    seconds = time.perf_counter() - started
    return Outcome(seconds, [out[u] for u in order], vm.features.stats.encoder_calls, computed)


def _head(prompt: Any, cut: int) -> Any:
    from omlx_jobs.worker.vision_prompt import VisionPrompt

    spans = tuple(s for s in prompt.spans if s.end <= cut)
    return VisionPrompt(prompt.tokens[:cut], spans, {"images": prompt.extra["images"][: len(spans)]})


# ---- mlx-vlm's own paths ----------------------------------------------------------------------------


def _text(vm: Any, messages: list[dict[str, Any]]) -> str:
    from omlx_jobs.worker.vision import _template_messages

    return vm.processor.apply_chat_template(_template_messages(messages)[0], add_generation_prompt=True, tokenize=False)


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
        inp = vm.processor(text=[_text(vm, messages)], images=[im.pixels], return_tensors="mlx")
        emb = vm.model.get_input_embeddings(inp["input_ids"], inp["pixel_values"], image_grid_thw=inp["image_grid_thw"])
        kw = {"image_grid_thw": inp["image_grid_thw"], **{k: v for k, v in emb.to_dict().items() if v is not None}}
        uids += gen.insert(mx.array(inp["input_ids"]).tolist(), job.max_tokens, prompt_kwargs=[kw])
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
    ap.add_argument("--model", default="tiny", help="tiny | random:qwen2-vl-7b | random:qwen2-vl-mini | a model dir")
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
    variants: dict[str, Callable[[], Outcome]] = {
        "ours, cache on": lambda: run_ours(vm, job, args.batch_size, cache_on=True, prefix_reuse=False),
        "ours, cache off": lambda: run_ours(vm, job, args.batch_size, cache_on=False, prefix_reuse=False),
        "ours, prefix reuse": lambda: run_ours(vm, job, args.batch_size, cache_on=True, prefix_reuse=True),
        "mlx-vlm batch": lambda: run_mlx_vlm_batch(vm, job, args.batch_size),
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
    base = statistics.median(o.seconds for o in results["ours, cache on"]) if "ours, cache on" in results else None
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
                "vs_ours_cache_on": round(secs / base, 2) if base else None,
                "encoder_calls": last.encoder_calls,
                "prefill_tokens": last.prefill_tokens or None,
                "tokens_equal_to_mlx_vlm_loop": None if same is None else f"{same}/{len(job.messages)}",
            }
        )
    width = max(len(r["variant"]) for r in rows)
    for r in rows:
        print(
            f"{r['variant']:<{width}}  {r['seconds']:8.3f} s  x{r['vs_ours_cache_on']}  encoder calls "
            f"{r['encoder_calls']:>3}  prefill tokens {r['prefill_tokens'] or '-':>6}  same tokens as the "
            f"mlx-vlm loop: {r['tokens_equal_to_mlx_vlm_loop'] or '-'}"
        )
    on, off = results.get("ours, cache on"), results.get("ours, cache off")
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
