"""Grammar libraries side by side: compile time per schema (cold, cached) and mask fill per step at batch 32.

Measured once to choose the library (issue 12); omlx-jobs ships llguidance only. The others are installed
into a scratch folder, never into the project:

    pip install --target /tmp/gcand --no-deps xgrammar==0.2.8 apache-tvm-ffi outlines-core==0.2.14
    PYTHONPATH=/tmp/gcand .venv/bin/python bench/decisions/grammar_libs.py \\
        --model gguf:$(.venv/bin/omlx-jobs models smollm2-path)

xgrammar's Python package imports torch at the top (for its tensors and kernels) although its C++ core takes
any DLPack array; torch is not installed here, so an import-only stand-in lets the core run on numpy bitmasks.
That measures xgrammar's compiler and matcher as they are; installing it for real would still pull in torch.

Every library gets the same tokenizer bytes, the same schemas (tests/data/schemas/schemas.json, each with a
valid example) and the same token sequences: each row of the batch steps through its schema's example,
tokenized by the model's tokenizer, and starts over at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ and tests/ as packages

import numpy as np

SCHEMAS = json.loads((Path(__file__).resolve().parents[2] / "tests/data/schemas/schemas.json").read_text())["schemas"]


def _summary(
    init: float, cold: Any, cached: Any, consume: list[float], fill_par: list[float], fill_seq: list[float]
) -> dict[str, Any]:
    """One library's figures: tokenizer set-up, compile times, and per-step consume and mask-fill costs."""
    return {
        "tokenizer_init_ms": _ms(init),
        "compile_cold_ms": cold,
        "compile_cached_ms": cached,
        "consume_ms_per_step": _ms(statistics.mean(consume)),
        "fill_ms_per_step": {
            "batch_parallel": _ms(statistics.mean(fill_par)),
            "batch_parallel_p90": _ms(sorted(fill_par)[int(0.9 * len(fill_par))]),
            "row_by_row": _ms(statistics.mean(fill_seq)),
        },
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Rows:
    """Batch rows: row i follows schema i % len(SCHEMAS), stepping through that schema's example tokens."""

    def __init__(self, sequences: list[list[int]], batch: int) -> None:
        self.sequences = sequences
        self.schema_of = [i % len(sequences) for i in range(batch)]
        # Stagger the starting points so rows are at different places in their documents.
        self.pos = [(i * 7) % len(sequences[self.schema_of[i]]) for i in range(batch)]

    def prefix(self, row: int) -> list[int]:
        """The tokens a row has consumed before the first measured step."""
        return self.sequences[self.schema_of[row]][: self.pos[row]]

    def advance(self) -> list[tuple[int, int, bool]]:
        """(row, token, restart) for each row: the token the row consumes now; restart means reset first."""
        out = []
        for row, s in enumerate(self.schema_of):
            seq = self.sequences[s]
            restart = self.pos[row] >= len(seq)
            if restart:
                self.pos[row] = 0
            out.append((row, seq[self.pos[row]], restart))
            self.pos[row] += 1
        return out


# ---- llguidance -------------------------------------------------------------------------------------------


def bench_llguidance(tokenizer_json: str, n_vocab: int, eos: list[int], sequences, args) -> dict[str, Any]:
    import llguidance as llg
    import llguidance.numpy as lln

    init, tok = _time(lambda: llg.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos))
    compile_cold, compile_cached, templates = {}, {}, []
    for spec in SCHEMAS:
        grammar = llg.LLMatcher.grammar_from_json_schema(spec["schema"])

        def build(grammar: str = grammar) -> Any:
            m = llg.LLMatcher(tok, grammar)
            m.compute_bitmask()  # the lexer is built lazily: the first mask pays for it
            assert not m.is_error(), m.get_error()
            return m

        t_cold, template = _time(build)
        # Cached: the template matcher is kept (keyed by schema hash) and each request takes a copy.
        t_cached = min(_time(template.deep_copy)[0] for _ in range(5))
        t_rebuild = min(_time(build)[0] for _ in range(3))
        compile_cold[spec["name"]] = _ms(t_cold)
        compile_cached[spec["name"]] = {"deep_copy": _ms(t_cached), "rebuild_same_schema": _ms(t_rebuild)}
        templates.append(template)

    executor = llg.LLExecutor(num_threads=args.threads)
    rows = Rows(sequences, args.batch)
    # Two identical sets of matchers, one per fill method: a matcher remembers the mask of its current state,
    # so filling the same matcher twice would time the second fill as a cache hit.
    sets = [[templates[s].deep_copy() for s in rows.schema_of] for _ in range(2)]
    for matchers in sets:
        for row, m in enumerate(matchers):
            assert m.consume_tokens(rows.prefix(row)), m.get_error()
    bitmask = lln.allocate_token_bitmask(args.batch, n_vocab)
    fill_par, fill_seq, consume = [], [], []
    for step in range(args.steps):
        advance = rows.advance()
        for matchers in sets:
            t0 = time.perf_counter()
            for row, token, restart in advance:
                if restart:
                    matchers[row].reset()
                matchers[row].consume_token(token)
            consume.append(time.perf_counter() - t0)
        par, seq = sets if step % 2 == 0 else sets[::-1]  # alternate which set is filled first
        t_par, _ = _time(
            lambda par=par: lln.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(par)], bitmask)
        )
        t_seq, _ = _time(lambda seq=seq: [lln.fill_next_token_bitmask(m, bitmask, i) for i, m in enumerate(seq)])
        fill_par.append(t_par)
        fill_seq.append(t_seq)
        errors = [m.get_error() for m in sets[0] + sets[1] if m.is_error()]
        assert not errors, errors[0][:300]
    return _summary(init, compile_cold, compile_cached, consume, fill_par, fill_seq)


