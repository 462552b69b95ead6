"""What a request asks for beyond sampling, in the engine: its logits path (response_format's grammar,
logit_bias), the logprobs it collects while it decodes, and echo's prompt logprobs.

The engine asks this module at four points, and a request that asks for none of it never reaches it:
- `Outputs.check`: when a request is tokenized; a bias outside the vocabulary or a grammar that does not
  compile fails that request alone;
- `Outputs.choice`: when a choice is admitted; its logits processors (worker/logits.py: a logprob tap first
  when anything changes the logits, logit_bias, the penalties, then the grammar mask, all mx ops) and its state;
- `Outputs.collect`: after each step; logprobs of every row that wants them, in one evaluation;
- `ChoiceOutputs.finish`: when it ends; the stored logprobs, echo's text, or the grammar's error.

Echo's prompt logprobs (worker/prompt_logprobs.py) are kept per prompt (`PromptScores`), as phase 1 chose: a
request whose prompt shares a prefix with one scored before scores only what follows, continuing the prefix
cache's KV. See `Outputs.score`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker import kv
from omlx_jobs.worker.grammar import GrammarCache, GrammarTokenizer, model_eos_ids
from omlx_jobs.worker.logits import RowLogits, check_logit_bias, logits_width, row_logits
from omlx_jobs.worker.logprobs import TokenLogprob, TokenPieces, step_logprobs, stored_logprobs
from omlx_jobs.worker.model import LoadedModel
from omlx_jobs.worker.prefix_cache import Match, PrefixCache
from omlx_jobs.worker.prompt_logprobs import PromptLogprobs, prompt_logprobs
from omlx_jobs.worker.prompts import Prompt, common_prefix

log = logging.getLogger(__name__)

PROMPT_SCORE_ENTRIES = 256
"""Scored prompts kept for echo (about 48 bytes per token each); the most recently used stay."""


def engine_eos(loaded: LoadedModel) -> list[int]:
    """The full EOS set (tokenizer and config), which the engine stops on and grammars end with."""
    return sorted(model_eos_ids(loaded.tokenizer, loaded.config, 1 << 31))


class PromptScores:
    """Per-position prompt logprobs of recently scored prompts, by prompt key, least recently used out."""

    def __init__(self, max_entries: int = PROMPT_SCORE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[bytes, PromptLogprobs] = collections.OrderedDict()

    def longest(self, key: bytes) -> tuple[PromptLogprobs, int] | None:
        """The kept scores sharing the longest prefix with `key`, and how many positions they share."""
        best: tuple[bytes, int] | None = None
        for k in self._entries:
            shared = common_prefix(k, key)
            if shared and (best is None or shared > best[1]):
                best = (k, shared)
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        return self._entries[best[0]], best[1]

    def add(self, key: bytes, scores: PromptLogprobs) -> None:
        self._entries[key] = scores
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


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
        stored = stored_logprobs(
            [self.tokens[:kept]], outputs.pieces, top_logprobs=self.output.top_logprobs, prompt=self.prompt_entries
        )
        return self.prompt_text, stored["choices"][0], stored.get("prompt"), error


class Outputs:
    """One per engine: the grammar tokenizer and compiled grammars (built on first use), token pieces, scores."""

    def __init__(self, loaded: LoadedModel, cache: PrefixCache) -> None:
        self.loaded, self.cache = loaded, cache
        self._width: int | None = None
        self._grammar: tuple[GrammarTokenizer, GrammarCache, TokenPieces] | None = None
        self.scores = PromptScores()
        self._plain_kv: bool | None = None
        self.scored_tokens = 0
        """Prompt tokens run through the model for echo (the engine adds them to its prefill count)."""

    @property
    def width(self) -> int:
        if self._width is None:
            self._width = logits_width(self.loaded.model)
        return self._width

    def grammar(self) -> tuple[GrammarTokenizer, GrammarCache, TokenPieces]:
        if self._grammar is None:
            width = self.width
            tok = GrammarTokenizer.build(
                self.loaded.tokenizer, width, model_eos_ids(self.loaded.tokenizer, self.loaded.config, width)
            )
            self._grammar = (tok, GrammarCache(tok), TokenPieces.from_grammar_tokenizer(tok))
        return self._grammar

    def check(self, output: OutputParams) -> None:
        """Raise PromptError if this request's extras cannot run on this model (it then fails alone)."""
        if output.logit_bias:
            check_logit_bias(output.logit_bias, self.width)
        if output.response_format is not None:
            self.grammar()[1].constraint(output.response_format)  # compiles once; a copy is dropped

    def choice(self, output: OutputParams, prompt: Prompt, penalties: list[Any]) -> ChoiceOutputs | None:
        """A choice's extras and its processors (penalties included); None when it asks for nothing."""
        if output == OutputParams():
            return None
        grammars = self.grammar()[1] if output.response_format is not None else None
        width = self.width if output.logit_bias else 0
        logits = row_logits(output, grammars=grammars, vocab_size=width, penalties=penalties)
        co = ChoiceOutputs(output, logits, position=len(prompt))
        if output.echo:
            co.prompt_text = self._text(prompt.tokens)
            if output.logprobs:
                co.prompt_entries = self.score(prompt).entries(output.top_logprobs)
        return co

    def collect(self, rows: Sequence[tuple[ChoiceOutputs, Any]]) -> None:
        """Append each row's new tokens' logprobs (model's own, before any processor), one evaluation for all.

        `rows`: (choice extras, the backend's RowOutput) for the rows that want logprobs this step.
        """
        vectors, tokens, top, owners = [], [], [], []
        for co, out in rows:
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
        return self.grammar()[2]

    def _text(self, tokens: Sequence[int]) -> str:
        """The prompt's text as its tokens' bytes read (so echo's text_offset points into it)."""
        raw = self.grammar()[0].ll.decode_bytes(list(tokens))
        return bytes(raw).decode("utf-8", errors="replace")

    # ---- echo --------------------------------------------------------------------------------------------

    def scorer_for(self, admissions: Sequence[Any]) -> Outputs | None:
        """Self when a window's requests want prompt logprobs and the model's caches let warm-ups keep them."""
        if not any(a.work.output.echo and a.work.output.logprobs for a in admissions):
            return None
        if self._plain_kv is None:
            self._plain_kv = all(isinstance(c, KVCache) for c in make_prompt_cache(self.loaded.model))
        return self if self._plain_kv else None

    def warm(self, key: bytes, tokens: Sequence[int], base: Match | None) -> tuple[list[Any], mx.array, int]:
        """A warm-up's prefill that keeps its per-position scores: (its caches, the logits after it, tokens run).

        It continues `base` when the base's scores and the logits after it are known, else runs the prefix whole.
        """
        known = self.scores.longest(key)
        s = base.length if base is not None else 0
        scores = None
        if (
            base is not None
            and known is not None
            and known[1] >= s == base.entry.tokens
            and base.entry.logits is not None
        ):
            prefix = (kv.view(base.entry.value, base.entry.tokens, s), base.entry.logits)
            ((suffix, last, caches),) = prompt_logprobs(
                self.loaded.model, [list(tokens[s:])], prefix=prefix, return_caches=True
            )
            scores, computed = known[0].head(s).concat(suffix), len(tokens) - s
        if scores is None:
            ((scores, last, caches),) = prompt_logprobs(self.loaded.model, [list(tokens)], return_caches=True)
            computed = len(tokens)
        self.scores.add(key, scores)
        return caches, last, computed  # type: ignore[return-value]

    def score(self, prompt: Prompt) -> PromptLogprobs:
        """The prompt's per-position logprobs, computing only what neither kept scores nor the cache give.

        Positions up to S are known from a prompt scored before (S shared tokens). The pass continues the
        prefix cache's KV of B <= S - 1 tokens (the logits after B tokens are not kept, so position B's
        score comes from the kept ones) and scores the rest; without both, the whole prompt is scored.
        """
        n, known = len(prompt), self.scores.longest(prompt.key)
        if known is not None and known[1] >= n:
            return known[0].head(n)
        exact = self._after_scored(prompt, known)
        if exact is not None:
            return exact
        base = self._base(prompt, known[1] - 1) if known is not None and known[1] > 1 else None
        tokens = prompt.tokens
        scored = None
        if base is not None:
            b, caches = base
            try:
                suffix = self._run(tokens[b:], caches)
                scored = known[0].head(b + 1).concat(suffix.tail(1))  # type: ignore[index]
            except ValueError as exc:  # caches prompt_logprobs cannot continue (not KVCache): score it all
                log.info("prompt logprobs without the cached prefix: %s", exc)
        if scored is None:
            scored = self._run(tokens, None)
        self.scores.add(prompt.key, scored)
        return scored

    def _after_scored(self, prompt: Prompt, known: tuple[PromptLogprobs, int] | None) -> PromptLogprobs | None:
        """Scores when a cache entry ends exactly where the kept scores do, with the logits after it (a scored
        warm-up): only the rest of the prompt runs, its first token scored from those logits."""
        if known is None:
            return None
        match = self.cache.lookup(prompt.key, limit=known[1], count=False)
        if match is None or not match.length == match.entry.tokens == known[1] or match.entry.logits is None:
            return None
        caches = kv.view(match.entry.value, match.entry.tokens, match.length)
        try:
            rest = self._run(prompt.tokens[match.length :], caches, match.entry.logits)
        except ValueError:
            return None
        scored = known[0].head(match.length).concat(rest)
        self.scores.add(prompt.key, scored)
        return scored

    def _base(self, prompt: Prompt, limit: int) -> tuple[int, list[Any]] | None:
        match = self.cache.lookup(prompt.key, limit=limit, count=False)
        if match is None or match.length < 1:
            return None
        return match.length, kv.view(match.entry.value, match.entry.tokens, match.length)

    def _run(self, tokens: Sequence[int], caches: list[Any] | None, logits: Any = None) -> PromptLogprobs:
        prefix = (caches, logits) if caches is not None else None
        ((scores, _, _),) = prompt_logprobs(self.loaded.model, [list(tokens)], prefix=prefix)
        self.scored_tokens += len(tokens)
        return scores
