"""Logprobs in OpenAI's formats, rendered from their stored form (jobs/stored_logprobs.py). Pure logic.

A piece that is a list of bytes (not valid UTF-8 on their own) reads as "\\xe2\\x80", as OpenAI's do.
"""

from __future__ import annotations

import codecs
from typing import Any

from omlx_jobs.jobs.stored_logprobs import Entry, Piece, StoredLogprobs, decode


def _text_and_bytes(piece: Piece) -> tuple[str, bytes]:
    if isinstance(piece, str):
        return piece, piece.encode("utf-8")
    raw = bytes(piece)
    return raw.decode("utf-8", errors="backslashreplace"), raw


def chat_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """A chat choice's `logprobs`: content[] with token, logprob, bytes and top_logprobs[], most likely first."""
    content = []
    for token in decode(entries):
        text, raw = _text_and_bytes(token.piece)
        top = []
        for piece, lp in token.top or ():
            t, b = _text_and_bytes(piece)
            top.append({"token": t, "logprob": lp, "bytes": list(b)})
        content.append({"token": text, "logprob": token.logprob, "bytes": list(raw), "top_logprobs": top})
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
    for token in decode(entries):
        text, raw = _text_and_bytes(token.piece)
        tokens.append(text)
        logprobs.append(token.logprob)
        offsets.append(at)
        at += len(decoder.decode(raw))
        if token.logprob is None:  # a prompt's first token: nothing to compare it with
            tops.append(None)
            continue
        top = {}
        for piece, lp in token.top or ():
            top.setdefault(_text_and_bytes(piece)[0], lp)
        top.setdefault(text, token.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def choice_logprobs(stored: dict[str, Any] | None, chat: bool) -> list[dict[str, Any] | None]:
    """Each choice's rendered logprobs, or [] when the request asked for none (its choices then say null)."""
    logprobs = StoredLogprobs.from_json(stored)
    if logprobs is None:
        return []
    if chat:
        return [chat_logprobs(c) for c in logprobs.choices]
    return [completion_logprobs((logprobs.prompt or []) + c) for c in logprobs.choices]
