"""The serial fallback: vision families we cannot batch safely run one request at a time, on mlx-vlm's own
generation loop (`mlx_vlm.stream_generate`), correct rather than fast.

Families with an adapter (vision/families/: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3) decode in mlx-lm's
BatchGenerator. Other families need glue we have not written and checked, so they run here: the same shard
runner, results and accounting as the Engine, no prefix reuse (cached_tokens is 0), mlx-vlm's processor building
the model inputs from the prompt text and the decoded pixels (never from a request's string: images are fetched
and checked by media.ImageRef).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from omlx_jobs.errors import ErrorCode, FinishReason
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.contract import Control, Hooks, ResultsHook
from omlx_jobs.worker.engine.limits import check_context, max_new_tokens
from omlx_jobs.worker.engine.results import Choice, ItemResult, PlanTotals, RunStats
from omlx_jobs.worker.engine.sequence import SequenceState, WorkItem
from omlx_jobs.worker.engine.stopping import StopStrings, final_text
from omlx_jobs.worker.extras.sampling import SamplerFactory
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.prompts import PromptError
from omlx_jobs.worker.vision.loaded import TemplatePrompt

log = logging.getLogger(__name__)


class SerialEngine:
    """An engine (engine/contract.EngineLike) that runs one request at a time on mlx-vlm."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        if loaded.vision is None:
            raise ValueError("the serial engine runs vision models; text models run on Engine")
        self.loaded, self.config = loaded, config or EngineConfig()
        self.vm, self.tokenizer = loaded.vision, loaded.tokenizer
        self.eos = frozenset() if self.config.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        self.cache = PrefixCache(max_bytes=0)  # nothing is reused here; the shard runner reads its stats
        self.samplers = SamplerFactory()
        log.warning(
            "%s (%s) does not batch here: its requests run one at a time on mlx-vlm (see docs/images.md)",
            loaded.ref,
            self.vm.model_type,
        )

    def check(self, tokens: Sequence[int], params: Any, output: OutputParams | None = None) -> None:
        """The Engine's check, less the extras mlx-vlm's loop cannot give (no logits processors of ours, no logprobs,
        no prompt scores): a request that asks for one fails alone, never silently without it."""
        if output is not None and output != OutputParams():
            asked = {
                "response_format": output.response_format is not None,
                "logit_bias": bool(output.logit_bias),
                "logprobs": output.logprobs,
                "echo": output.echo,
            }
            raise PromptError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"{', '.join(k for k, on in asked.items() if on)} cannot run on {self.vm.model_type}, which runs one "
                "request at a time on mlx-vlm here; drop it, or use a family that batches (docs/images.md)",
            )
        check_context(tokens, self.loaded.context_length)

    def reset(self) -> None:
        """Drop the shared samplers after an exception mid-run (nothing is cached here)."""
        self.samplers = SamplerFactory()
        self.cache.clear()

    def run(self, items: Iterable[WorkItem], hooks: Hooks | ResultsHook, *, page_size: int | None = None) -> RunStats:
        """Generate every item in input order (n choices each); stops between requests when hooks.control says so.
        The whole input is read at once (`page_size` is the Engine's; one request at a time needs no plan)."""
        started, work, hooks = time.perf_counter(), list(items), Hooks.of(hooks)
        total = sum(len(w.prompt) * w.params.n for w in work)
        stats = RunStats(prompt_tokens=total, trie_min_tokens=total)
        if hooks.plan is not None:
            hooks.plan(PlanTotals(prompt_tokens=total, trie_min_tokens=total))
        for i, item in enumerate(work):
            if hooks.control() is not Control.RUN:
                stats.unfinished = [w.key for w in work[i:]]
                break
            if hooks.admit is not None:
                hooks.admit([item.key])
            begun = time.time()
            done = [self._generate(item, c, stats) for c in range(item.params.n)]
            prompt_tokens = done[0][1]  # as the processor expanded it, image tokens included
            stats.prefill_tokens += prompt_tokens * item.params.n
            choices = [choice for choice, _ in done]
            hooks.results([ItemResult(item.key, choices, prompt_tokens, 0, begun, time.time())])
        stats.peak_live_items = 1 if work else 0
        stats.seconds = time.perf_counter() - started
        return stats

    def _generate(self, item: WorkItem, choice: int, stats: RunStats) -> tuple[Choice, int]:
        """One choice through mlx_vlm.stream_generate; stop strings and finish reasons as the Engine's."""
        from mlx_vlm import stream_generate  # mlx-vlm is optional (the [vision] extra)

        params = item.params
        text, pixels = self._inputs(item)
        stops = StopStrings(params.stop, self.tokenizer.detokenizer) if params.stop else None
        seq = SequenceState(0, choice, stops)
        limit = max_new_tokens(len(item.prompt), params, self.loaded.context_length)
        reason, prompt_tokens = FinishReason.LENGTH, len(item.prompt)
        tokenizer = self.vm.tokenizer
        saved = tokenizer.stopping_criteria
        # mlx-vlm stops at EOS without yielding it; here ends are ours to decide (ignore_eos, finish reasons).
        tokenizer.stopping_criteria = lambda token: False
        try:
            stream = stream_generate(
                self.vm.model,
                self.vm.processor,
                text,
                image=pixels or None,
                max_tokens=limit,
                sampler=self.samplers.sampler(params, choice),
                logits_processors=self.samplers.logits_processors(params) or None,
            )
            for step, out in enumerate(stream):
                prompt_tokens = int(out.prompt_tokens)
                token = int(out.token)
                at_limit = step + 1 >= limit
                finish = FinishReason.STOP if token in self.eos else (FinishReason.LENGTH if at_limit else None)
                stats.generation_tokens += 1
                ended = seq.consume([token], finish)
                if ended is not None:
                    reason = ended
                    break
        finally:
            tokenizer.stopping_criteria = saved
        decoded = self.tokenizer.decode(seq.tokens)
        if stops is not None:
            decoded, reason = final_text(decoded, stops.stops, reason)
        return Choice(decoded, reason, seq.generated, seq.tokens), prompt_tokens

    def _inputs(self, item: WorkItem) -> tuple[str, Sequence[Any]]:
        """The prompt's template text (one placeholder per image: the processor expands each), and the pixels."""
        prompt = item.prompt
        if not isinstance(prompt, TemplatePrompt):  # a completions prompt: text only
            return self.tokenizer.decode(prompt.tokens, skip_special_tokens=False), []
        return prompt.text, [im.pixels for im in prompt.images]
