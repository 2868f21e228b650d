"""trainer.train_tokens: training draws only from a seeded subset of whole sequences holding >= N answer tokens."""

from __future__ import annotations

import pytest
import torch

from selfspec.errors import SelfSpecError
from selfspec.training.config import TrainerConfig
from selfspec.training.dataset import Sequences
from selfspec.training.loop import training_pool


def _data(resp_lengths):
    pairs = [([1, 2], list(range(3, 3 + n))) for n in resp_lengths]
    targets = [(torch.zeros(n, 2, dtype=torch.long), torch.zeros(n, 2)) for n in resp_lengths]
    return Sequences.from_pairs(pairs, targets, [], [], {})


def test_pool_holds_enough_tokens_and_no_more_sequences_than_needed():
    lengths = [5, 17, 3, 40, 8, 12, 9, 30, 2, 21]
    data = _data(lengths)
    assert torch.equal(training_pool(data, None, 0), torch.arange(len(lengths)))
    for want in (1, 10, 50, 100, sum(lengths), 10_000):
        pool = training_pool(data, want, seed=3)
        got = sum(lengths[i] for i in pool.tolist())
        assert got >= min(want, sum(lengths))
        assert len(set(pool.tolist())) == len(pool)
        # minimal: dropping the last sequence taken (in the seeded order) would fall short
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(3 * 7919 + 17)).tolist()
        taken = order[: len(pool)]
        assert sorted(taken) == pool.tolist()
        if got > want and len(pool) > 1:
            assert sum(lengths[i] for i in taken[:-1]) < want
    assert torch.equal(training_pool(data, 50, 3), training_pool(data, 50, 3))  # deterministic
    assert not torch.equal(training_pool(data, 50, 3), training_pool(data, 50, 4))  # the seed matters


def test_train_tokens_is_validated():
    with pytest.raises(SelfSpecError, match=r"trainer.train_tokens=0: must be an integer >= 1"):
        TrainerConfig(train_tokens=0)
