"""The tokenizer of a GGUF file, rebuilt for `tokenizers`: byte-level BPE from its vocabulary and merges."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from omlx_jobs.worker.models.gguf_file import GGUFError, Metadata

SUPPORTED_TOKENIZERS = ("gpt2",)
# Pre-tokenizer split patterns, as in llama.cpp's llama-vocab.cpp and the models' own tokenizer.json.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "qwen2", "llama-bpe")


def build_tokenizer(meta: Metadata, *, context_length: int) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` (byte-level BPE from the GGUF vocabulary and merges) and tokenizer_config.json."""
    kind = meta.require("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise GGUFError(
            f"{meta.source}: tokenizer model {kind!r} is not supported; supported: {', '.join(SUPPORTED_TOKENIZERS)} "
            "(byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise GGUFError(
            f"{meta.source}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens):
        raise GGUFError(f"{meta.source}: the vocabulary has duplicate tokens or token types of another length")
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole in text, as llama.cpp does.
    pairs = zip(tokens, types, strict=True)
    tok.add_tokens([AddedToken(t, special=(ty == 3), normalized=False) for t, ty in pairs if ty in (3, 4)])

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": special("padding"),
        "unk_token": special("unknown"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if template := meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = template
    return tok, tok_config


def _pre_tokenizer(pre: str) -> Any:
    """The pre-tokenizer llama.cpp names `pre` (one of SUPPORTED_PRE_TOKENIZERS)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=pre != "qwen2")
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("qwen2", "llama-bpe"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), "isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    return byte_level
