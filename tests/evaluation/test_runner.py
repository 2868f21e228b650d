"""selfspec.evaluation.runner: methods on a prompt set, interleaved, multi-turn, turn stats merged."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from selfspec.data import PromptItem
from selfspec.decoding.engine import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.evaluation.runner import Method, Renderer, build_methods, merge_turn_stats, run_eval


def test_merge_turn_stats_sums_and_recomputes() -> None:
    a = {"strategy": "s", "new_tokens": 6, "verify_steps": 3, "drafted": 6, "accepted": 3, "seconds": 1.0,
         "drafted_per_position": [3, 2, 1], "accepted_per_position": [2, 1, 0]}
    b = {"strategy": "s", "new_tokens": 2, "verify_steps": 1, "drafted": 1, "accepted": 1, "seconds": 1.0,
         "drafted_per_position": [1], "accepted_per_position": [1]}
    m = merge_turn_stats([a, b])
    assert m["new_tokens"] == 8 and m["tau"] == 2.0 and m["accept_rate"] == 4 / 7 and m["turns"] == 2
    assert m["drafted_per_position"] == [4, 2, 1] and m["accept_rate_per_position"] == [0.75, 0.5, 0.0]
    assert m["tokens_per_s"] == 4.0


class _Echo(Method):
    """Answers every prompt with its last two ids; records the calls it gets."""

    def __init__(self, name: str, calls: list):
        super().__init__(name)
        self.calls = calls

    def generate(self, ids, max_new_tokens):
        self.calls.append((self.name, len(ids), max_new_tokens))
        new = list(ids[-2:])
        return new, {"new_tokens": len(new), "verify_steps": len(new), "drafted": 0, "accepted": 0,
                     "drafted_per_position": [], "accepted_per_position": []}


def test_run_eval_interleaves_warms_up_and_feeds_answers_back() -> None:
    m = make_tiny("llama")
    renderer = Renderer(m.tokenizer, chat=False)
    items = [PromptItem("a", "x", ("one two",)), PromptItem("b", "y", ("three", "four five")),
             PromptItem("c", "x", ("six",))]
    calls: list = []
    methods = [_Echo(n, calls) for n in ("m1", "m2", "m3")]
    streamed: list = []
    records = run_eval(methods, items, renderer, max_new_tokens=20, device=torch.device("cpu"),
                       on_record=lambda rec, i, n: streamed.append((rec["method"], rec["prompt_id"], i, n)))
    # one untimed warm-up call per method (16 tokens at most), then the rotating order per prompt
    assert [c[0] for c in calls[:3]] == ["m1", "m2", "m3"] and all(c[2] == 16 for c in calls[:3])
    assert [(r["method"], r["prompt_id"]) for r in records] == [
        ("m1", "a"), ("m2", "a"), ("m3", "a"), ("m2", "b"), ("m3", "b"), ("m1", "b"), ("m3", "c"), ("m1", "c"), ("m2", "c")]
    assert streamed == [(r["method"], r["prompt_id"], i // 3, 3) for i, r in enumerate(records)]
    two = next(r for r in records if r["prompt_id"] == "b")
    assert two["stats"]["turns"] == 2 and len(two["turn_texts"]) == 2 and two["prompt_lens"][1] > two["prompt_lens"][0]
    assert two["stats"]["seconds"] > 0 and two["stats"]["peak_memory_mb"] > 0
    with pytest.raises(SelfSpecError, match="no prompts selected"):
        run_eval(methods, [], renderer, 8, torch.device("cpu"))


def test_build_methods_checks_and_options() -> None:
    from selfspec.evaluation.config import HFOptions

    m = make_tiny("llama", head="lens", exit_layer=2)
    greedy = DecodeConfig(draft_len=3, max_new_tokens=8)
    methods = build_methods(["hf_early_exit", "hf_prompt_lookup", "autoregressive", "selfspec"], m, greedy, head=m.head,
                            hf_options=HFOptions(num_assistant_tokens=3, prompt_lookup_num_tokens=4))
    assert [x.name for x in methods] == ["hf_early_exit", "hf_prompt_lookup", "autoregressive", "selfspec"]
    assert methods[0].hf.kwargs == {"assistant_early_exit": 2, "num_assistant_tokens": 3}
    assert methods[1].hf.kwargs == {"prompt_lookup_num_tokens": 4}
    # the method `selfspec` is the decode strategy `selfspec` with the head
    assert methods[2].cfg.strategy == "autoregressive" and methods[3].cfg.strategy == "selfspec"
    ids = m.encode("hello there", chat=False)
    ref, _ = methods[2].generate(ids, 8)
    for method in methods:
        new, stats = method.generate(ids, 8)
        assert new == ref and stats["new_tokens"] == len(new)
    with pytest.raises(SelfSpecError, match="methods: unknown"):
        build_methods(["beam"], m, greedy)
    with pytest.raises(SelfSpecError, match="selfspec needs a head"):
        build_methods(["selfspec"], m, greedy)
    with pytest.raises(SelfSpecError, match="hf_generate: HF's methods decode greedily"):
        build_methods(["hf_generate", "autoregressive"], m, DecodeConfig(temperature=0.7))


def test_lookup_methods() -> None:
    """`lookup` drafts from the context alone (no head), `selfspec+lookup` adds lookup branches to the head's
    drafts (decode.tree as configured); both are lossless."""
    m = make_tiny("llama", head="lens", exit_layer=2)
    cfg = DecodeConfig(draft_len=3, max_new_tokens=12, tree="dynamic", tree_nodes=6)
    methods = build_methods(["autoregressive", "lookup", "selfspec+lookup"], m, cfg, head=m.head)
    assert methods[1].decoder.head is None and methods[1].cfg.lookup and methods[1].cfg.tree == "chain"
    assert methods[2].decoder.head is m.head and methods[2].cfg.lookup and methods[2].cfg.tree == "dynamic"
    ids = m.encode("hello there hello there hello", chat=False)
    ref, _ = methods[0].generate(ids, 12)
    for method in methods[1:]:
        new, stats = method.generate(ids, 12)
        assert new == ref and stats["lookup"] is True and stats["drafted_lookup"] >= 0
    with pytest.raises(SelfSpecError, match="methods: selfspec\\+lookup needs a head"):
        build_methods(["selfspec+lookup"], m, cfg)
    # dynamic K is a chain feature: lookup's rounds run without decode.draft_threshold (test_method_variants.py)
    assert build_methods(["lookup"], m, DecodeConfig(draft_threshold=0.5))[0].cfg.draft_threshold is None
