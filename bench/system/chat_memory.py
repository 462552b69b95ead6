"""Benchmark: peak RSS of `omlx-jobs run` on the shared-document job, chat messages against the same token ids.

64 questions (--questions) over one document of about 2,100 tokens (--doc-words), the document as a system
message, the question as the user message, greedy, --max-tokens out. Two forms of the very same prompts:
  chat   /v1/chat/completions lines: the worker renders the chat template and tokenizes
  ids    /v1/completions lines whose prompt is the token ids the chat template gives (rendered once here)
Each form runs as its own `omlx-jobs run --batch-size 64` process; its peak RSS (VmHWM, via wait4's
ru_maxrss of the child) and wall time are printed side by side, with the ratio. Both forms compute the same
tokens, so any difference is the chat path's own memory.

    .venv/bin/python bench/system/chat_memory.py --model gguf:$(.venv/bin/omlx-jobs models smollm2-path)
    .venv/bin/python bench/system/chat_memory.py --model tiny --questions 16 --doc-words 400     # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.lib.processes import omlx_cli  # noqa: E402

WORDS = (  # noqa: SIM905
    "the system reads each request line and keeps its prefix in a cache so that later rows reuse the "
    "computed keys and values while the scheduler orders work by shared tokens before admitting new rows "
    "into the batch where every step decodes one token for each sequence until it reaches its limit or stops"
).split()


def document(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences, n = [], 0
    while n < words:
        k = rng.randrange(8, 18)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n += k
    return " ".join(sentences)


def chat_lines(doc: str, questions: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [
                    {"role": "system", "content": f"Answer questions about this document.\n\n{doc}"},
                    {"role": "user", "content": f"Question {i}: what does sentence {i + 1} of the document say?"},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(questions)
    ]


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write chat.jsonl and ids.jsonl (the same prompts as token ids), in a child so this process stays small."""
    code = (
        "import json,sys; sys.path.insert(0, sys.argv[1]);"
        "from bench.lib.models import load_bench_model;"
        "from omlx_jobs.jobs.formats import CHAT_URL;"
        "m = load_bench_model(sys.argv[2]); out = [];"
        "lines = [json.loads(x) for x in open(sys.argv[3])];"
        "ids = [m.encode(CHAT_URL, x['body']) for x in lines];"
        "[out.append({'custom_id': x['custom_id'], 'method': 'POST', 'url': '/v1/completions', 'body': {'prompt': t, "
        "'max_tokens': x['body']['max_tokens'], 'temperature': 0}}) for x, t in zip(lines, ids)];"
        "open(sys.argv[4], 'w').write(''.join(json.dumps(o) + chr(10) for o in out));"
        "print(json.dumps({'prompt_tokens': [len(t) for t in ids]}))"
    )
    chat = work / "chat.jsonl"
    lines = chat_lines(document(args.doc_words), args.questions, args.max_tokens)
    chat.write_text("".join(json.dumps(x) + "\n" for x in lines))
    if args.model == "tiny":  # the tiny model's folder must outlive the prepare step: build it once here
        args.model = str(tiny_model(work))
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), args.model, str(chat), str(work / "ids.jsonl")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(f"prepare failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_model(work: Path) -> Path:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path;"
        "from tests.tiny_model import build_tiny_model; print(build_tiny_model(Path(sys.argv[2]), context_length=8192))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), str(work / "tiny")], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"tiny model failed:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def run_form(args: argparse.Namespace, form: str, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """One `omlx-jobs run` process on FORM's lines: wall seconds and its own peak RSS."""
    cmd = [omlx_cli(), "run", str(work / f"{form}.jsonl"), "--model", args.model, "--batch-size", str(args.batch)]
    cmd += ["-o", str(work / f"{form}-out.jsonl"), "--db", str(work / f"{form}.db"), "--force"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    err = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{form} failed:\n{err[-2000:]}")
    with open(work / f"{form}-out.jsonl") as fh:
        texts = [json.loads(x)["response"]["body"]["choices"][0] for x in fh]
    return {
        "form": form,
        "seconds": round(seconds, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "outputs": [c.get("message", {}).get("content", c.get("text")) for c in texts],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE")
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--doc-words", type=int, default=1870, help="about 2,100 tokens with SmolLM2's tokenizer")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--forms", default="chat,ids")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokens = prepare(args, work)["prompt_tokens"]
        print(
            f"model {args.model}; {args.questions} questions, prompts {min(tokens)}-{max(tokens)} tokens, "
            f"{args.max_tokens} out, batch {args.batch}; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        rows = []
        for form in args.forms.split(","):
            rows.append(run_form(args, form, work, env))
            print(f"  {form:5} {rows[-1]['seconds']:8.2f} s  peak RSS {rows[-1]['peak_rss_mb']:8.1f} MB", flush=True)
    by = {r["form"]: r for r in rows}
    if "chat" in by and "ids" in by:
        same = sum(a == b for a, b in zip(by["chat"]["outputs"], by["ids"]["outputs"], strict=True))
        ratio = by["chat"]["peak_rss_mb"] / by["ids"]["peak_rss_mb"]
        print(f"chat / ids peak RSS {ratio:.2f}x; outputs equal {same}/{len(tokens)}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        for r in rows:
            r["outputs"] = r["outputs"][:4]
        args.json.write_text(json.dumps({"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