# ---- xgrammar ---------------------------------------------------------------------------------------------


def _import_xgrammar() -> Any:
    import tvm_ffi  # noqa: F401  (imported first, while torch is absent, so it takes its no-torch path)

    stub = types.ModuleType("torch")
    np_types = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "bool": np.bool_, "int8": np.int8}
    stub.__dict__.update(np_types)
    stub.Tensor = stub.LongTensor = stub.FloatTensor = type("Tensor", (), {})
    stub.tensor = lambda v, dtype=None: np.array(v, dtype=dtype)
    stub.full = lambda shape, v, dtype=None: np.full(shape, v, dtype=dtype)
    stub.__getattr__ = lambda name: stub.Tensor  # type: ignore[method-assign]
    sys.modules.setdefault("torch", stub)
    import xgrammar

    return xgrammar


def bench_xgrammar(hf_tokenizer: Any, n_vocab: int, eos: list[int], sequences, args) -> dict[str, Any]:
    xgr = _import_xgrammar()
    init, info = _time(lambda: xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=n_vocab, stop_token_ids=eos))
    compiler = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=True)
    compile_cold, compile_cached, compiled = {}, {}, []
    for spec in SCHEMAS:
        text = json.dumps(spec["schema"])
        t_cold, cg = _time(lambda text=text: compiler.compile_json_schema(text))
        t_cached = min(_time(lambda text=text: compiler.compile_json_schema(text))[0] for _ in range(5))
        t_matcher = min(_time(lambda cg=cg: xgr.GrammarMatcher(cg))[0] for _ in range(5))
        compile_cold[spec["name"]] = _ms(t_cold)
        compile_cached[spec["name"]] = {"compile_cache_hit": _ms(t_cached), "new_matcher": _ms(t_matcher)}
        compiled.append(cg)

    rows = Rows(sequences, args.batch)
    sets = [[xgr.GrammarMatcher(compiled[s]) for s in rows.schema_of] for _ in range(2)]  # as for llguidance
    for matchers in sets:
        for row, m in enumerate(matchers):
            assert all(m.accept_token(t) for t in rows.prefix(row)), row
    bitmask = np.full((args.batch, (n_vocab + 31) // 32), -1, dtype=np.int32)
    batch = xgr.BatchGrammarMatcher(max_threads=args.threads)
    fill_par, fill_seq, consume = [], [], []
    for step in range(args.steps):
        advance = rows.advance()
        for matchers in sets:
            t0 = time.perf_counter()
            for row, token, restart in advance:
                if restart:
                    matchers[row].reset()
                assert matchers[row].accept_token(token), (row, token)
            consume.append(time.perf_counter() - t0)
        par, seq = sets if step % 2 == 0 else sets[::-1]
        fill_par.append(_time(lambda par=par: batch.batch_fill_next_token_bitmask(par, bitmask))[0])
        fill_seq.append(_time(lambda seq=seq: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(seq)])[0])
    return _summary(init, compile_cold, compile_cached, consume, fill_par, fill_seq)


# ---- outlines-core ----------------------------------------------------------------------------------------


def bench_outlines(token_bytes: list[bytes], specials: set[int], eos: int, sequences, args) -> dict[str, Any]:
    import outlines_core as oc

    def vocab() -> Any:
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if i not in specials and b:
                table.setdefault(b, []).append(i)
        return oc.Vocabulary(eos, table)

    init, vocabulary = _time(vocab)
    compile_cold, compile_cached, indexes = {}, {}, {}
    for spec in SCHEMAS:
        try:
            regex = oc.json_schema.build_regex_from_schema(json.dumps(spec["schema"]))
            t_cold, index = _time(lambda regex=regex: oc.Index(regex, vocabulary))
        except Exception as exc:  # recursive schemas have no regular expression
            compile_cold[spec["name"]] = f"unsupported: {str(exc).splitlines()[0][:80]}"
            continue
        compile_cold[spec["name"]] = _ms(t_cold)
        compile_cached[spec["name"]] = {
            "new_guide": _ms(min(_time(lambda index=index: oc.Guide(index))[0] for _ in range(5)))
        }
        indexes[spec["name"]] = index

    usable = [i for i, spec in enumerate(SCHEMAS) if spec["name"] in indexes]
    rows = Rows([sequences[i] for i in usable], args.batch)
    guides = [oc.Guide(indexes[SCHEMAS[usable[s]]["name"]]) for s in rows.schema_of]
    for row, g in enumerate(guides):
        for t in rows.prefix(row):
            g.advance(t, return_tokens=False)
    bitmask = np.full((args.batch, (len(token_bytes) + 31) // 32), -1, dtype=np.int32)
    fill_seq, consume = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for row, token, restart in rows.advance():
            if restart:
                guides[row].reset()
            guides[row].advance(token, return_tokens=False)
        consume.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i, g in enumerate(guides):  # no batched fill: one row at a time
            g.write_mask_into(bitmask[i].ctypes.data, bitmask.shape[1], 4)
        fill_seq.append(time.perf_counter() - t0)
    return {
        "tokenizer_init_ms": _ms(init),
        "compile_cold_ms": compile_cold,
        "compile_cached_ms": compile_cached,
        "consume_ms_per_step": _ms(statistics.mean(consume)),
        "fill_ms_per_step": {"row_by_row": _ms(statistics.mean(fill_seq))},
        "schemas_in_fill": [SCHEMAS[i]["name"] for i in usable],
    }


# ---- driver -----------------------------------------------------------------------------------------------


def _tokenizer(ref: str) -> tuple[str, Any, int, list[int]]:
    """tokenizer.json text, the HF tokenizer, the model's vocabulary size and its EOS ids."""
    from transformers import AutoTokenizer

    if ref == "tiny":
        from tests.tiny_model import build_tiny_model

        path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    else:
        from omlx_jobs.worker.models.paths import resolve_model_path

        path = resolve_model_path(ref)
    config = json.loads((path / "config.json").read_text())
    hf = AutoTokenizer.from_pretrained(str(path))
    eos = config.get("eos_token_id")
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), hf.eos_token_id} - {None})
    return (path / "tokenizer.json").read_text(), hf, int(config["vocab_size"]), eos_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, or a model reference (gguf:FILE, a directory)")
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import llguidance as llg

    tokenizer_json, hf, n_vocab, eos = _tokenizer(args.model)
    lltok = llg.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
    sequences = [
        lltok.tokenize_str(json.dumps(spec["example"], separators=(",", ":"), ensure_ascii=False)) for spec in SCHEMAS
    ]
    token_bytes = [lltok.decode_bytes([i]) for i in range(n_vocab)]
    specials = {i for i in range(n_vocab) if lltok.is_special_token(i)}
    report: dict[str, Any] = {"model": args.model, "vocab": n_vocab, "batch": args.batch, "steps": args.steps}
    for lib in args.libs.split(","):
        try:
            if lib == "llguidance":
                report[lib] = bench_llguidance(tokenizer_json, n_vocab, eos, sequences, args)
            elif lib == "xgrammar":
                report[lib] = bench_xgrammar(hf, n_vocab, eos, sequences, args)
            elif lib == "outlines":
                report[lib] = bench_outlines(token_bytes, specials, eos[0], sequences, args)
        except ImportError as exc:
            report[lib] = f"not installed: {exc}"
        print(lib, json.dumps(report[lib], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
