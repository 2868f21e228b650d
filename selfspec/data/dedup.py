"""Duplicates and evaluation overlap: what a training prompt set must not contain.

- `normalize(text)`: lower case, words only; two prompts that normalize alike are duplicates.
- `TextNgrams`: the word n-grams of a set of texts (the evaluation prompts). `overlap(text)` is the share of a
  text's n-grams found there, so a training prompt that quotes an evaluation prompt, or carries the same
  article, scores high while one that shares a stock phrase scores low. Texts shorter than n words are
  compared whole.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def normalize(text: str) -> str:
    return " ".join(words(text))


def _h(gram: tuple[str, ...]) -> bytes:
    return hashlib.blake2b(" ".join(gram).encode(), digest_size=8).digest()


class TextNgrams:
    def __init__(self, texts: Iterable[str], n: int = 8):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: must be an integer >= 1")
        self.n = n
        self.grams: set[bytes] = set()
        self.short: set[str] = set()
        self.size = 0
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        w = words(text)
        self.size += 1
        if len(w) < self.n:
            self.short.add(" ".join(w))
        for i in range(len(w) - self.n + 1):
            self.grams.add(_h(tuple(w[i : i + self.n])))

    def overlap(self, text: str) -> float:
        """Share (0..1) of the text's word n-grams that occur in the index (1.0 for a short text equal to an
        indexed one)."""
        w = words(text)
        if len(w) < self.n:
            return 1.0 if " ".join(w) in self.short else 0.0
        grams = [_h(tuple(w[i : i + self.n])) for i in range(len(w) - self.n + 1)]
        return sum(g in self.grams for g in grams) / len(grams)


def dedup(items: list, key=lambda x: x) -> list:
    """Items whose normalized key text was not seen before, in order."""
    seen: set[str] = set()
    out = []
    for item in items:
        k = normalize(key(item))
        if k and k not in seen:
            seen.add(k)
            out.append(item)
    return out
