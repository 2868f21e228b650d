"""selfspec.utils.timing: the interleaved timing harness shared by evaluation and training's validation."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding.stats import pool_stats
from selfspec.utils.timing import rotation, run_interleaved, timed


def test_rotation() -> None:
    assert [rotation(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_run_interleaved_order_warmup_and_results() -> None:
    log: list = []

    def method(name):
        def call(item):
            log.append((name, item))
            return f"{name}:{item}"
        return call

    streamed: list = []
    out = run_interleaved({"x": method("x"), "y": method("y")}, [10, 20, 30],
                          warmup=lambda name: log.append((name, "warm")),
                          on_result=lambda name, i, r: streamed.append((i, r)))
    assert log == [("x", "warm"), ("y", "warm"), ("x", 10), ("y", 10), ("y", 20), ("x", 20), ("x", 30), ("y", 30)]
    assert out == [{"x": "x:10", "y": "y:10"}, {"y": "y:20", "x": "x:20"}, {"x": "x:30", "y": "y:30"}]
    assert [list(d) for d in out] == [["x", "y"], ["y", "x"], ["x", "y"]]  # in the order they ran
    assert streamed == [(0, "x:10"), (0, "y:10"), (1, "y:20"), (1, "x:20"), (2, "x:30"), (2, "y:30")]
    assert run_interleaved({"x": method("x")}, []) == []


def test_timed() -> None:
    out, seconds = timed(lambda: sum(range(1000)), torch.device("cpu"))
    assert out == 499500 and seconds > 0


def test_pool_stats_sums_counts_and_recomputes_rates() -> None:
    a = {"strategy": "s", "new_tokens": 6, "verify_steps": 3, "drafted": 6, "accepted": 3, "seconds": 1.0,
         "draft_s": 0.25, "drafted_per_position": [3, 2, 1], "accepted_per_position": [2, 1, 0]}
    b = {"strategy": "t", "new_tokens": 2, "verify_steps": 1, "drafted": 1, "accepted": 1, "seconds": 3.0,
         "drafted_per_position": [1], "accepted_per_position": [1]}
    p = pool_stats([a, b])
    assert p["strategy"] == "s" and p["new_tokens"] == 8 and p["verify_steps"] == 4 and p["draft_s"] == 0.25
    assert p["tau"] == 2.0 and p["accept_rate"] == pytest.approx(4 / 7) and p["tokens_per_s"] == 2.0
    assert p["drafted_per_position"] == [4, 2, 1] and p["accepted_per_position"] == [3, 1, 0]
    assert p["accept_rate_per_position"] == [0.75, 0.5, 0.0]
    # no drafts (autoregressive, HF generate): no rate rather than 0
    none = pool_stats([{"new_tokens": 3, "verify_steps": 3, "drafted": 0, "accepted": 0, "seconds": 0.0}])
    assert none["accept_rate"] is None and none["accept_rate_per_position"] == [] and none["tokens_per_s"] == 0.0
