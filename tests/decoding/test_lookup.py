"""Context lookup drafts (selfspec/decoding/lookup.py): n-gram matches in the history propose continuations."""

from __future__ import annotations

import random

import pytest

from selfspec.decoding.lookup import NgramIndex
from selfspec.errors import SelfSpecError


def brute_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, searched directly: longest n first, most recent earlier occurrence with a continuation."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # occurrences ending before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_most_recent_match():
    idx = NgramIndex([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], min_ngram=1, max_ngram=3)
    assert idx.propose(3) == [5, 7, 1]  # "1 2 3" last seen before "5 7 1"
    assert idx.propose(1) == [5]
    assert idx.propose(0) == []


def test_prefers_the_longest_ngram():
    # the 1-gram "3" last occurred before 8, but the 2-gram "2 3" only before 4
    idx = NgramIndex([2, 3, 4, 5, 3, 8, 6, 2, 3], min_ngram=1, max_ngram=2)
    assert idx.propose(2) == [4, 5]
    assert NgramIndex([2, 3, 4, 5, 3, 8, 6, 2, 3], min_ngram=1, max_ngram=1).propose(2) == [8, 6]


def test_no_match_and_min_ngram():
    assert NgramIndex([1, 2, 3, 4], max_ngram=3).propose(4) == []
    assert NgramIndex([]).propose(2) == []
    assert NgramIndex([5]).propose(2) == []
    idx = NgramIndex([7, 1, 8, 1], min_ngram=2, max_ngram=3)  # only a 1-gram matches: below min_ngram
    assert idx.propose(2) == []


def test_a_continuation_may_run_into_the_end():
    idx = NgramIndex([4, 4, 4], min_ngram=1, max_ngram=2)
    assert idx.propose(5) == [4]  # "4 4" seen at 0..1, followed by the last token only


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_matches_the_definition(seed):
    rng = random.Random(seed)
    idx = NgramIndex(min_ngram=1, max_ngram=4)
    tokens: list[int] = []
    for _ in range(300):
        t = rng.randrange(6)
        tokens.append(t)
        idx.append(t)
        assert idx.propose(5) == brute_propose(tokens, 5, 1, 4)
    assert len(idx) == 300


def test_truncate_forgets_the_cut_tokens():
    idx = NgramIndex([1, 2, 3, 1, 2, 9, 9])
    idx.truncate(5)
    assert idx.tokens == [1, 2, 3, 1, 2] and idx.propose(3) == [3, 1, 2]
    idx.extend([3])
    assert idx.propose(2) == [1, 2]


def test_propose_many_gives_distinct_branches_best_first():
    # "1 2" was followed by 3, by 4 and by 3 again; "2" alone also by 7
    tokens = [1, 2, 3, 0, 2, 7, 0, 1, 2, 4, 0, 1, 2, 3, 5, 0, 1, 2]
    idx = NgramIndex(tokens, min_ngram=1, max_ngram=2)
    many = idx.propose_many(3, branches=4)
    assert many[0] == idx.propose(3) == [3, 5, 0]
    assert many == [[3, 5, 0], [4, 0, 1], [3, 0, 2], [7, 0, 1]]
    assert idx.propose_many(3, branches=2) == many[:2]
    # a continuation that is a prefix of one taken adds nothing; a longer one replaces its prefix in place
    idx2 = NgramIndex([1, 5, 1, 8, 1, 5, 1], min_ngram=1, max_ngram=1)  # after "1": [5, 1] (the end), [8, 1, 5], [5, 1, 8]
    assert idx2.propose_many(3, branches=3) == [[5, 1, 8], [8, 1, 5]]
    assert NgramIndex([1, 5, 1, 5, 1], max_ngram=1).propose_many(3, branches=3) == [[5, 1, 5]]  # one branch, not two


def test_bad_ngram_sizes_fail_with_one_line():
    with pytest.raises(SelfSpecError, match="lookup_min_ngram"):
        NgramIndex(min_ngram=0)
    with pytest.raises(SelfSpecError, match="lookup_max_ngram"):
        NgramIndex(min_ngram=3, max_ngram=2)
