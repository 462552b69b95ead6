"""Chat templates of thinking and tool-calling families, cut down from the real ones to what they render: tools in
the system prompt, assistant tool calls and tool results in the history, the thinking block and its switch.
And the tiny random models that carry them (tests/tiny_model.py), built in a test's folder.
"""

from __future__ import annotations

from pathlib import Path

from tiny_model import build_tiny_model

# Qwen3's template, shortened: tools in a system block, calls as <tool_call>{json}</tool_call>, results inside
# <tool_response>, and the thinking switch (enable_thinking false renders an empty think block).
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system{{ '\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "# Tools\n\nYou may call one or more functions.\n<tools>"
    "{%- for tool in tools %}{{ '\\n' + tool | tojson }}{%- endfor %}{{ '\\n</tools>\\n\\n' }}"
    'For each call return <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls or [] %}{{ '\\n<tool_call>\\n' }}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}{{ \'\\n</tool_call>\' }}'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# A DeepSeek-R1-distill-like template: the generation prompt opens the thinking block itself.
OPENED_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    "{#- </think> closes it #}"
)

# Llama 3.1's template, shortened: tools as JSON in the first user message, calls as
# {"name": ..., "parameters": ...}, results in ipython messages.
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    'Respond with a JSON {"name": function name, "parameters": dictionary of arguments}.'
    "{%- for t in tools %}{{ '\\n' + t | tojson }}{%- endfor %}{{ '\\n\\n' + message.content }}<|eot_id|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for tc in message.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")


def qwen3_model(path: Path) -> Path:
    return build_tiny_model(path, chat_template=QWEN3_TEMPLATE, added_tokens=QWEN3_ADDED, context_length=8192)


def opened_model(path: Path) -> Path:
    return build_tiny_model(path, chat_template=OPENED_TEMPLATE, added_tokens=QWEN3_ADDED, context_length=2048)


def llama3_model(path: Path) -> Path:
    return build_tiny_model(
        path, chat_template=LLAMA3_TEMPLATE, special_tokens=LLAMA3_SPECIAL, eos_token="<|eot_id|>", context_length=2048
    )
