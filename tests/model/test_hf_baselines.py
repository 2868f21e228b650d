"""selfspec.model.hf_baselines: HF's own greedy decoding paths, with the target's forward passes counted."""

from __future__ import annotations

from conftest import make_tiny
from selfspec.model.hf_baselines import HFGenerate, early_exit_kwargs, hf_round_stats, prompt_lookup_kwargs


def test_hf_round_stats_from_target_calls() -> None:
    # plain generate: prefill (P=5) then one call per token
    st = hf_round_stats([(0, 5), (5, 1), (6, 1)], prompt_len=5, new_tokens=3)
    assert st == {"verify_steps": 3, "drafted": 0, "accepted": 0, "drafted_per_position": [],
                  "accepted_per_position": []}
    # assisted, P=5: prefill + 2 drafts, both accepted (the next round starts at the 8th token, position 7);
    # then 3 drafts, 1 accepted (next start 9); then 2 drafts of which the 7th new token (EOS) leaves 1.
    st = hf_round_stats([(0, 7), (7, 4), (9, 3)], prompt_len=5, new_tokens=7)
    assert st["drafted_per_position"] == [3, 3, 1] and st["accepted_per_position"] == [3, 1, 0]
    assert st["verify_steps"] == 3 and st["accepted"] == 4


def test_generate_kwargs() -> None:
    assert early_exit_kwargs(4) == {"assistant_early_exit": 4}
    assert early_exit_kwargs(4, 6) == {"assistant_early_exit": 4, "num_assistant_tokens": 6}
    assert prompt_lookup_kwargs() == {"prompt_lookup_num_tokens": 10}
    assert prompt_lookup_kwargs(4, 3) == {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}


def test_hf_generate_counts_the_target_calls_and_matches_our_engine() -> None:
    m = make_tiny("llama")
    ids = m.encode("hello there, how", chat=False)
    ours = m.generate(ids, max_new_tokens=10, strategy="autoregressive").token_ids
    plain = HFGenerate(m.hf_model, m.tokenizer, m.eos_ids)
    new, st = plain.generate(ids, 10)
    assert new == ours
    assert st["new_tokens"] == len(new) and st["prompt_tokens"] == len(ids) and st["seconds"] > 0
    assert st["verify_steps"] == len(new) and st["drafted"] == 0  # prefill + one pass per further token
    early = HFGenerate(m.hf_model, m.tokenizer, m.eos_ids, early_exit_kwargs(2, 3))
    new, st = early.generate(ids, 10)
    assert new == ours  # greedy assisted generation is lossless
    assert st["verify_steps"] < len(new) + 1 and st["drafted"] > 0 and 0 <= st["accepted"] <= st["drafted"]
    assert m.hf_model.config.num_hidden_layers == 6  # HF's assistant put the depth back
