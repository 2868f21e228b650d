"""Context lookup drafts (prompt lookup decoding, Saxena 2023): continuations copied from earlier in the text.

The last n tokens of the history (prompt + output so far) are looked up among its earlier n-grams, longest n
first (max_ngram down to min_ngram); what followed the most recent earlier occurrence is the proposal. No
model runs: an index from each n-gram to the positions right after its occurrences is updated as tokens
are appended (max_ngram - min_ngram + 1 dict updates per token), so a proposal costs a few dict lookups.
"""

from __future__ import annotations

from collections.abc import Iterable

from selfspec.errors import check


class NgramIndex:
    """Token history with an n-gram index. `extend` appends committed tokens; `propose` / `propose_many` read."""

    max_scan = 64  # propose_many looks at most at this many occurrences (a frequent unigram has thousands)

    def __init__(self, tokens: Iterable[int] = (), min_ngram: int = 1, max_ngram: int = 3):
        check(isinstance(min_ngram, int) and min_ngram >= 1, f"decode.lookup_min_ngram={min_ngram}: must be an integer >= 1")
        check(isinstance(max_ngram, int) and max_ngram >= min_ngram,
              f"decode.lookup_max_ngram={max_ngram}: must be an integer >= lookup_min_ngram ({min_ngram})")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # n-gram (tuple) -> positions right after its occurrences, oldest first. An n-gram is indexed only once
        # a token follows it, so the history's own suffix never matches itself.
        self._after: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks = self.tokens
        toks.append(int(token))
        end = len(toks) - 1  # the n-grams ending just before the new token now have a continuation
        for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
            self._after.setdefault(tuple(toks[end - n : end]), []).append(end)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a stop string cut the output)."""
        if n >= len(self.tokens):
            return
        kept = self.tokens[:n]
        self.tokens, self._after = [], {}
        self.extend(kept)

    def _matches(self):
        """(n, start of continuation) for every earlier occurrence of the history's last n tokens: longest n
        first, most recent first within an n."""
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            for pos in reversed(self._after.get(tuple(toks[len(toks) - n :]), ())):
                yield n, pos

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix ([] if none)."""
        if k <= 0:
            return []
        for _, pos in self._matches():
            return self.tokens[pos : pos + k]
        return []

    def propose_many(self, k: int, branches: int) -> list[list[int]]:
        """Up to `branches` distinct continuations of up to k tokens (for tree branches), best first: longest
        matching n-gram, then most recent. A continuation that is a prefix of one already taken is skipped
        (its tokens are in the tree already); one that extends a branch taken replaces it, and the scan goes on
        while a branch is shorter than k (the most recent match of a repetition runs into the end of the history)."""
        out: list[list[int]] = []
        if k <= 0 or branches <= 0:
            return out
        for seen, (_, pos) in enumerate(self._matches()):
            if seen == self.max_scan:
                break
            cont = self.tokens[pos : pos + k]
            if any(c[: len(cont)] == cont for c in out):
                continue
            longer = [i for i, c in enumerate(out) if cont[: len(c)] == c]
            if longer:  # a longer continuation of a branch already taken takes its place
                out[longer[0]] = cont
            elif len(out) < branches:
                out.append(cont)
            if len(out) == branches and all(len(c) == k for c in out):
                break
        return out
