"""A saved head carries the decode settings it was tuned with; the API and the CLI use them unless told otherwise."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny
from selfspec.decoding.config import DecodeConfig, user_set_keys, with_tuned_settings
from selfspec.errors import SelfSpecError
from selfspec.heads import load_head, save_head


def _saved(tmp_path, decode: dict):
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    path = save_head(m.head, tmp_path / "head", m.backbone, extra={"decode": decode})
    return m, path


def test_the_api_uses_the_heads_settings_unless_given(tmp_path):
    m, path = _saved(tmp_path, {"draft_len": 2, "draft_threshold": 0.5})
    m.set_head(str(path))
    assert m.head.decode_settings == {"draft_len": 2, "draft_threshold": 0.5}
    out = m.generate("The quick brown fox", max_new_tokens=8)
    assert (out.decode.draft_len, out.decode.draft_threshold) == (2, 0.5)
    assert out.tuned_from_head == ["draft_len", "draft_threshold"]
    assert out.stats["draft_len"] == 2
    mine = m.generate("The quick brown fox", max_new_tokens=8, draft_len=3, draft_threshold=0)
    assert (mine.decode.draft_len, mine.decode.draft_threshold, mine.tuned_from_head) == (3, 0, [])
    # an untrained head (no saved settings) keeps DecodeConfig's defaults
    m.set_head("medusa", exit_layer=2)
    assert m.generate("The quick brown fox", max_new_tokens=4).decode.draft_len == DecodeConfig().draft_len


def test_bad_saved_settings_are_one_line(tmp_path):
    m, path = _saved(tmp_path, {"draft_len": 0})
    with pytest.raises(SelfSpecError, match="'decode' block.*decode.draft_len"):
        load_head(path, m.backbone)
    cfg = json.loads((path / "head_config.json").read_text())
    cfg["decode"] = "fast"
    (path / "head_config.json").write_text(json.dumps(cfg))
    with pytest.raises(SelfSpecError, match="'decode' must be a mapping"):
        load_head(path, m.backbone)


def test_command_line_keys_win_and_trees_drop_dynamic_k():
    tuned = {"draft_len": 5, "draft_threshold": 0.6}
    assert user_set_keys(["decode.draft_len=3", "+decode.lookup=true", "head.path=X", "model=tiny"]) == {"draft_len", "lookup"}
    cfg, used = with_tuned_settings(DecodeConfig(draft_len=3), tuned, {"draft_len"})
    assert (cfg.draft_len, cfg.draft_threshold, used) == (3, 0.6, ["draft_threshold"])
    cfg, used = with_tuned_settings(DecodeConfig(tree="dynamic"), tuned, {"tree"})
    assert (cfg.draft_len, cfg.draft_threshold) == (5, None)  # a tree does not combine with dynamic K
    cfg, used = with_tuned_settings(DecodeConfig(strategy="autoregressive"), tuned, set())
    assert used == [] and cfg.draft_threshold is None
