"""Constrained decoding with llguidance: the model's vocabulary as the grammar sees it, compiled grammars
cached by schema, and one matcher per choice that consumes sampled tokens and fills the next token mask.

Masks are bitmasks, one bit per logits slot (numpy int32, as llguidance writes them); worker/extras/logits.py applies
them with mx ops, so one code path serves CPU, CUDA and Metal. Why llguidance: bench/RESULTS.md ("Grammar
libraries"): no dependencies, a grammar is ready in about a millisecond where xgrammar and outlines-core take
hundreds to thousands, and its masks are the fastest of the three at batch 32.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.response_format import ResponseFormat
from omlx_jobs.worker.prompts import PromptError

GRAMMAR_CACHE_ENTRIES = 256
GRAMMAR_CACHE_BYTES = 512 * 1024**2
"""What the cached grammars may hold, estimated (grammar_cost): a huge schema's matcher holds ~26 MB."""


class GrammarError(PromptError):
    """A request whose grammar cannot run on this model; it fails alone."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.GRAMMAR_ERROR, message)


def model_eos_ids(tokenizer: Any, config: dict[str, Any], vocab_size: int) -> frozenset[int]:
    """Every token that ends a sequence: the tokenizer's EOS set, its eos_token_id and the config's ids.

    The engine must stop on exactly this set: a grammar lets one of them through only where the output may end,
    and a token the grammar treats as the end must end the sequence.
    """
    ids: set[int] = set(getattr(tokenizer, "eos_token_ids", None) or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    value = config.get("eos_token_id")
    ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return frozenset(i for i in ids if 0 <= i < vocab_size)


def _tokenizer_json(tokenizer: Any) -> str:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("constrained decoding needs a fast tokenizer (a tokenizer.json); this model has none")
    backend = copy.copy(backend)  # to_str() must not carry padding or truncation settings
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


@dataclass(frozen=True)
class GrammarTokenizer:
    """The model's vocabulary for llguidance, built once per loaded model (about half a second).

    `vocab_size` is the logits width: slots past the tokenizer's own vocabulary (models pad it) get no bytes,
    so no grammar ever allows them.
    """

    ll: Any
    vocab_size: int
    eos_ids: frozenset[int]

    @classmethod
    def build(cls, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> GrammarTokenizer:
        eos = frozenset(eos_ids)
        if not eos:
            raise GrammarError("constrained decoding needs an end-of-sequence token; this model has none")
        ll = llguidance.LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=sorted(eos))
        if ll.vocab_size != vocab_size:  # a tokenizer larger than the model's logits
            raise GrammarError(f"the tokenizer has {ll.vocab_size} tokens but the model only {vocab_size} logits")
        return cls(ll, vocab_size, eos)

    def new_bitmask(self, rows: int) -> np.ndarray:
        """An all-allowed (rows, ceil(vocab / 32)) int32 bitmask."""
        return llnp.allocate_token_bitmask(rows, self.vocab_size)

    def eos_only(self, bitmask: np.ndarray, row: int) -> None:
        """Allow only the end of the sequence in `row`."""
        bits = bitmask.view(np.uint32)
        bits[row] = 0
        for t in self.eos_ids:
            bits[row, t // 32] |= np.uint32(1 << (t % 32))


class Constraint:
    """One choice's grammar state: it consumes each sampled token and fills the mask for the next one.

    With a `gate` (a reasoning/budget.py ThinkTracker), the grammar applies to the answer only: tokens before the
    answer starts pass it by, and while the model thinks every token is allowed (at the first token, the open
    marker too, so that a template which lets the model open its thinking still can).
    """

    def __init__(self, matcher: Any, tokenizer: GrammarTokenizer) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.gate: Any = None
        self._fed = 0

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past sampled tokens. A token the mask did not allow puts the matcher in its error state."""
        for t in tokens:
            index, self._fed = self._fed, self._fed + 1
            if self.gate is not None and (self.gate.answer_from is None or index < self.gate.answer_from):
                continue  # thinking: not the grammar's
            if not self.matcher.consume_token(int(t)):
                break

    @property
    def fills(self) -> bool:
        """The grammar decides the next token (False while a gate's thinking runs)."""
        return self.gate is None or self.gate.in_answer or self.gate.phase == "maybe"

    def after_fill(self, bitmask: np.ndarray, row: int) -> None:
        """A gate's part of the mask: all allowed while thinking, the open marker allowed where it may come."""
        if self.gate is None or self.gate.in_answer:
            return
        if self.gate.phase == "maybe":
            t = self.gate.markers.open_id
            bitmask.view(np.uint32)[row, t // 32] |= np.uint32(1 << (t % 32))
        else:
            bitmask[row] = -1

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`; after an error only the end is allowed."""
        if self.fills and not self.matcher.is_error():
            llnp.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():
            self.tokenizer.eos_only(bitmask, row)
        self.after_fill(bitmask, row)

    @property
    def error(self) -> str | None:
        """Why the output cannot match (the request must then fail, not be returned as valid); None if fine."""
        return self.matcher.get_error().splitlines()[0] if self.matcher.is_error() else None

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match."""
        return bool(self.matcher.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Nothing but the end may follow."""
        return bool(self.matcher.is_stopped())


def fill_masks(constraints: Sequence[Constraint | None], bitmask: np.ndarray, executor: Any | None = None) -> list[int]:
    """Fill the mask rows of every constrained row at once; returns those row indices.

    With an executor (llguidance.LLExecutor) the rows are filled in parallel threads outside the GIL.
    """
    rows = [i for i, c in enumerate(constraints) if c is not None]
    live = [(constraints[i].matcher, i) for i in rows if constraints[i].fills and not constraints[i].matcher.is_error()]  # type: ignore[union-attr]
    if executor is not None and len(live) > 1:
        llnp.fill_next_token_bitmask_par(executor, live, bitmask)
    else:
        for m, i in live:
            llnp.fill_next_token_bitmask(m, bitmask, i)
    for i in rows:
        if constraints[i].matcher.is_error():  # type: ignore[union-attr]
            constraints[i].tokenizer.eos_only(bitmask, i)  # type: ignore[union-attr]
        constraints[i].after_fill(bitmask, i)  # type: ignore[union-attr]
    return rows


def grammar_cost(grammar: str) -> int:
    """The memory a compiled grammar holds, estimated from its text: llguidance reports none, and a matcher's
    lexer grows with the grammar (measured: ~90 bytes of RSS per grammar byte for large schemas, ~2 MB at least
    once the lexer is warm; a few hundred KB for small ones)."""
    return 256 * 1024 + 100 * len(grammar)


@dataclass
class GrammarCache:
    """Compiled grammars by response format (schema hash), least recently used first out.

    A request takes a copy of the cached matcher (about a microsecond); compiling happens once per schema.
    """

    tokenizer: GrammarTokenizer
    max_entries: int = GRAMMAR_CACHE_ENTRIES
    max_bytes: int = GRAMMAR_CACHE_BYTES
    hits: int = 0
    misses: int = 0
    nbytes: int = 0
    """The estimated bytes of the grammars cached now."""
    _entries: collections.OrderedDict[str, tuple[Any, int]] = field(default_factory=collections.OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def constraint(self, fmt: ResponseFormat) -> Constraint:
        """A fresh constraint for one choice. Raises GrammarError if the schema does not compile."""
        entry = self._entries.get(fmt.key)
        if entry is None:
            self.misses += 1
            grammar = fmt.grammar()
            entry = (self._compile(fmt), grammar_cost(grammar))
            self._entries[fmt.key] = entry
            self.nbytes += entry[1]
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
                _, (_, cost) = self._entries.popitem(last=False)
                self.nbytes -= cost
        else:
            self.hits += 1
            self._entries.move_to_end(fmt.key)
        return Constraint(entry[0].deep_copy(), self.tokenizer)

    def _compile(self, fmt: ResponseFormat) -> Any:
        matcher = llguidance.LLMatcher(self.tokenizer.ll, fmt.grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the response_format schema does not compile: {matcher.get_error().splitlines()[0]}")
        # The lexer is built lazily by the first mask; do it here so every copy starts warm.
        matcher.compute_bitmask()
        return matcher
