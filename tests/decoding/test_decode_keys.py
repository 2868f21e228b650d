"""The decode keys are defined once (DecodeConfig's fields and their metadata), and every place that takes them
(api.generate, eval method variants, a saved head's "decode" block) takes exactly those; pooled stats are one pool."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from conftest import make_tiny
from selfspec.decoding.config import (DECODE_KEYS, LOOKUP_KEYS, TUNED_KEYS, VARIANT_KEYS, DecodeConfig, tuned_settings)
from selfspec.decoding.stats import DecodeStats, pool_stats
from selfspec.errors import SelfSpecError
from selfspec.evaluation.report import summarize_methods
from selfspec.evaluation.runner import VARIANT_METHODS, method_decode_config, parse_method
from selfspec.heads import load_head, resolve_exit_layer, save_head
from selfspec.heads.base import check_exit_layer

# One valid value off the default for every key a head may be tuned with (each valid on its own).
TUNED_SAMPLES = {"draft_len": 2, "draft_threshold": 0.3, "draft_continue": 0.5, "tree": "dynamic", "tree_nodes": 8, "tree_topk": 2,
                 "tree_shape": [2, 1], "lookup": True, "lookup_mode": "first", "lookup_len": 2, "tokens_per_pass": 2,
                 "lookup_min_ngram": 3, "lookup_max_ngram": 4}


def test_the_key_sets_come_from_the_fields():
    assert DECODE_KEYS == tuple(f.name for f in fields(DecodeConfig))
    assert set(TUNED_SAMPLES) == set(TUNED_KEYS)  # a new tuned key needs a sample here
    assert set(TUNED_KEYS) <= set(VARIANT_KEYS) and set(LOOKUP_KEYS) <= set(VARIANT_KEYS)
    assert VARIANT_METHODS["lookup"] == LOOKUP_KEYS
    assert "lookup" not in VARIANT_METHODS["selfspec+lookup"]  # the method fixes it
    for k, v in TUNED_SAMPLES.items():
        assert getattr(DecodeConfig(), k) != v and getattr(DecodeConfig(**{k: v}), k) == v


def test_every_tuned_key_is_a_generate_argument_and_an_eval_variant():
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, num_heads=2)
    ids = list(range(5, 17))
    for k, v in TUNED_SAMPLES.items():
        out = m.generate(ids, max_new_tokens=3, **{k: v})
        assert getattr(out.decode, k) == v and k not in out.tuned_from_head
        spec = parse_method(f"selfspec:{k}={json.dumps(v)}")
        assert spec.settings == {k: v}
        assert getattr(method_decode_config(spec, DecodeConfig(max_new_tokens=3)), k) == v
    with pytest.raises(TypeError, match="unexpected keyword argument 'draft_length'"):
        m.generate(ids, draft_length=2)


def test_tuned_settings_survive_a_save_and_load(tmp_path):
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, num_heads=2)
    trees = DecodeConfig(draft_len=3, tree="dynamic", tree_nodes=8, tree_topk=2, tree_shape=[2, 1], lookup=True,
                         lookup_len=2)
    chains = DecodeConfig(draft_len=3, draft_threshold=0.4, draft_continue=0.5, lookup=True, lookup_mode="first",
                          tokens_per_pass=2)
    recorded = set()
    for i, cfg in enumerate((trees, chains)):
        block = tuned_settings(cfg)
        recorded |= set(block)
        path = save_head(m.head, tmp_path / f"head{i}", m.backbone, extra={"decode": block})
        assert load_head(path, m.backbone).decode_settings == block
    assert recorded == set(TUNED_KEYS)
    assert tuned_settings(DecodeConfig()) == {"draft_len": 4, "draft_threshold": None}


def test_for_call_checks_only_the_call_keys():
    cfg = DecodeConfig(draft_len=3, temperature=0.5, seed=1)
    assert cfg.for_call(cfg.max_new_tokens) is cfg
    call = cfg.for_call(7, seed=9)
    assert (call.max_new_tokens, call.seed) == (7, 9) and replace(call, max_new_tokens=128, seed=1) == cfg
    for bad, match in ((dict(max_new_tokens=0), "decode.max_new_tokens=0: must be an integer >= 1"),
                       (dict(seed=1.5), "decode.seed=1.5: must be an integer or null")):
        with pytest.raises(SelfSpecError, match=match):
            cfg.for_call(**bad)
        with pytest.raises(SelfSpecError, match=match):
            replace(cfg, **bad)


def test_pooled_stats_are_one_pool():
    a = DecodeStats(strategy="selfspec", exit_layer=2, draft_len=2, new_tokens=6, verify_steps=3, drafted=5,
                    draft_steps=5, accepted=3, drafted_per_position=[3, 2], accepted_per_position=[2, 1],
                    draft_s=0.5, verify_s=1.0, seconds=2.0)
    b = DecodeStats(strategy="selfspec", exit_layer=2, draft_len=3, new_tokens=4, verify_steps=1, drafted=3,
                    draft_steps=3, accepted=3, drafted_per_position=[1, 1, 1], accepted_per_position=[1, 1, 1],
                    draft_s=0.25, verify_s=0.25, seconds=0.5)
    # by hand: 10 tokens in 4 steps, 6 of 8 drafts accepted, per position 3/4, 2/3, 1/1, 10 tokens in 2.5 s
    hand = {"new_tokens": 10, "verify_steps": 4, "tau": 2.5, "drafted": 8, "accepted": 6, "accept_rate": 0.75,
            "drafted_per_position": [4, 3, 1], "accepted_per_position": [3, 2, 1],
            "accept_rate_per_position": [0.75, 2 / 3, 1.0], "seconds": 2.5, "tokens_per_s": 4.0}
    pooled = pool_stats([a.to_dict(), b.to_dict()])
    assert {k: pooled[k] for k in hand} == hand
    merged = DecodeStats.merge([a, b.to_dict()]).to_dict()
    assert {k: merged[k] for k in hand} == hand and merged["draft_len"] == 3
    records = [{"method": "selfspec", "prompt_id": p, "category": "c", "token_ids": [1] * s.new_tokens,
                "stats": s.to_dict()} for p, s in (("p1", a), ("p2", b))]
    summary = summarize_methods(records, reference="selfspec")["methods"]["selfspec"]
    for k in ("tau", "accept_rate", "accept_rate_per_position", "tokens_per_s", "new_tokens"):
        assert summary[k] == hand[k]
    empty = {"new_tokens": 0, "verify_steps": 0, "drafted": 0, "accepted": 0, "seconds": 0.0}
    assert (pool_stats([empty])["tau"], pool_stats([empty], empty=None)["tau"]) == (0.0, None)


def test_one_exit_layer_default_and_check():
    assert resolve_exit_layer(None, 10) == 2 and resolve_exit_layer(None, 3) == 1 and resolve_exit_layer(7, 10) == 7
    with pytest.raises(SelfSpecError, match=r"^head.exit_layer=0: must be an integer in \[1, 10\]"):
        resolve_exit_layer(0, 10)
    check_exit_layer(0, 10, minimum=0)  # the embeddings, for a head type that allows them
    with pytest.raises(SelfSpecError, match=r"^heads: 'lens@11': exit layer 11 out of range; allowed 0\.\.10"):
        check_exit_layer(11, 10, minimum=0, entry="lens@11")


def test_the_decode_yamls_mirror_decode_config():
    """conf/decode/greedy.yaml is the decode group's default and spells out DecodeConfig's own defaults, key for key;
    every other conf/decode/*.yaml builds on it and sets only DecodeConfig's keys."""
    import dataclasses
    from pathlib import Path

    import yaml

    conf = Path(__file__).resolve().parents[2] / "conf" / "decode"
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    greedy = yaml.safe_load((conf / "greedy.yaml").read_text())
    assert set(greedy) == fields
    default = DecodeConfig()
    for key, value in greedy.items():
        mine = getattr(default, key)
        assert (list(mine) if isinstance(mine, tuple) else mine) == value, key
    for path in sorted(conf.glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text())) - {"defaults"}
        assert keys <= fields, f"{path.name}: {keys - fields}"
        assert DecodeConfig(**{**greedy, **{k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}})
