"""What a request asks for beyond plain decoding: samplers, logits processors, grammars, logprobs, echo.

Owns: samplers and penalties (sampling.py), logits processing with mx ops (logits.py), llguidance grammars
(grammar.py), logprobs per step and in their stored form (logprobs.py), prompt logprobs and echo's scoring
passes (prompt_logprobs.py, echo.py), and the engine's one object over all of them (outputs.py).
"""
