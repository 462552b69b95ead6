"""Which tool-call markup a model writes, told from its chat template. Pure: no MLX.

- hermes: Qwen2.5, Qwen3, Qwen3.5, Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- qwen3_coder: Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>...</tool_call>`;
- llama3: Llama 3.1-3.3: a JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` at times);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (and the newer `[TOOL_CALLS]name[ARGS]{...}`).
"""

from __future__ import annotations

from enum import Enum


class ToolFamily(str, Enum):
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


def tool_family(template: str) -> ToolFamily | None:
    """The family whose markup `template` renders tool calls in, or None (then the model cannot take tools)."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return ToolFamily.QWEN3_CODER if "<function=" in template else ToolFamily.HERMES
    if "[TOOL_CALLS]" in template:
        return ToolFamily.MISTRAL
    if "<|start_header_id|>" in template and ("ipython" in template or '"parameters"' in template):
        return ToolFamily.LLAMA3
    return None
