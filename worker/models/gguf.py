"""Turn a llama-family GGUF file into an MLX model directory that `mlx_lm.load` accepts.

MLX reads GGUF tensors and metadata itself (`mx.load`); Q4_0, Q4_1 and Q8_0 come back in MLX's own affine
quantized layout (`.weight` packed, `.scales`, `.biases`, group size 32). On a GPU (Metal, CUDA) they stay
quantized; on the CPU backend they are dequantized to float32, because MLX's CPU quantized matmul is far
slower than OpenBLAS sgemm (see `convert_gguf`). The tokenizer is rebuilt from the GGUF vocabulary with the
`tokenizers` library.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

from omlx_jobs.store.db import data_dir
from omlx_jobs.worker.models.gguf_file import GGUFError, Metadata, read_tensor_types
from omlx_jobs.worker.models.gguf_tokenizer import build_tokenizer

# Bump when the output of convert_gguf changes, so cached conversions are redone.
CONVERTER_VERSION = 1
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# Types mx.load reads correctly (checked against llama.cpp's reference dequantization). It also reads
# Q2_K/Q4_K/Q6_K, but MLX 0.32's Q4_K decoder applies one sub-block's scale to both nibbles (wrong weights);
# other types fail inside MLX or, if MLX does not know them at all, are silently dropped.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")

# GGUF tensor base names -> mlx-lm module paths ({i} is the block index).
TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<block>\d+)\.)?(?P<base>\w+)\.(?P<kind>weight|bias|scales|biases)")


# ---- conversion ------------------------------------------------------------------------------------------


def default_dequantize() -> bool:
    """Dequantize on the CPU backend, keep quantized weights on a GPU.

    SmolLM2-135M Q4_1 on a 2-core x86 CPU (OpenBLAS), decode tok/s at batch 1 / 32: float32 8 / 53;
    MLX-quantized with float32 activations 6 / 4; MLX-quantized with float16 0.14 at batch 1.
    """
    return mx.default_device() == mx.cpu


def convert_gguf(gguf_path: Path, out_dir: Path, *, dequantize: bool | None = None) -> Path:
    """Convert a llama or qwen2 GGUF file into an mlx-lm model directory at `out_dir` (created, must be empty).

    Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with the chat template),
    then loads the result into the mlx-lm model class and raises GGUFError unless every GGUF tensor fills
    exactly one model parameter. `dequantize`: float32 weights (True) or Q4_0/Q4_1/Q8_0 kept in MLX's
    quantized format with float16 for the rest (False); None picks by backend (`default_dequantize`).
    """
    if dequantize is None:
        dequantize = default_dequantize()
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFError(f"{gguf_path}: no such file")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GGUFError(f"{out_dir} is not empty; choose a new directory")
    types = read_tensor_types(gguf_path)
    bad = {name: t for name, t in types.items() if t not in SUPPORTED_TENSOR_TYPES}
    if bad:
        listing = ", ".join(f"{n} ({t})" for n, t in sorted(bad.items())[:5])
        raise GGUFError(
            f"{gguf_path}: unsupported tensor type(s): {listing}. Supported: {', '.join(SUPPORTED_TENSOR_TYPES)} "
            "(K-quants such as Q4_K_M are not); use a Q4_0, Q4_1 or Q8_0 GGUF of the model, or convert the "
            "original model with mlx_lm.convert"
        )
    raw_weights, raw_meta = mx.load(str(gguf_path), return_metadata=True)
    for name in (n for n, t in types.items() if t == "BF16"):
        # MLX reads BF16 as float16, which overflows above 65504.
        if not mx.all(mx.isfinite(raw_weights[name])).item():
            raise GGUFError(f"{gguf_path}: {name} (BF16) has values beyond float16's range; use an F16/Q8_0 GGUF")
    meta = Metadata(raw_meta, gguf_path)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = model_config(meta, types, quantized=not dequantize)
    tokenizer, tokenizer_config = build_tokenizer(meta, context_length=config["max_position_embeddings"])
    weights, sources = rename_weights(raw_weights, config, gguf_path)
    weights = dequantize_weights(weights) if dequantize else _to_float16(weights)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(str(out_dir / "tokenizer.json"))
        text = json.dumps(tokenizer_config, indent=2, ensure_ascii=False)
        (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
        _check_loads_strictly(out_dir, sources, gguf_path)
    except BaseException:
        # Leave no half-written model behind: out_dir was empty (or absent) when we started.
        for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).unlink(missing_ok=True)
        if created:
            out_dir.rmdir()
        raise
    return out_dir


def model_config(meta: Metadata, types: dict[str, str], *, quantized: bool) -> dict[str, Any]:
    """An mlx-lm / Hugging Face style config.json from the GGUF hyperparameters."""
    arch = meta.require("general.architecture")
    hidden = meta.require_int(f"{arch}.embedding_length")
    heads = meta.require_int(f"{arch}.attention.head_count")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    kv_key = f"{arch}.attention.head_count_kv"
    if rope_dims != head_dim:
        raise GGUFError(f"{meta.source}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": meta.require_int(f"{arch}.block_count"),
        "intermediate_size": meta.require_int(f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.require_int(kv_key) if kv_key in meta.raw else heads,
        "head_dim": head_dim,
        "rms_norm_eps": _shortest(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.require_int(f"{arch}.context_length"),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))),
        "tie_word_embeddings": "output.weight" not in types,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in types
        config["mlp_bias"] = "blk.0.ffn_up.bias" in types
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(meta.require(f"{arch}.rope.scaling.factor"))}
    elif scaling != "none":
        raise GGUFError(f"{meta.source}: rope scaling {scaling!r} is not supported; supported: none, linear")
    packed = [t for t in types.values() if t in ("Q4_0", "Q4_1", "Q8_0")]
    if quantized and packed:
        # The default for mlx-lm's nn.quantize; each layer's own bits are inferred from its packed shape.
        bits = 8 if packed.count("Q8_0") > len(packed) / 2 else 4
        config["quantization"] = config["quantization_config"] = {"group_size": 32, "bits": bits}
    config["torch_dtype"] = "float16" if quantized else "float32"
    return config


def _shortest(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.999999747378752e-06; write the float32's shortest decimal.
    return float(str(np.float32(value)))


def rename_weights(
    raw: dict[str, mx.array], config: dict[str, Any], source: Path
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """GGUF tensors under mlx-lm names (Q/K rows un-permuted for llama); also mlx name -> GGUF name."""
    weights: dict[str, mx.array] = {}
    sources: dict[str, str] = {}
    for name, value in raw.items():
        m = _TENSOR_NAME.fullmatch(name)
        base = m and (BLOCK_NAMES.get(m["base"]) if m["block"] else TOP_LEVEL_NAMES.get(m["base"]))
        if not m or not base:
            hint = " (Llama 3.1 rope scaling is not supported)" if name.startswith("rope_freqs") else ""
            raise GGUFError(f"{source}: unexpected tensor {name!r} for a {config['model_type']} model{hint}")
        path = f"model.layers.{m['block']}.{base}" if m["block"] else base
        if config["model_type"] == "llama" and m["base"] in ("attn_q", "attn_k"):
            # llama.cpp permutes Q/K rows for its interleaved rope; mlx-lm's llama uses rotate-half.
            n = config["num_attention_heads"] if m["base"] == "attn_q" else config["num_key_value_heads"]
            value = _unpermute_rows(value, n)
        weights[f"{path}.{m['kind']}"] = value
        sources[f"{path}.{m['kind']}"] = name
    return weights, sources


def dequantize_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Every tensor as float32: packed MLX-quantized ones (`.weight` + `.scales` + `.biases`) unpacked."""
    out = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in weights:
            scales = weights[f"{base}.scales"]
            in_features = scales.shape[-1] * 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks hold 32 values
            bits = value.shape[-1] * 32 // in_features
            # float32 scales make dequantize compute in float32, as llama.cpp does.
            biases = weights[f"{base}.biases"].astype(mx.float32)
            value = mx.dequantize(value, scales.astype(mx.float32), biases, group_size=32, bits=bits)
        out[name] = value.astype(mx.float32)
    return out


