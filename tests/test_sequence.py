"""Sequences, stop strings, result collection, prompt keys and the typed store row, on plain data. No MLX."""

from __future__ import annotations

import pytest

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.store.rows import RESULT_COLUMNS, CompletionRow
from omlx_jobs.worker.engine.results import Choice, ItemResult, RequestFailure, completion_row
from omlx_jobs.worker.engine.sequence import Collector, SequenceState, WorkItem
from omlx_jobs.worker.engine.stopping import StopStrings, final_text
from omlx_jobs.worker.prompts import (
    MediaSpan,
    Prompt,
    common_prefix,
    key_prefix,
    key_tokens,
    media_values,
    positions,
    token_key,
)


class CharDetokenizer:
    """A streaming detokenizer where token t is the character chr(t)."""

    def __init__(self) -> None:
        self.text = ""

    def reset(self) -> None:
        self.text = ""

    def add_token(self, token: int) -> None:
        self.text += chr(token)


def codes(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_consume_keeps_tokens_until_a_stop_string_or_the_backends_finish() -> None:
    seq = SequenceState(0, 0, StopStrings(("END",), CharDetokenizer()))
    assert seq.consume(codes("ab"), None) is None
    assert seq.consume(codes("cEN"), None) is None
    assert seq.consume(codes("Dxy"), None) == "stop"  # completed by "D"; "xy" of the same step is dropped
    assert seq.tokens == codes("abcEND") and seq.generated == 6
    eos = SequenceState(0, 0)
    assert eos.consume([5, 6], "stop") == "stop"  # the last token is end-of-sequence: counted, not kept
    assert eos.tokens == [5] and eos.generated == 2
    assert SequenceState(0, 0).consume([5], "length") == "length"


def test_final_text_cuts_before_the_first_stop() -> None:
    assert final_text("one. two! three", (".", "!"), "length") == ("one", "stop")
    assert final_text("no stop here", ("END",), "length") == ("no stop here", "length")


def test_collector_hands_out_an_item_once_all_its_choices_finish_then_forgets_it() -> None:
    work = WorkItem("req-1", [1, 2, 3], SamplingParams(n=2))
    c = Collector()
    c.start(0, work, cached=3)
    c.start(0, work, cached=2)  # the item counts its least-cached choice
    c.finish(0, 1, Choice("b", "stop", 1, [9]))
    assert c.take() == [] and 0 in c and len(c) == 1
    c.finish(0, 0, Choice("a", "length", 4, [8]))
    (result,) = c.take()
    assert [ch.text for ch in result.choices] == ["a", "b"]  # in choice order
    assert (result.key, result.prompt_tokens, result.cached_tokens, result.completion_tokens) == ("req-1", 3, 2, 5)
    assert 0 not in c and c.unfinished() == {} and c.take() == []
    assert c.peak == 1


def test_a_failure_is_the_items_result_alone() -> None:
    c = Collector()
    c.start(0, WorkItem("bad", [1], SamplingParams()), cached=0)
    c.start(1, WorkItem("good", [2], SamplingParams()), cached=0)
    c.fail(0, RequestFailure(ErrorCode.ENGINE_ERROR, "boom"))
    (failed,) = c.take()
    assert failed.key == "bad" and failed.error == RequestFailure("engine_error", "boom") and failed.choices == []
    assert set(c.unfinished()) == {1}
    with pytest.raises(ValueError):
        completion_row(failed)


def test_completion_row_maps_every_result_field() -> None:
    result = ItemResult("k", [Choice("a", "stop", 2, [1]), Choice("b", "length", 3, [2])], 7, 4, 100.0, 101.0)
    row = completion_row(result)
    assert row == CompletionRow(
        id="k",  # type: ignore[arg-type]
        output_text="a",
        finish_reason="stop",
        prompt_tokens=7,
        cached_tokens=4,
        completion_tokens=5,
        more_choices=[{"text": "b", "finish_reason": "length"}],
        started_at=100.0,
    )
    assert set(RESULT_COLUMNS) == {f for f in row.__dataclass_fields__ if f not in ("id", "started_at")}
    with pytest.raises(TypeError):
        CompletionRow(id=1, output_txt="typo", finish_reason="stop", prompt_tokens=1, cached_tokens=0)  # type: ignore[call-arg]


def test_text_keys_order_like_tokens_and_share_prefixes() -> None:
    a, b = [1, 2, 300000], [1, 2, 4]
    assert key_tokens(token_key(a)) == a and positions(token_key(a)) == 3
    assert (token_key(a) < token_key(b)) == (a < b)
    assert common_prefix(token_key(a), token_key(b)) == 2
    assert key_prefix(token_key(a), 2) == token_key([1, 2])
    p = Prompt.from_tokens(a)
    assert len(p) == 3 and p.prefix_key(1) == token_key([1]) and p.media == ()


def test_image_positions_are_keyed_by_the_image_from_its_first_position() -> None:
    text, image = [5, 6, 7], [99] * 4  # placeholder token ids where the image goes
    span = MediaSpan(start=3, length=4, digest=b"pixels of cat.png")
    cat = Prompt.with_media(text + image + [8], [span])
    cat_again = Prompt.with_media(text + image + [8], [MediaSpan(3, 4, b"pixels of cat.png")])
    dog = Prompt.with_media(text + image + [8], [MediaSpan(3, 4, b"pixels of dog.png")])
    assert cat.key == cat_again.key  # the same image after the same text: one cache entry
    assert common_prefix(cat.key, dog.key) == 3  # a different image shares only the text before it
    assert common_prefix(cat.key, Prompt.from_tokens(text + image + [8]).key) == 3  # never a token id
    assert cat.tokens == text + image + [8]  # the model still reads the placeholders
    values = media_values(b"x", 4)
    assert len(set(values)) == 4 and all(v >= 1 << 31 for v in values)
