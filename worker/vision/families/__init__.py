"""Vision families that batch in the one engine: one small adapter per mlx-vlm model family.

Owns: the adapter protocol (base.py: how a family's images become prompt tokens and input embeddings, the
positions its language model runs at, its caches and whether they may be trimmed, and mlx-lm's text model that
decodes it), and one module per family: Qwen2-VL / Qwen2.5-VL (qwen2_vl.py), Qwen3-VL (qwen3_vl.py), LLaVA
(llava.py), LLaVA-NeXT (llava_next.py), Gemma 3 (gemma3.py), Mistral 3 and Pixtral (mistral3.py). FAMILIES maps
an mlx-vlm model_type to its adapter; every other family runs on vision/serial.py.
"""

from __future__ import annotations

from omlx_jobs.worker.vision.families.base import Family
from omlx_jobs.worker.vision.families.gemma3 import Gemma3
from omlx_jobs.worker.vision.families.llava import Llava
from omlx_jobs.worker.vision.families.llava_next import LlavaNext
from omlx_jobs.worker.vision.families.mistral3 import Mistral3, Pixtral
from omlx_jobs.worker.vision.families.qwen2_vl import Qwen2VL
from omlx_jobs.worker.vision.families.qwen3_vl import Qwen3VL

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Qwen2VL(),
    "qwen2_5_vl": Qwen2VL(),
    "llava": Llava(),
    "gemma3": Gemma3(),
    "qwen3_vl": Qwen3VL(),
    "mistral3": Mistral3(),
    "pixtral": Pixtral(),
    "llava_next": LlavaNext(),
}


def family_of(model_type: str) -> Family | None:
    """The adapter that batches `model_type`, or None (it runs one request at a time on mlx-vlm)."""
    return FAMILIES.get(model_type)
