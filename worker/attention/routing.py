"""The one wrapper of a model's attention call, and where it routes each call.

mlx-lm's attention for the MODEL_TYPES hands its mask and cache straight to the model module's
`scaled_dot_product_attention` (checked for mlx-lm 0.32.2: one mask for every layer, no sliding windows or
sinks). `install` replaces that function, once per module, by `route`, which sends a call
  - with a cascade cache (backend/cascade_cache.py) whose batch holds prefix levels, to cascade attention;
  - a decode step of a BatchKVCache, to the ragged kernel (CUDA) where the active routing has one;
  - a CPU prefill chunk, to causal blocks (cpu_prefill.py) unless the routing turns them off;
  - anything else to the call that was there (mlx-lm's own).
The call carries nothing of ours but its cache, so the routing is the one a backend made active around the model
calls it runs (`active`); calls outside any (a reference run in a test) get the defaults of options.Routing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import cascade, cpu_prefill
from omlx_jobs.worker.attention.kernels import prefix as prefix_kernel
from omlx_jobs.worker.attention.kernels import ragged
from omlx_jobs.worker.attention.kernels import suffix as suffix_kernel
from omlx_jobs.worker.attention.options import CascadeOptions, Routing

MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
MARKER = "_omlx_routing"

DEFAULT = Routing()
"""The routing outside any `active` block."""
_active: ContextVar[Routing | None] = ContextVar("omlx_attention_routing", default=None)


@contextlib.contextmanager
def active(routing: Routing) -> Iterator[None]:
    """Route the model calls made inside the block by `routing`."""
    token = _active.set(routing)
    try:
        yield
    finally:
        _active.reset(token)


def current() -> Routing:
    """The routing in effect here (DEFAULT outside any `active` block)."""
    return _active.get() or DEFAULT


def for_backend(switches: Switches, *, kernels: bool) -> Routing:
    """A backend's routing from its switches; `kernels`: CUDA's decode kernels are on (ragged decode, and for
    cascade caches the suffix kernel, with the prefix kernel unless OMLX_JOBS_CASCADE_PREFIX_KERNEL=0)."""
    options = CascadeOptions(
        compile=switches.cascade_compile,
        fused_prefill=switches.cascade_fused_prefill,
        fused_decode=switches.cascade_fused_decode,
        packed=switches.cascade_packed,
        rows_per_call=switches.fused_rows_per_call,
        suffix_kernel=suffix_kernel.suffix_decode if kernels else None,
        prefix_kernel=prefix_kernel.prefix_decode if kernels and switches.cascade_prefix_kernel else None,
    )
    return Routing(cpu_prefill=switches.cpu_prefill, ragged=ragged.ragged_decode if kernels else None, cascade=options)


def without_kernels(routing: Routing) -> Routing:
    """The same routing without the decode kernels: what prefill outside a decode batch runs by."""
    return dataclasses.replace(routing, ragged=None)


def route(
    original: Callable[..., mx.array],
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> mx.array:
    """One call of the model's attention, by the routing in effect (see the module docstring)."""
    routing = current()
    layout = getattr(cache, "cascade_layout", None)
    if layout is not None:
        levels, own = layout()
        if levels:
            if sinks is not None:
                raise NotImplementedError("cascade attention has no attention sinks; this model must keep KVCache")
            start, buffers = own.left_padding, (own.keys, own.values)
            options = routing.cascade
            if queries.shape[2] == 1 and options.packing:  # the levels packed once per layout (packed.py)
                packed = cache.cascade_packed()
                return cascade.attention(queries, keys, values, levels, scale, mask, start, buffers, options, packed)
            return cascade.attention(queries, keys, values, levels, scale, mask, start, buffers, options)
        cache = own  # no level in this batch: today's path on the own suffixes
    if routing.ragged is not None and _ragged_applies(queries, keys, cache, mask, sinks):
        return routing.ragged(queries, keys, values, cache.left_padding, scale)
    if routing.cpu_prefill and cpu_prefill.applies(queries, keys, cache, mask, sinks):
        return cpu_prefill.attention(queries, keys, values, scale, mask, compiled=routing.cascade.compiling)
    return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _ragged_applies(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    return (
        type(cache) is BatchKVCache  # not a subclass: rotating caches keep keys in another order
        and sinks is None
        and queries.shape[2] == 1
        and ragged.supported(queries.shape[1], keys.shape[1], queries.shape[-1])
        and (mask is None or isinstance(mask, mx.array))
    )


def install(model: Any) -> bool:
    """Replace the model module's scaled_dot_product_attention by `route` (once); False if the model type's
    attention is not one of MODEL_TYPES'."""
    if getattr(model, "model_type", None) not in MODEL_TYPES:
        return False
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, "scaled_dot_product_attention", None)
    if module is None or original is None:
        return False
    wrapped = original
    while wrapped is not None:
        if getattr(wrapped, MARKER, False):
            return True
        wrapped = getattr(wrapped, "__wrapped__", None)

    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        return route(original, queries, keys, values, cache, scale, mask, sinks)

    setattr(scaled_dot_product_attention, MARKER, True)
    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    module.scaled_dot_product_attention = scaled_dot_product_attention
    return True


def cascade_eligible(model: Any) -> bool:
    """True if the model's attention can be routed and every layer cache is a plain KVCache (no sliding windows):
    then its rows may reference their cached prefix (cascade attention)."""
    if getattr(model, "model_type", None) not in MODEL_TYPES:
        return False
    return all(type(c) is KVCache for c in make_prompt_cache(model))
