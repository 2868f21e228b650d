"""selfspec.evaluation.costs: step costs for every head type, their tables, and the tool's config."""

from __future__ import annotations

import pytest

from conftest import make_tiny
from selfspec.errors import SelfSpecError


def test_step_costs_for_every_head_type() -> None:
    from selfspec.evaluation.costs import build_cost_heads, costs_markdown, measure_costs

    m = make_tiny("llama")
    heads = build_cost_heads(m, ["lora", "lens", "medusa", "adapter"], [1, 3])
    assert list(heads) == ["lens", "medusa", "adapter", "lora"]  # LoRA last: it changes the model
    costs = measure_costs(m.backbone, heads, [1, 3], [1, 2], context=16, repeats=1, warmup=0)
    for name in heads:
        assert set(costs["draft"][name]) == {1, 3} and all(v > 0 for v in costs["draft"][name].values())
    assert set(costs["verify"]) == {1, 2} and set(costs["verify_reuse"]) == {1, 3}
    assert costs["ar_step_s"] > 0
    md = costs_markdown(costs)
    assert "| lora |" in md and "reuse E=3" in md
    with pytest.raises(SelfSpecError, match="out of range"):
        measure_costs(m.backbone, heads, [7], [1], context=8, repeats=1)  # E up to L=6 (the whole stack)


def test_costs_markdown_tables() -> None:
    from selfspec.evaluation.costs import costs_markdown

    costs = {"ar_step_s": 0.037, "context": 200, "num_layers": 30, "device": "cpu", "dtype": "float32", "repeats": 5,
             "draft": {"lens": {4: 0.2, 8: 0.31}, "lora": {4: 0.25}},
             "verify": {1: 1.1, 4: 1.34}, "verify_reuse": {4: {1: 1.05, 4: 1.3}, 8: {1: 1.0, 4: 1.2}}}
    lines = costs_markdown(costs).splitlines()
    assert "| head | E=4 | E=8 |" in lines and "|---|---:|---:|" in lines
    assert "| lens | 0.200 | 0.310 |" in lines and "| lora | 0.250 | - |" in lines
    assert "| K | full stack | reuse E=4 | reuse E=8 |" in lines and "|---:|---:|---:|---:|" in lines
    assert "| 4 | 1.340 | 1.300 | 1.200 |" in lines


def test_costs_config_refuses_bad_values() -> None:
    from hydra import compose, initialize_config_dir

    from selfspec.utils.config import build
    from selfspec.evaluation.costs import CostsConfig
    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("costs", overrides=["costs.repeats=3", "costs.draft_vocab=64"])
    c = build(CostsConfig, cfg.costs, "costs")
    assert (c.repeats, c.draft_vocab, c.exit_layers) == (3, 64, [4, 8, 12])
    with pytest.raises(SelfSpecError, match=r"costs.draft_lens=\[0\]: must be a non-empty list of integers >= 1"):
        CostsConfig(draft_lens=[0])
    with pytest.raises(SelfSpecError, match="costs.repeats=0"):
        CostsConfig(repeats=0)
    with pytest.raises(SelfSpecError, match="costs: unknown key"):
        build(CostsConfig, {"contxt": 5}, "costs")


def test_costs_cli_has_its_own_config(tmp_path) -> None:
    """`python -m selfspec.cli.costs` composes conf/costs.yaml (not the evaluation's config)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SELFSPEC_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "selfspec.cli.costs", "model=tiny", "costs.repeats=1",
                           "costs.context=8", "costs.exit_layers=[1,2]", "costs.draft_lens=[1]", "costs.head_types=[lens]",
                           f"hydra.run.dir={out}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    costs = json.loads((out / "costs.json").read_text())
    assert set(costs["draft"]["lens"]) == {"1", "2"} and costs["context"] == 8 and costs["model"] == "tiny"
    assert "| lens |" in (out / "costs.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "selfspec.cli.costs", "model=tiny", "costs.repeats=0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: costs.repeats=0: must be an integer >= 1"]


def test_the_step_timer_times_the_engines_own_steps(monkeypatch):
    """The cost tool calls the engine's own chain verify (verify.Draft.verify) and the drafter's draft_logits (no
    re-implementation of the steps)."""
    from conftest import make_tiny
    from selfspec.decoding import drafters, verify as verify_mod
    from selfspec.evaluation.costs import StepTimer

    calls = {"verify": 0, "draft": 0}
    verify, draft = verify_mod.Draft.verify, drafters.EarlyExitDrafter.draft_logits

    def counting_verify(d, bb, state):
        calls["verify"] += 1
        out = verify(d, bb, state)
        assert out.shape[0] == len(d.tokens) + 1  # K+1 rows, one step's work
        return out

    def counting_draft(self, state, pos):
        calls["draft"] += 1
        assert self.early == pos - 1  # exactly one new position through layers < E
        return draft(self, state, pos)

    monkeypatch.setattr(verify_mod.Draft, "verify", counting_verify)
    monkeypatch.setattr(drafters.EarlyExitDrafter, "draft_logits", counting_draft)
    m = make_tiny("llama", head="medusa", exit_layer=2)
    timer = StepTimer(m.backbone, context=16, max_draft_len=4, repeats=2, warmup=1)
    assert timer.ratio(timer.draft_step(m.head, 2)) > 0 and calls["draft"] == 3
    assert timer.ratio(timer.verify_step(4, reuse_exit_layer=2)) > 0
    assert calls["verify"] >= 3 + 3 * 2  # the paired autoregressive steps are engine verifies too
