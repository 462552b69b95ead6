"""Tool calls in the engine: the constrained-call overhead per decode step, and the share of cached_tokens when
many requests share one tool list (issue 24).

    PYTHONPATH=. .venv/bin/python bench/engine/tools.py --json bench/results/engine/cpu-tools-tiny.json

The model is the tests' tiny random Qwen3-style model with a real chat template (tests/chat_templates.py: tools
in the system block, calls as <tool_call>{json}</tool_call>), built in a temporary folder: random-weight models
of real shapes have no tokenizer for a grammar.

1. Overhead: the same job (the same prompts, the tool list rendered in each) run as
   - `auto`: tool_choice auto, unconstrained decoding (calls parsed afterwards);
   - `required`: tool_choice required, decoded under the call grammar (one mask call per decode step);
   `--requests` requests at batch `--batch`, each decoding exactly `--max-tokens` tokens (EOS ignored, so both
   variants keep every row busy for the same steps), in rounds whose order reverses each time. The figure:
   decode seconds per step of each, and their difference.
2. Cached share: `--shared` requests with one 20-tool list and different questions, max_tokens 1, through
   Engine.run with the prefix cache on: cached_tokens over prompt_tokens, and how many tokens the tool block is.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model and its chat templates

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _tools(n: int) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}.", "parameters": SCHEMA}}
        for i in range(n)
    ]


def _items(loaded: Any, bodies: list[dict[str, Any]], max_tokens: int) -> list[Any]:
    from omlx_jobs.jobs.formats import CHAT_URL, SamplingParams, parse_line
    from omlx_jobs.jobs.params import OutputParams
    from omlx_jobs.worker.engine.sequence import WorkItem

    items = []
    for i, raw in enumerate(bodies):
        body = parse_line(json.dumps(raw), i + 1).body
        tokens = loaded.encode(CHAT_URL, body)
        plan = loaded.chat_plan(CHAT_URL, body, tokens)
        output = plan.constrain(OutputParams.from_body(body)) if plan is not None else OutputParams()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        items.append(WorkItem(i, tokens, params, output=output, chat=plan))
    return items


def overhead(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine

    cfg = EngineConfig(completion_batch_size=args.batch, prefix_cache=False, ignore_eos=True)
    engine = Engine(loaded, cfg)
    tools = _tools(4)
    variants = {
        choice: [
            {"messages": [{"role": "user", "content": f"Weather {i}?"}], "tools": tools, "tool_choice": choice}
            for i in range(args.requests)
        ]
        for choice in ("auto", "required")
    }
    engine.run(_items(loaded, variants["auto"][:4], 4), lambda rs: None)  # warm: first use of the kernels
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    order = list(variants)
    for _ in range(args.rounds):
        for name in order:
            stats = engine.run(_items(loaded, variants[name], args.max_tokens), lambda rs: None)
            steps = args.max_tokens * -(-args.requests // args.batch)
            runs[name].append({"decode_s": stats.decode_seconds, "tokens": stats.generation_tokens, "steps": steps})
        order.reverse()
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        decode, steps = sum(r["decode_s"] for r in rs), sum(r["steps"] for r in rs)
        out[name] = {"ms_per_step": 1000 * decode / steps, "tok_s": sum(r["tokens"] for r in rs) / decode, "runs": rs}
    out["overhead_ms_per_step"] = out["required"]["ms_per_step"] - out["auto"]["ms_per_step"]
    out["overhead_share"] = out["overhead_ms_per_step"] / out["auto"]["ms_per_step"]
    return out


def cached_share(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    from omlx_jobs.jobs.formats import CHAT_URL, parse_line
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine

    tools = _tools(20)
    bodies = [
        {"messages": [{"role": "user", "content": f"Question number {i}: which tool?"}], "tools": tools}
        for i in range(args.shared)
    ]
    block = loaded.encode(CHAT_URL, parse_line(json.dumps({**bodies[0], "messages": [
        {"role": "user", "content": "x"}]}), 1).body)  # fmt: skip
    results: list[Any] = []
    started = time.perf_counter()
    engine = Engine(loaded, EngineConfig(completion_batch_size=args.batch))
    stats = engine.run(_items(loaded, bodies, 1), results.extend)
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {
        "requests": len(results),
        "tool_block_tokens": len(block),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt,
        "prefill_tokens": stats.prefill_tokens,
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shared", type=int, default=1000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from chat_templates import qwen3_model

    from omlx_jobs.worker.models.loaded import load_text

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_text("tiny-qwen3-tools", qwen3_model(Path(tmp) / "m"))
        report = {"overhead": overhead(loaded, args), "cached": cached_share(loaded, args), "args": dict(vars(args))}
    report["args"]["json"] = str(args.json) if args.json else None
    o, c = report["overhead"], report["cached"]
    print(f"batch {args.batch}, {args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds:")
    print(f"  auto (unconstrained)   {o['auto']['ms_per_step']:.2f} ms/step  {o['auto']['tok_s']:.0f} tok/s")
    print(f"  required (grammar)     {o['required']['ms_per_step']:.2f} ms/step  {o['required']['tok_s']:.0f} tok/s")
    print(f"  overhead               {o['overhead_ms_per_step']:+.2f} ms/step ({100 * o['overhead_share']:+.1f}%)")
    print(f"{c['requests']} requests sharing 20 tools (block {c['tool_block_tokens']} tokens):")
    print(f"  cached_tokens / prompt_tokens = {c['cached_tokens']} / {c['prompt_tokens']} = {c['cached_share']:.3f}")
    print(f"  prefilled {c['prefill_tokens']} tokens in {c['seconds']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
