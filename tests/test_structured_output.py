"""The standalone proof before the engine: mlx-lm's BatchGenerator with our logits processors on the tiny random
model, which writes junk when unconstrained (a hard case).

- json_schema: every output parses and validates (jsonschema), for nested objects, enums, arrays, required
  fields, anyOf/null, $ref and a recursive schema, greedy and sampled, and ends with finish_reason stop;
- json_object: every output that stops is a JSON object, and every other one was cut by max_tokens (length);
- the batched path (one BatchLogits call per step, in a plain decode loop) gives valid outputs too;
- returned logprobs equal a log-softmax of the model's logits for the same tokens (a plain forward pass),
  batched and single, with and without a grammar, and top_logprobs are sorted and consistent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.response_format import JSON_OBJECT_SCHEMA, ResponseFormat
from omlx_jobs.worker.extras.grammar import GrammarCache, GrammarTokenizer, model_eos_ids
from omlx_jobs.worker.extras.logits import BatchLogits, RowLogits, log_softmax, logits_width, row_logits
from omlx_jobs.worker.extras.logprobs import TokenLogprob, step_logprobs

SCHEMAS = json.loads((Path(__file__).parent / "data/schemas/schemas.json").read_text())["schemas"]
JSON_OBJECT = ResponseFormat("json_object", json.dumps(JSON_OBJECT_SCHEMA))


@pytest.fixture(scope="module")
def grammar(tiny_loaded):  # type: ignore[no-untyped-def]
    width = logits_width(tiny_loaded.model)
    tok = GrammarTokenizer.build(
        tiny_loaded.tokenizer, width, model_eos_ids(tiny_loaded.tokenizer, tiny_loaded.config, width)
    )
    return tok, GrammarCache(tok)


def schema_format(spec: dict[str, Any]) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(spec["schema"]))


def generate(
    loaded: Any,
    prompts: list[list[int]],
    rows: list[RowLogits],
    eos: frozenset[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    batch: int = 32,
) -> list[dict[str, Any]]:
    """Run BatchGenerator with each row's processors; per row: tokens (EOS left out), finish reason, and the
    logprob vectors each token was sampled from (the tap's, else BatchGenerator's)."""
    mx.random.seed(0)
    gen = BatchGenerator(loaded.model, stop_tokens=[[t] for t in eos], completion_batch_size=batch)
    samplers = [make_sampler(temp=temperature)] * len(prompts) if temperature else None
    uids = gen.insert(
        prompts,
        max_tokens=[max_tokens] * len(prompts),
        logits_processors=[r.processors for r in rows],
        samplers=samplers,
    )
    out = {u: {"tokens": [], "finish": None, "vectors": [], "sampled": []} for u in uids}
    by_uid = dict(zip(uids, zip(prompts, rows, strict=True), strict=True))
    while any(o["finish"] is None for o in out.values()):
        for r in gen.next()[1]:
            o = out[r.uid]
            prompt, row = by_uid[r.uid]
            position = len(prompt) + len(o["sampled"])
            o["sampled"].append(r.token)
            vector = row.tap.take(position) if row.tap is not None else r.logprobs
            assert vector is not None, "the tap recorded every step"
            o["vectors"].append(vector)
            if r.token not in eos:
                o["tokens"].append(r.token)
            o["finish"] = r.finish_reason
    gen.close()
    return [out[u] for u in uids]


def prompts_for(loaded: Any, n: int) -> list[list[int]]:
    return [loaded.tokenizer.encode(f"request {i}: extract the record as JSON") for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_parses_and_validates(tiny_loaded, grammar, temperature: float) -> None:  # type: ignore[no-untyped-def]
    tok, cache = grammar
    specs = [SCHEMAS[i % len(SCHEMAS)] for i in range(40)]
    rows = [
        row_logits(OutputParams(response_format=schema_format(s)), grammars=cache, vocab_size=tok.vocab_size)
        for s in specs
    ]
    results = generate(
        tiny_loaded, prompts_for(tiny_loaded, len(specs)), rows, tok.eos_ids, max_tokens=1024, temperature=temperature
    )
    for spec, row, res in zip(specs, rows, results, strict=True):
        text = tiny_loaded.tokenizer.decode(res["tokens"])
        assert res["finish"] == "stop", (spec["name"], len(res["tokens"]), text[:200])
        assert res["sampled"][-1] in tok.eos_ids
        jsonschema.validate(json.loads(text), spec["schema"])
        assert row.constraint is not None and row.constraint.is_accepting and row.constraint.error is None
    # The junk is real: unconstrained, the same model writes no JSON at all.
    plain = generate(
        tiny_loaded, prompts_for(tiny_loaded, 8), [RowLogits() for _ in range(8)], tok.eos_ids, max_tokens=64
    )
    assert not any(_parses(tiny_loaded.tokenizer.decode(r["tokens"])) for r in plain)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_json_object_outputs_parse_or_were_cut_by_max_tokens(tiny_loaded, grammar) -> None:  # type: ignore[no-untyped-def]
    tok, cache = grammar
    n, max_tokens = 24, 400
    rows = [
        row_logits(OutputParams(response_format=JSON_OBJECT), grammars=cache, vocab_size=tok.vocab_size)
        for _ in range(n)
    ]
    results = generate(
        tiny_loaded, prompts_for(tiny_loaded, n), rows, tok.eos_ids, max_tokens=max_tokens, temperature=1.0
    )
    stopped = 0
    for res in results:
        text = tiny_loaded.tokenizer.decode(res["tokens"])
        if res["finish"] == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict), text[:200]
        else:
            assert res["finish"] == "length" and len(res["sampled"]) == max_tokens
    assert stopped >= n // 2, "most sampled objects close well within the budget"


def test_a_cut_output_reports_length(tiny_loaded, grammar) -> None:  # type: ignore[no-untyped-def]
    tok, cache = grammar
    spec = next(s for s in SCHEMAS if s["name"] == "invoice")  # far longer than 12 tokens
    rows = [row_logits(OutputParams(response_format=schema_format(spec)), grammars=cache, vocab_size=tok.vocab_size)]
    (res,) = generate(tiny_loaded, prompts_for(tiny_loaded, 1), rows, tok.eos_ids, max_tokens=12)
    assert res["finish"] == "length" and len(res["tokens"]) == 12
    assert rows[0].constraint is not None and not rows[0].constraint.is_accepting


def test_one_batch_call_per_step_gives_valid_outputs(tiny_loaded, grammar) -> None:  # type: ignore[no-untyped-def]
    """The batched shape in a plain decode loop (no BatchGenerator): every row valid, ended by EOS."""
    tok, cache = grammar
    specs = [SCHEMAS[i % len(SCHEMAS)] for i in range(10)]
    rows = [
        row_logits(
            OutputParams(response_format=schema_format(s)), grammars=cache, vocab_size=tok.vocab_size, batched=True
        )
        for s in specs
    ]
    prompt = tiny_loaded.tokenizer.encode("extract the record as JSON")
    kv = make_prompt_cache(tiny_loaded.model)
    logits = tiny_loaded.model(mx.array([prompt] * len(specs)), cache=kv)[:, -1, :]
    batch, outs, done = BatchLogits(tok), [[] for _ in specs], [False] * len(specs)
    last: list[int | None] = [None] * len(specs)
    for _ in range(1024):
        live = [r if not d else None for r, d in zip(rows, done, strict=True)]
        picked = mx.argmax(
            batch.apply(logits, live, [t if not d else None for t, d in zip(last, done, strict=True)]), axis=-1
        )
        last = picked.tolist()
        for i, t in enumerate(last):
            if not done[i]:
                done[i] = t in tok.eos_ids
                if not done[i]:
                    outs[i].append(t)
        if all(done):
            break
        logits = tiny_loaded.model(picked[:, None], cache=kv)[:, -1, :]
    assert all(done)
    for spec, out in zip(specs, outs, strict=True):
        jsonschema.validate(json.loads(tiny_loaded.tokenizer.decode(out)), spec["schema"])


def reference(model: Any, prompt: list[int], sampled: list[int]) -> np.ndarray:
    """Log-softmax of the model's logits at each sampled token's position, from one plain forward pass."""
    seq = mx.array([prompt + sampled[:-1]])
    lp = log_softmax(model(seq)[0].astype(mx.float32))
    return np.array(lp[len(prompt) - 1 :])


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("constrained", [False, True])
def test_logprobs_equal_a_plain_forward_pass(tiny_loaded, grammar, batch: int, constrained: bool) -> None:  # type: ignore[no-untyped-def]
    tok, cache = grammar
    top = 5
    specs = [SCHEMAS[i % len(SCHEMAS)] for i in range(batch)]
    rows = [
        row_logits(
            OutputParams(response_format=schema_format(s) if constrained else None, logprobs=True, top_logprobs=top),
            grammars=cache,
            vocab_size=tok.vocab_size,
        )
        for s in specs
    ]
    prompts = [p[: 6 + i] for i, p in enumerate(prompts_for(tiny_loaded, batch))]  # unequal lengths: padding
    results = generate(tiny_loaded, prompts, rows, tok.eos_ids, max_tokens=24, temperature=1.0)
    for prompt, res in zip(prompts, results, strict=True):
        got: list[TokenLogprob] = step_logprobs(res["vectors"], res["sampled"], [top] * len(res["sampled"]))
        want = reference(tiny_loaded.model, prompt, res["sampled"])
        assert len(got) == len(want) == len(res["sampled"])
        for t, tl, row in zip(res["sampled"], got, want, strict=True):
            assert tl.token == t
            assert tl.logprob == pytest.approx(float(row[t]), abs=2e-4)
            ids = [a for a, _ in tl.top]
            assert [b for _, b in tl.top] == sorted((b for _, b in tl.top), reverse=True)
            assert set(ids) == set(np.argsort(-row)[:top].tolist()) or _tied(row, ids, top)
            assert all(b == pytest.approx(float(row[a]), abs=2e-4) for a, b in tl.top)
            if t in ids:
                assert dict(tl.top)[t] == tl.logprob, "the chosen token reads the same in top_logprobs"


def _tied(row: np.ndarray, ids: list[int], top: int) -> bool:
    """Near-equal values at the cut may come out in either order between two code paths."""
    cut = np.sort(row)[::-1][top - 1]
    return all(row[i] >= cut - 2e-4 for i in ids)
