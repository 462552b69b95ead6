"""Per-request logits processing with plain mx ops: grammar masks, logit_bias, and a tap for raw logprobs.

No kernels, so CPU, CUDA and Metal run the same code. Two shapes of the same work:
- per row, as mlx-lm's logits processors (`processor(tokens, logits) -> logits`, logits of shape (1, V)),
  which BatchGenerator calls one row at a time with the row's tokens so far;
- per batch, `BatchLogits.apply`: one call per decode step for every row (one mask fill, one mx op), for an
  engine step that sees the whole batch.
Logprobs are the model's own (a log-softmax of its logits before any processor), as `LogprobTap` keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.extras.grammar import Constraint, GrammarCache, GrammarTokenizer, fill_masks
from omlx_jobs.worker.prompts import PromptError

Processor = Callable[[mx.array, mx.array], mx.array]


def logits_width(model: Any) -> int:
    """How many logits the model returns per position (its vocabulary, padded), from a one-token forward."""
    return int(model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1])


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> mx.array:
    """(rows, vocab_size) booleans from an llguidance bitmask (bit t % 32 of word t // 32 allows token t).

    Unpacked on the host (numpy, about 0.3 ms at 32 x 49,152) and copied once: unpacking with mx ops (a shift,
    an and, a slice and a cast over rows x vocab x 32 words) cost about as much again as the masking itself.
    Words are little-endian (llguidance writes host-order int32; every MLX platform is little-endian).
    """
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return mx.array(bits[:, :vocab_size].view(np.bool_))


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Logits with every token the bitmask does not allow set to -inf."""
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarProcessor:
    """A BatchGenerator logits processor for one choice's grammar.

    The first call sees the prompt; each later call sees the tokens sampled since, which the grammar consumes
    before it fills the next mask.
    """

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self._bitmask = constraint.tokenizer.new_bitmask(1)
        self._seen: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.size
        if self._seen is not None and n > self._seen:
            self.constraint.consume(tokens[self._seen :].tolist())
        self._seen = n
        self.constraint.fill(self._bitmask, 0)
        return apply_bitmask(logits, self._bitmask)


def check_logit_bias(bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    """Raise PromptError (the request fails alone) for a token id past the model's vocabulary."""
    bad = [t for t, _ in bias if t >= vocab_size]
    if bad:
        raise PromptError(
            ErrorCode.INVALID_LOGIT_BIAS,
            f"logit_bias names token id {bad[0]}, outside the vocabulary (size {vocab_size})",
        )


class LogitBias:
    """A BatchGenerator logits processor adding OpenAI's logit_bias (token id -> bias) to the logits."""

    def __init__(self, bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
        check_logit_bias(bias, vocab_size)
        self._ids = mx.array([t for t, _ in bias], dtype=mx.int32)
        self._values = mx.array([b for _, b in bias], dtype=mx.float32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, self._ids].add(self._values.astype(logits.dtype))


class BatchablePart:
    """A row's logit_bias and grammar mask as one processor, marked `batchable`: called for one row (its first
    token, sampled as mlx-lm makes a batch) it biases and masks that row; a decode step that sees the whole batch
    (backend/decode.py) skips it and applies `row` for every row at once through BatchLogits instead. Its grammar
    consumes each token once either way: the row's first call sees the prompt, and each later token is consumed
    by the call (this one or BatchLogits) that masks the next."""

    batchable = True

    def __init__(self, row: RowLogits, vocab_size: int) -> None:
        self.row = row
        self._bias = LogitBias(row.bias, vocab_size) if row.bias else None
        self._grammar = GrammarProcessor(row.constraint) if row.constraint is not None else None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._bias is not None:
            logits = self._bias(tokens, logits)
        if self._grammar is not None:
            logits = self._grammar(tokens, logits)
        return logits


class LogprobTap:
    """First of a row's processors: keeps the model's own logprobs before later processors change them.

    Each vector is keyed by the number of tokens in the context it was computed for, which is the position
    (in prompt + output) of the token sampled from it. Unclaimed vectors older than a few steps are dropped.
    """

    KEEP = 4

    def __init__(self) -> None:
        self._by_position: dict[int, mx.array] = {}

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        position = tokens.size
        self._by_position[position] = log_softmax(logits)[0]
        for old in [p for p in self._by_position if p <= position - self.KEEP]:
            del self._by_position[old]
        return logits

    def take(self, position: int) -> mx.array | None:
        """The (V,) logprobs the token at `position` was sampled from, once; None if not recorded."""
        return self._by_position.pop(position, None)


@dataclass
class RowLogits:
    """One choice's logits path: the processors to hand BatchGenerator, in order, and their state."""

    processors: list[Processor] = field(default_factory=list)
    constraint: Constraint | None = None
    tap: LogprobTap | None = None
    bias: tuple[tuple[int, float], ...] = ()


def row_logits(
    out: OutputParams,
    *,
    grammars: GrammarCache | None,
    vocab_size: int,
    penalties: Sequence[Processor] = (),
    batched: bool = False,
) -> RowLogits:
    """The logits path of one choice: logit_bias, then `penalties` (repetition etc.), then the grammar.

    A LogprobTap comes first when logprobs are asked for and anything would change the logits, so returned
    logprobs are the model's own. With `batched`, bias and grammar are left to BatchLogits.apply (never both:
    a grammar must consume each token once) and the step takes raw logprobs before it, so there is no tap.
    Raises PromptError for a bias outside the vocabulary or a grammar that does not compile; `grammars` may be
    None only for requests without a response_format.
    """
    row = RowLogits(bias=out.logit_bias)
    if out.logit_bias:
        check_logit_bias(out.logit_bias, vocab_size)
        if not batched:
            row.processors.append(LogitBias(out.logit_bias, vocab_size))
    row.processors.extend(penalties)
    if out.response_format is not None:
        if grammars is None:
            raise ValueError("a response_format needs a GrammarCache")
        row.constraint = grammars.constraint(out.response_format)
        if not batched:
            row.processors.append(GrammarProcessor(row.constraint))
    if out.logprobs and row.processors and not batched:
        row.tap = LogprobTap()
        row.processors.insert(0, row.tap)
    return row


class BatchLogits:
    """Bias and mask every row of a decode batch in one call per step.

    `apply(logits, rows, new_tokens)`: `rows[i]` is row i's RowLogits (built with batched=True, or None),
    `new_tokens[i]` the token it sampled last step (None on its first step). Masks are filled for all
    constrained rows at once (in parallel with an llguidance.LLExecutor) and applied with one mx op; rows
    without a constraint pass through.
    """

    def __init__(self, tokenizer: GrammarTokenizer, executor: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.executor = executor
        self._bitmask = tokenizer.new_bitmask(0)

    def apply(self, logits: mx.array, rows: Sequence[RowLogits | None], new_tokens: Sequence[int | None]) -> mx.array:
        logits = self._bias(logits, rows)
        constraints = [r.constraint if r is not None else None for r in rows]
        if not any(c is not None for c in constraints):
            return logits
        for c, t in zip(constraints, new_tokens, strict=True):
            if c is not None and t is not None:
                c.consume([t])
        if self._bitmask.shape[0] != len(rows):
            self._bitmask = self.tokenizer.new_bitmask(len(rows))
        else:
            self._bitmask.fill(-1)
        fill_masks(constraints, self._bitmask, self.executor)
        return apply_bitmask(logits, self._bitmask)

    @staticmethod
    def _bias(logits: mx.array, rows: Sequence[RowLogits | None]) -> mx.array:
        at_rows, at_ids, values = [], [], []
        for i, r in enumerate(rows):
            for t, b in r.bias if r is not None else ():
                at_rows.append(i)
                at_ids.append(t)
                values.append(b)
        if not values:
            return logits
        index = (mx.array(at_rows, dtype=mx.int32), mx.array(at_ids, dtype=mx.int32))
        return logits.at[index].add(mx.array(values, dtype=logits.dtype))
