"""The stored logprobs codec (jobs/stored_logprobs.py): what the worker writes is what the output formats read."""

from __future__ import annotations

import json

from omlx_jobs.jobs.stored_logprobs import StoredLogprobs, StoredToken, decode, encode

TOKENS = [
    StoredToken("Hello", -0.25, (("Hello", -0.25), (" world", -1.5))),
    StoredToken([226, 128], -9999.0, (([226, 128], -9999.0),)),
]
PROMPT = [StoredToken("Hi", None), StoredToken("!", -1.0, (("!", -1.0),))]


def test_entries_round_trip_with_and_without_alternatives() -> None:
    entries = encode(TOKENS, with_top=True)
    assert entries == [
        ["Hello", -0.25, [["Hello", -0.25], [" world", -1.5]]],
        [[226, 128], -9999.0, [[[226, 128], -9999.0]]],
    ]
    assert decode(entries) == TOKENS
    plain = encode(TOKENS, with_top=False)
    assert plain == [["Hello", -0.25], [[226, 128], -9999.0]]
    assert [t.top for t in decode(plain)] == [None, None]


def test_a_prompts_first_token_stores_null_alternatives() -> None:
    assert encode(PROMPT, with_top=True)[0] == ["Hi", None, None]
    assert decode(encode(PROMPT, with_top=True)) == PROMPT


def test_the_column_round_trips_through_json() -> None:
    stored = StoredLogprobs([encode(TOKENS, with_top=True), []], encode(PROMPT, with_top=True))
    column = json.loads(json.dumps(stored.to_json(), allow_nan=False))
    assert column["v"] == 1 and list(column) == ["v", "choices", "prompt"]
    assert StoredLogprobs.from_json(column) == stored
    assert "prompt" not in StoredLogprobs([[]]).to_json()
    assert StoredLogprobs.from_json(None) is None
