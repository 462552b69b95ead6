"""Logprobs in OpenAI's formats, rendered from the stored form that worker/logprobs.py writes. Pure logic.

Stored: {"v": 1, "choices": [[entry, ...], ...], "prompt": [entry, ...] (echo only)}, where an entry is
[piece, logprob] or [piece, logprob, [[piece, logprob], ...]] and a piece is a token's text, or the list of
its bytes when they are not valid UTF-8 on their own (then the token reads as "\\xe2\\x80", as OpenAI's do).
"""

from __future__ import annotations

import codecs
from typing import Any

Entry = list[Any]


def _text_and_bytes(piece: str | list[int]) -> tuple[str, bytes]:
    if isinstance(piece, str):
        return piece, piece.encode("utf-8")
    raw = bytes(piece)
    return raw.decode("utf-8", errors="backslashreplace"), raw


def _alternatives(entry: Entry) -> list[Entry]:
    return entry[2] if len(entry) > 2 and entry[2] is not None else []


def chat_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """A chat choice's `logprobs`: content[] with token, logprob, bytes and top_logprobs[], most likely first."""
    content = []
    for entry in entries:
        text, raw = _text_and_bytes(entry[0])
        top = []
        for piece, lp in _alternatives(entry):
            t, b = _text_and_bytes(piece)
            top.append({"token": t, "logprob": lp, "bytes": list(b)})
        content.append({"token": text, "logprob": entry[1], "bytes": list(raw), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs and text_offset.

    With echo, `entries` starts with the prompt's tokens (the first one's logprob and alternatives are null).
    top_logprobs[i] holds the requested alternatives and always the chosen token (so up to logprobs + 1 keys,
    as OpenAI's). text_offset[i] is where token i starts in the choice's text, in characters.
    """
    tokens, logprobs, tops, offsets = [], [], [], []
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    at = 0
    for entry in entries:
        text, raw = _text_and_bytes(entry[0])
        tokens.append(text)
        logprobs.append(entry[1])
        offsets.append(at)
        at += len(decoder.decode(raw))
        if entry[1] is None:  # a prompt's first token: nothing to compare it with
            tops.append(None)
            continue
        top = {}
        for piece, lp in _alternatives(entry):
            top.setdefault(_text_and_bytes(piece)[0], lp)
        top.setdefault(text, entry[1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def choice_logprobs(stored: dict[str, Any] | None, chat: bool) -> list[dict[str, Any] | None]:
    """Each choice's rendered logprobs, or [] when the request asked for none (its choices then say null)."""
    if not stored:
        return []
    prompt = stored.get("prompt") or []
    if chat:
        return [chat_logprobs(c) for c in stored["choices"]]
    return [completion_logprobs(prompt + c) for c in stored["choices"]]
