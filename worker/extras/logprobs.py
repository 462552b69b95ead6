"""Logprobs in the worker: collected per decode step from logprob vectors, and turned into their stored form.

The engine hands over, per choice, a list of TokenLogprob (token id, logprob, the top alternatives). The store
keeps them in jobs/stored_logprobs.py's form: token pieces instead of ids, so results render without a tokenizer
(jobs/logprobs.py renders them in OpenAI's formats); `stored_entries` writes a choice's entries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs.jobs.stored_logprobs import Entry, Piece, StoredLogprobs, StoredToken, encode

# What OpenAI returns for a probability that rounds to zero; JSON has no -Infinity.
FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token: its id, its logprob (None for a prompt's first token: nothing precedes it) and the most
    likely tokens at its position, (id, logprob), most likely first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def step_logprobs(vectors: Sequence[mx.array], tokens: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprob]:
    """The chosen token's logprob and the top alternatives for several rows, in one evaluation.

    `vectors[i]` is row i's (V,) logprobs (a log-softmax of the logits it sampled from), `tokens[i]` the token
    it chose, `top_n[i]` how many alternatives it wants. Ties are broken by token id, so the result does not
    depend on how the batch was laid out.
    """
    if not vectors:
        return []
    stacked = mx.stack([v.reshape(-1) for v in vectors]).astype(mx.float32)
    chosen = mx.take_along_axis(stacked, mx.array(tokens, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    # A few extra candidates, so ties at the cut are settled by id rather than by argpartition's order.
    k = min(max(top_n, default=0) + 4, stacked.shape[-1]) if max(top_n, default=0) else 0
    if k:
        idx = mx.argpartition(-stacked, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(stacked, idx, axis=-1)
        mx.eval(chosen, idx, vals)
        top_ids, top_vals = idx.tolist(), vals.tolist()
    else:
        mx.eval(chosen)
        top_ids = top_vals = [[] for _ in tokens]
    out = []
    for i, (t, lp) in enumerate(zip(tokens, chosen.tolist(), strict=True)):
        pairs = sorted(zip(top_ids[i], top_vals[i], strict=True), key=lambda p: (-p[1], p[0]))[: top_n[i]]
        out.append(TokenLogprob(int(t), lp, tuple((int(a), b) for a, b in pairs)))
    return out


class TokenPieces:
    """Each token id's bytes, turned into stored pieces; built once per model."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._pieces: list[Piece] = [_piece(b) for b in token_bytes]

    @classmethod
    def from_grammar_tokenizer(cls, tokenizer: Any) -> TokenPieces:
        """From a worker.grammar.GrammarTokenizer (llguidance knows every token's exact bytes)."""
        ll = tokenizer.ll
        return cls([ll.decode_bytes([i]) for i in range(tokenizer.vocab_size)])

    def __getitem__(self, token: int) -> Piece:
        return self._pieces[token] if 0 <= token < len(self._pieces) else ""


def _piece(raw: bytes) -> Piece:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _number(x: float | None) -> float | None:
    """A float32 logprob as the shortest decimal that reads back as the same float32."""
    if x is None:
        return None
    if not math.isfinite(x):
        return FLOOR
    return max(float(str(np.float32(x))), FLOOR)


def stored_token(t: TokenLogprob, pieces: TokenPieces, with_top: bool) -> StoredToken:
    """A token in the stored form: its piece, its logprob rounded as float32, and its alternatives if asked for
    (none for a prompt's first token)."""
    top = None if not with_top or t.logprob is None else tuple((pieces[a], _number(b)) for a, b in t.top)
    return StoredToken(pieces[t.token], _number(t.logprob), top)  # type: ignore[arg-type]


def stored_entries(tokens: Sequence[TokenLogprob], pieces: TokenPieces, *, top_logprobs: int) -> list[Entry]:
    """One choice's (or an echoed prompt's) entries; alternatives when top_logprobs > 0 (chat's top_logprobs,
    completions' logprobs)."""
    with_top = top_logprobs > 0
    return encode([stored_token(t, pieces, with_top) for t in tokens], with_top=with_top)


def stored_logprobs(
    choices: Sequence[Sequence[TokenLogprob]],
    pieces: TokenPieces,
    *,
    top_logprobs: int,
    prompt: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """The JSON a request's result keeps (jobs/stored_logprobs.py): one entry list per choice, the prompt's with
    echo."""
    entries = [stored_entries(c, pieces, top_logprobs=top_logprobs) for c in choices]
    echoed = stored_entries(prompt, pieces, top_logprobs=top_logprobs) if prompt is not None else None
    return StoredLogprobs(entries, echoed).to_json()
