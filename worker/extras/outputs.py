"""What a request asks for beyond sampling, in the engine: its logits path (response_format's grammar,
logit_bias), the logprobs it collects while it decodes, and echo's prompt logprobs.

The engine asks this module at four points, and a request that asks for none of it never reaches it:
- `Outputs.check`: when a request is tokenized; a bias outside the vocabulary or a grammar that does not
  compile fails that request alone;
- `Outputs.choice`: when a choice is admitted; its logits processors (worker/extras/logits.py: a logprob tap first
  when anything changes the logits, logit_bias, the penalties, then the grammar mask, all mx ops) and its state;
- `Outputs.collect`: after each step; logprobs of every row that wants them, in one evaluation;
- `ChoiceOutputs.finish`: when it ends; the stored logprobs, echo's text, or the grammar's error.

Echo's prompt logprobs are echo.py's: the engine runs a window's warm-ups so that they keep their prefixes'
scores when its requests want them, then has `Outputs.echo` score its echo prompts in batched passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.attention.options import Routing
from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.extras.echo import EchoScorer
from omlx_jobs.worker.extras.grammar import GrammarCache, GrammarTokenizer, model_eos_ids
from omlx_jobs.worker.extras.logits import (
    BatchablePart,
    BatchLogits,
    LogprobTap,
    RowLogits,
    check_logit_bias,
    logits_width,
    row_logits,
)
from omlx_jobs.worker.extras.logprobs import TokenLogprob, TokenPieces, step_logprobs, stored_entries
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.prompts import Prompt


def engine_eos(loaded: LoadedModel) -> list[int]:
    """The full EOS set (tokenizer and config), which the engine stops on and grammars end with."""
    return sorted(model_eos_ids(loaded.tokenizer, loaded.config, 1 << 31))


@dataclass(frozen=True)
class Grammars:
    """The model's vocabulary as grammars and stored logprobs see it, built once on first use (about a second)."""

    tokenizer: GrammarTokenizer
    """llguidance's view of the vocabulary (it also knows every token's exact bytes)."""
    compiled: GrammarCache
    """Compiled grammars by response format."""
    pieces: TokenPieces
    """Each token's piece in the stored logprobs."""

    @classmethod
    def build(cls, loaded: LoadedModel, width: int) -> Grammars:
        eos = model_eos_ids(loaded.tokenizer, loaded.config, width)
        tokenizer = GrammarTokenizer.build(loaded.tokenizer, width, eos)
        return cls(tokenizer, GrammarCache(tokenizer), TokenPieces.from_grammar_tokenizer(tokenizer))


@dataclass
class ChoiceOutputs:
    """One choice's extras while it runs: its logits path, its logprobs so far, echo's prompt part."""

    output: OutputParams
    logits: RowLogits
    position: int
    """Where the next generated token sits in prompt + output (the tap's key)."""
    prompt_text: str = ""
    prompt_entries: list[TokenLogprob] | None = None
    tokens: list[TokenLogprob] = field(default_factory=list)

    @property
    def processors(self) -> list[Any]:
        return self.logits.processors

    @property
    def wants_logprobs(self) -> bool:
        return self.output.logprobs

    def finish(self, kept: int, outputs: Outputs) -> tuple[str, Any, Any, str | None]:
        """(text before the output, its stored logprobs, the prompt's, an error) once `kept` tokens are kept.

        The entries follow the kept tokens (an EOS token, or tokens past a stop string, are not in the text).
        An output the grammar rejected is an error: it must not be returned as if it matched.
        """
        error = self.logits.constraint.error if self.logits.constraint is not None else None
        if not self.output.logprobs:
            return self.prompt_text, None, None, error
        top = self.output.top_logprobs
        entries = stored_entries(self.tokens[:kept], outputs.pieces, top_logprobs=top)
        prompt = self.prompt_entries
        echoed = stored_entries(prompt, outputs.pieces, top_logprobs=top) if prompt is not None else None
        return self.prompt_text, entries, echoed, error


