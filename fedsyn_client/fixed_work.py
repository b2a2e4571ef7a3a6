"""Tokenizing under the node's size bound: the bytes a release reads are a public number (issue 45).

A fast tokenizer's time grows with the text it reads, and one that truncates reads the whole text
before it cuts: on this machine, 2,000 BBC articles took 3.5 s to tokenize for a vote where 100
articles and 1,900 empty padding rows took 0.2 s, and Flower sends each reply's ClientApp time to
the server. So under a bound every row a release tokenizes is first cut to ``row_bytes``
(``BYTES_PER_TOKEN`` per token of the window it fills: English text takes 4-5 bytes per token, so
the cut leaves every window a record fills as it was), and the bytes the rows fall short of
``rows x row_bytes`` (short records, padding rows) are tokenized once more as filler, the same way,
and thrown away. A tokenizer takes about as long per byte of filler as per byte of text, so its
time is that of ``rows x row_bytes`` bytes: public inputs only. By hand: no library pads a
tokenizer's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BYTES_PER_TOKEN = 8
_FILLER = "the state of the markets and the weather in the north, as reported this week. "


def row_bytes(tokens: int) -> int:
    """The bytes of text a row of ``tokens`` tokens is cut to."""
    return BYTES_PER_TOKEN * int(tokens)


def cut(text: str, limit: int) -> str:
    """The longest prefix of ``text`` of at most ``limit`` UTF-8 bytes (whole characters only)."""
    return text.encode("utf-8")[:limit].decode("utf-8", "ignore")


def filler(limit: int) -> str:
    """A public text of exactly ``limit`` ASCII bytes: what a padding row reads."""
    return (_FILLER * (limit // len(_FILLER) + 1))[:limit]


def ballast(tokenizer: Any, texts: Sequence[str], rows: int, limit: int, batch: int | None = None) -> int:
    """Tokenize filler for the bytes ``texts`` (each already ``cut`` to ``limit``) fall short of
    ``rows x limit``; the tokens are thrown away. ``batch``: in lists of that many rows, as a
    batched caller tokenizes (None: one row per call, as ``common.lm_loss.encode_examples`` does).
    Returns the filler's bytes."""
    short = rows * limit - sum(len(t.encode("utf-8")) for t in texts)
    if short <= 0 or limit <= 0:
        return 0
    full = filler(limit)
    whole, rest = divmod(short, limit)
    pieces = [full] * whole + ([full[:rest]] if rest else [])
    if batch is None:
        for piece in pieces:
            tokenizer(piece, add_special_tokens=False)
    else:
        for i in range(0, len(pieces), batch):
            tokenizer(pieces[i:i + batch], add_special_tokens=False)
    return short