def _to_float16(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    # One activation dtype: GGUF keeps norms in float32, which would promote every activation after them.
    return {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    # Inverse of convert_hf_to_gguf's permute: rows (head, dim/2, 2) -> (head, 2, dim/2). Packed quantized
    # rows, scales and biases all keep one row per output feature, so the same row order applies to each.
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _check_loads_strictly(out_dir: Path, sources: dict[str, str], gguf_path: Path) -> None:
    # Load as mlx_lm.load does, strictly (a missing, extra or misshapen tensor raises), and name the GGUF
    # tensor next to each parameter mlx-lm complains about.
    try:
        load_model(out_dir, lazy=True, strict=True)
    except ValueError as exc:
        message = re.sub(
            r"\b(?:model|lm_head)\.[\w.]*\w",
            lambda m: f"{m[0]} (GGUF {sources.get(m[0]) or _gguf_name(m[0])})",
            " ".join(str(exc).split()),
        )
        raise GGUFError(f"{gguf_path}: the tensors do not fit the model: {message}") from exc


def _gguf_name(mlx_name: str) -> str:
    m = re.fullmatch(r"(?:model\.layers\.(\d+)\.)?(.+)\.(\w+)", mlx_name)
    if not m:
        return mlx_name
    table = BLOCK_NAMES if m[1] is not None else TOP_LEVEL_NAMES
    base = next((g for g, p in table.items() if p == m[2]), m[2])
    return f"blk.{m[1]}.{base}.{m[3]}" if m[1] is not None else f"{base}.{m[3]}"


# ---- cache and the bundled demo model ---------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB chunks (GGUF files are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cached_conversion(gguf_path: Path, cache_root: Path | None = None, *, dequantize: bool | None = None) -> Path:
    """The converted directory for `gguf_path`, converting once per file content (sha256), converter version
    and weight format (`dequantize`, as for `convert_gguf`).

    Default cache root: `data_dir()/models` ($OMLX_JOBS_HOME/models or ~/.local/share/omlx-jobs/models).
    A conversion is written to a temporary directory and renamed into place, so concurrent workers never see
    a half-written model; if two convert at once, the first rename wins and the other's copy is discarded.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFError(f"{gguf_path}: no such file")
    root = Path(cache_root) if cache_root is not None else data_dir() / "models"
    if dequantize is None:
        dequantize = default_dequantize()
    fmt = "f32" if dequantize else "q"
    target = root / f"gguf-{file_sha256(gguf_path)[:32]}-v{CONVERTER_VERSION}-{fmt}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        convert_gguf(gguf_path, tmp, dequantize=dequantize)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared by several users' workers
        try:
            os.rename(tmp, target)  # atomic; fails if another process renamed its copy first
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