class Outputs:
    """One per engine: the grammar tokenizer and compiled grammars (built on first use), token pieces, scores."""

    def __init__(self, loaded: LoadedModel, cache: PrefixCache, routing: Routing | None = None) -> None:
        self.loaded, self.cache = loaded, cache
        self._width: int | None = None
        self._grammars: Grammars | None = None
        self.echo = EchoScorer(loaded.model, cache, routing or Routing())
        self._batch: BatchLogits | None = None

    @property
    def scored_tokens(self) -> int:
        """Prompt tokens run through the model for echo requests (the engine adds them to its prefill count)."""
        return self.echo.tokens_run

    @property
    def width(self) -> int:
        if self._width is None:
            self._width = logits_width(self.loaded.model)
        return self._width

    def grammar(self) -> Grammars:
        """The model's grammar tokenizer, compiled grammars and token pieces, built on first use."""
        if self._grammars is None:
            self._grammars = Grammars.build(self.loaded, self.width)
        return self._grammars

    def check(self, output: OutputParams) -> None:
        """Raise PromptError if this request's extras cannot run on this model (it then fails alone)."""
        if output.logit_bias:
            check_logit_bias(output.logit_bias, self.width)
        if output.response_format is not None:
            self.grammar().compiled.constraint(output.response_format)  # compiles once; a copy is dropped

    def choice(self, output: OutputParams, prompt: Prompt, penalties: list[Any]) -> ChoiceOutputs | None:
        """A choice's extras and its processors (penalties included); None when it asks for nothing."""
        if output == OutputParams():
            return None
        grammars = self.grammar().compiled if output.response_format is not None else None
        width = self.width if output.logit_bias else 0
        logits = self._logits(output, grammars, width, penalties)
        co = ChoiceOutputs(output, logits, position=len(prompt))
        if output.echo:
            co.prompt_text = self._text(prompt.tokens)
            if output.logprobs:
                co.prompt_entries = self.echo.score(prompt).entries(output.top_logprobs)
        return co

    def _logits(
        self, output: OutputParams, grammars: GrammarCache | None, width: int, penalties: list[Any]
    ) -> RowLogits:
        """The row's processors: the logprob tap (when anything changes the logits), the penalties, then bias and
        grammar as one BatchablePart, which decode steps apply for the whole batch at once (`step_logits`)."""
        row = row_logits(output, grammars=grammars, vocab_size=width, penalties=penalties, batched=True)
        if row.bias or row.constraint is not None:
            row.processors.append(BatchablePart(row, width))
        if output.logprobs and row.processors:
            row.tap = LogprobTap()
            row.processors.insert(0, row.tap)
        return row

    def step_logits(self, logits: mx.array, parts: list[Any], tokens: list[int]) -> mx.array:
        """Bias and mask every row of a decode step in one call (backend.StepLogits; BatchLogits does it)."""
        if self._batch is None:
            self._batch = BatchLogits(self.grammar().tokenizer)
        return self._batch.apply(logits, [p.row if p is not None else None for p in parts], tokens)

    def collect(self, rows: Sequence[tuple[Any, Any]]) -> None:
        """Append each row's new tokens' logprobs (model's own, before any processor), one evaluation for all.

        `rows`: (its SequenceState or None, the backend's RowOutput) for a step's rows; those whose requests
        want no logprobs are skipped.
        """
        vectors, tokens, top, owners = [], [], [], []
        for seq, out in rows:
            co = seq.extra if seq is not None else None
            if co is None or not co.wants_logprobs:
                continue
            for token, lp in zip(out.tokens, out.logprobs, strict=True):
                raw = co.logits.tap.take(co.position) if co.logits.tap is not None else None
                vectors.append(raw if raw is not None else lp)
                tokens.append(token)
                top.append(co.output.top_logprobs)
                owners.append(co)
                co.position += 1
        for co, entry in zip(owners, step_logprobs(vectors, tokens, top), strict=True):
            co.tokens.append(entry)

    @property
    def pieces(self) -> TokenPieces:
        return self.grammar().pieces

    def _text(self, tokens: Sequence[int]) -> str:
        """The prompt's text as its tokens' bytes read (so echo's text_offset points into it)."""
        raw = self.grammar().tokenizer.ll.decode_bytes(list(tokens))
        return bytes(raw).decode("utf-8", errors="replace")
