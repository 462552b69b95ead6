"""The model run outside a decode batch: which caches it can reuse, and prefill of shared prefixes (warm-ups).

A ModelBackend (one per engine) decides from the engine's switches how the model's attention is routed
(attention/routing.py: installed once, active around each model call it runs) and whether rows may reference
their cached prefix (cascade_batch.py), and opens the decode batches of the engine's runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import _merge_caches, _right_pad_prompts, generation_stream
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache

from omlx_jobs import defaults
from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import routing
from omlx_jobs.worker.attention.cascade_cost import DeviceCosts
from omlx_jobs.worker.attention.kernels import ragged
from omlx_jobs.worker.backend.cascade_batch import CascadeBatch
from omlx_jobs.worker.backend.decode import DecodeBatch
from omlx_jobs.worker.backend.rows import Batch, Caches, StepLogits
from omlx_jobs.worker.cache.prefix_cache import PrefixCache

# Models whose __call__ is `project(model.model(x))` with nothing in between (checked for mlx-lm 0.32.2):
# for them a prefill runs the body alone and projects only the positions whose logits are wanted.
SPLIT_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


class ModelBackend:
    """The model, run outside a decode batch: cache probing and warm-up prefill."""

    def __init__(
        self,
        model: Any,
        *,
        eos: Sequence[int],
        batch_size: int,
        prefill_batch_size: int,
        prefill_step: int,
        prefill_tokens: int = defaults.PREFILL_TOKENS,
        refill_rows: int | None = None,
        switches: Switches | None = None,
    ) -> None:
        self.model = model
        self.eos = frozenset(eos)
        self.batch_size, self.prefill_batch_size, self.prefill_step = batch_size, prefill_batch_size, prefill_step
        self.prefill_tokens = prefill_tokens
        self.refill_rows = refill_rows or max(1, batch_size // defaults.REFILL_FRACTION)
        self.switches = switches = switches or Switches()
        probe = make_prompt_cache(model)
        self.trimmable = bool(can_trim_prompt_cache(probe))
        # Reuse needs caches BatchGenerator can merge; others fall back to no reuse.
        self.reusable = all(hasattr(c, "merge") for c in probe)
        routable = routing.install(model)  # the one wrapper of the model's attention call
        self.ragged = switches.ragged_decode and ragged.available() and routable
        """Decode steps through the ragged kernel (CUDA), and cascade decode steps through the cascade kernels."""
        self.cascade = switches.cascade and routable and routing.cascade_eligible(model)
        """Rows reference their cached prefix instead of copying it (cascade_batch.py)."""
        self.routing = routing.for_backend(switches, kernels=self.ragged)
        """How the model's attention runs inside this backend's decode batches."""
        self.prefill_routing = routing.without_kernels(self.routing)
        """... and in its prefills outside them (warm-ups, echo's scoring passes)."""
        self.speculative = switches.speculation != "off" and all(type(c) is KVCache for c in probe)
        """Decode batches speculate (backend/speculative.py): on unless switched off, for models whose caches
        can be rolled back per row (plain KV caches: not rotating or recurrent ones)."""
        self.step_logits: StepLogits | None = None
        """Set by the engine: decode steps then apply processors marked `batchable` in one call for all rows."""

    def before_admit(self, admissions: Sequence[Any], cache: Any, *, keep: bool) -> None:
        """Called with a window's admissions before they become rows: a vision backend computes their image
        positions then, together (worker/vision/backend.py). Text has nothing to do."""

    def open(self, cache: PrefixCache | None = None) -> Batch:
        """A decode batch for one run; close it when the run ends. With `cache` (the prefix cache rows start
        from) and cascade on, rows reference their prefix entries in it instead of copying them."""
        if self.cascade and cache is not None:
            s = self.switches
            costs = DeviceCosts(*s.level_costs) if s.level_costs is not None else s.cascade_cost
            return CascadeBatch(self, cache, min_level=s.min_level_tokens, costs=costs)
        return DecodeBatch(self)

    def prefill(
        self,
        bases: Sequence[Caches | None],
        suffixes: Sequence[list[int]],
        want: Sequence[set[int]],
        prompts: Sequence[Any] | None = None,
    ) -> list[tuple[Caches, dict[int, mx.array]]]:
        """Extend each base cache (None: empty) by its suffix, all in one batch. `prompts` are the Prompts the
        suffixes are cut from: a vision backend reads their images (worker/vision/backend.py); text ignores them.

        Returns, per sequence, its caches and the logits after each suffix position in `want` (0-based). Unequal
        lengths are right-padded as mlx-lm's PromptProcessingBatch does. Only wanted positions are projected onto
        the vocabulary where the model allows it: the rest of that work is wasted (a large share with big
        vocabularies).
        """
        with mx.stream(generation_stream):
            batch = _merge_caches([b if b is not None else make_prompt_cache(self.model) for b in bases])
            lengths = [len(s) for s in suffixes]
            longest = max(lengths)
            padding = [longest - n for n in lengths]
            tokens = _right_pad_prompts(list(suffixes), max_length=longest)
            if max(padding):
                for c in batch:
                    c.prepare(lengths=lengths, right_padding=padding)
            with routing.active(self.prefill_routing):
                logits = self._run_prefill(batch, tokens, longest, want)
            if max(padding):
                for c in batch:
                    c.finalize()
            out = [[c.extract(i) for c in batch] for i in range(len(suffixes))]
            mx.eval([c.state for caches_i in out for c in caches_i])
        return list(zip(out, logits, strict=True))

    def _run_prefill(
        self, batch: Caches, tokens: mx.array, longest: int, want: Sequence[set[int]]
    ) -> list[dict[int, mx.array]]:
        project = _projection(self.model)
        run = self.model.model if project is not None else self.model
        logits: list[dict[int, mx.array]] = [{} for _ in want]
        for start in range(0, longest, self.prefill_step):
            n = min(self.prefill_step, longest - start)
            h = run(tokens[:, start : start + n], cache=batch)
            picks = [(i, j) for i, ws in enumerate(want) for j in sorted(ws) if start <= j < start + n]
            if picks:
                rows = mx.stack([h[i, j - start] for i, j in picks])
                rows = project(rows) if project is not None else rows
                for k, (i, j) in enumerate(picks):
                    logits[i][j] = rows[k : k + 1]
            mx.eval([c.state for c in batch], [v for d in logits for v in d.values()])
        return logits


def _projection(model: Any) -> Callable[[mx.array], mx.array] | None:
    if getattr(model, "model_type", None) not in SPLIT_HEAD_MODEL_TYPES or not callable(getattr(model, "model", None)):
        return None
    if hasattr(model, "lm_head"):
        return model.lm_head
    return model.model.embed_tokens.as_linear
