"""Which generated texts are usable: pure checks, applied before a text joins the pool.

A small DP-finetuned model sometimes writes nothing, repeats the prompt, loops on a phrase, or
is stopped by the token limit in the middle of a word. Such a text is worth nothing to a user
and, worse, takes a vote and a place in the final set from a usable one. ``generate`` in
``fedsyn_server.synthesis`` asks again for the texts these checks reject, then drops what is
still unusable and counts it (``metrics.json``: ``generation``).

Choices (the paper says nothing here):
- *repetition*: a word 3-gram that occurs 4 or more times, or fewer than half of the text's
  3-grams distinct (texts of 12 or more words); natural news prose does neither within the
  64-256 tokens generated here ("the prime minister" three times is still prose).
- *cut*: a text stopped by the token limit loses its last, possibly partial, word (it is
  trimmed, not dropped); one left without a word is *empty*.
- *prompt-copy*: the text, or its first line, is the prompt's own text (e.g. ``topic: sport``).
- *a table run*: the text's first line must parse as a row of the schema (``unusable_row``);
  the prose checks above do not apply (rows repeat "is" by design).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.rows import Schema

EMPTY, PROMPT_COPY, REPETITION = "empty", "prompt-copy", "repetition"
REASONS = (EMPTY, PROMPT_COPY, REPETITION)
_NGRAM, _MAX_REPEATS, _MIN_DISTINCT, _MIN_WORDS = 3, 4, 0.5, 12


def trim_cut(text: str, hit_limit: bool) -> str:
    """``text`` without its last word when the token limit stopped it (the word may be cut)."""
    text = text.strip()
    if not hit_limit:
        return text
    head, sep, _ = text.rpartition(" ")
    return head.rstrip() if sep else ""


def unusable(text: str, prompt: str) -> str | None:
    """Why ``text`` (generated after ``prompt``) is unusable (one of ``REASONS``), or None."""
    if not text.strip():
        return EMPTY
    norm = _norm(text)
    prompt_norm = _norm(prompt)
    if prompt_norm and (norm == prompt_norm or _norm(text.strip().splitlines()[0]) == prompt_norm):
        return PROMPT_COPY
    words = norm.split()
    grams = [tuple(words[i:i + _NGRAM]) for i in range(len(words) - _NGRAM + 1)]
    if grams:
        counts = Counter(grams)
        if max(counts.values()) >= _MAX_REPEATS:
            return REPETITION
        if len(words) >= _MIN_WORDS and len(counts) / len(grams) < _MIN_DISTINCT:
            return REPETITION
    return None


def unusable_row(text: str, schema: Schema) -> str | None:
    """Why a table run's generated ``text`` is not a row of ``schema`` (the columns a record's text
    holds: ``common.rows.generated_part``), as ``row: <reason>``, or None. Only its first line
    counts (``first_line``): a model may go on to write a second record."""
    from common.rows import RowError, parse

    try:
        parse(first_line(text), schema)
    except RowError as err:
        return f"row: {err.reason}"
    return None


def first_line(text: str) -> str:
    """A table record is one line: what a model writes after it is not part of the row."""
    return text.strip().split("\n", 1)[0].strip()


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())
