"""selfspec.evaluation.calibration: E and K (auto.enabled), decode.tree=auto (calibrate_tree), and auto's resolution
in the config, the engine, the API and python -m selfspec.eval, on tiny random models. Timings use one repeat: the
tests check what is measured and how the choice follows from it, not the speed of this machine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import make_tiny
from selfspec.data import PromptItem
from selfspec.decoding.config import DecodeConfig, with_tuned_settings
from selfspec.decoding.engine import Decoder
from selfspec.errors import SelfSpecError
from selfspec.evaluation.calibration import (
    calibrate,
    calibrate_tree,
    choose,
    head_rows,
    tree_candidates,
    tree_speedup,
)

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Write a short story about a ship at sea"]
UNRESOLVED = r"^decode.tree=auto: not resolved; calibration chooses the tree \(python -m selfspec.eval decode.tree=auto"


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama", head="lens", exit_layer=2)


def _ids(m):
    return [m.encode(p) for p in PROMPTS]


def _ar(m, ids, n):
    return Decoder(m.backbone).decode(ids, DecodeConfig(strategy="autoregressive", max_new_tokens=n)).token_ids


# ------------------------------------------------------------------------------------------------ decode.tree=auto
def test_calibrate_tree_measures_every_candidate_and_predicts_by_the_formula(tiny):
    auto = DecodeConfig(tree="auto", draft_len=3, tree_topk=2, max_new_tokens=64)
    cal = calibrate_tree(tiny, tiny.head, _ids(tiny), auto, [2, 6], static=True, max_new_tokens=12, repeats=1)
    assert [r["name"] for r in cal.table] == ["chain", "dynamic/2", "dynamic/6", "static/[2, 2, 1, 1]"]
    assert [r["rows"] for r in cal.table] == [4, 3, 7, 15]
    for r in cal.table:
        assert r["tau"] >= 1.0 and r["draft_passes"] > 0 and r["draft_cost"] > 0 and r["verify_cost"] > 0
        assert r["predicted"] == pytest.approx(r["tau"] / (r["draft_passes"] * r["draft_cost"] + r["verify_cost"]))
    best = cal.table[choose(cal.table)]
    assert cal.name == best["name"] and cal.predicted_speedup == best["predicted"]
    assert cal.context == int(sum(map(len, _ids(tiny))) / 2)  # the prompts' mean length
    assert cal.settings == ({"tree": "dynamic", "tree_nodes": best["tree_nodes"]} if best["tree"] == "dynamic"
                            else {"tree": best["tree"]})
    data = json.loads(json.dumps(cal.to_dict()))  # plain JSON-able data
    assert data["name"] == cal.name and len(data["table"]) == 4
    # the choice decodes, losslessly
    cfg = replace(auto, **cal.settings, max_new_tokens=12)
    for ids in _ids(tiny):
        assert Decoder(tiny.backbone, tiny.head).decode(ids, cfg).token_ids == _ar(tiny, ids, 12)


def test_the_choice_follows_the_costs(tiny):
    """With injected costs the choice is deterministic: a flat verify cost lets the tree that accepts the most win;
    a verify cost that grows steeply with rows leaves the chain (the fewest rows) best."""
    auto = DecodeConfig(tree="auto", draft_len=4, tree_topk=4, max_new_tokens=64)
    seen = []

    def flat(cfg, rows):
        seen.append((cfg.tree, cfg.tree_nodes if cfg.tree == "dynamic" else None, rows))
        return 0.0, 1.0

    cal = calibrate_tree(tiny, tiny.head, _ids(tiny), auto, [8, 16], max_new_tokens=16, costs=flat)
    assert seen == [("chain", None, 5), ("dynamic", 8, 9), ("dynamic", 16, 17)] and cal.context is None
    taus = {r["name"]: r["tau"] for r in cal.table}
    assert [r["predicted"] for r in cal.table] == [r["tau"] for r in cal.table]
    assert taus["dynamic/16"] > 1.01 * taus["chain"]  # this fixture's wide tree accepts more than its chain
    assert cal.name == cal.table[choose(cal.table)]["name"] and cal.settings["tree"] == "dynamic"
    assert taus[cal.name] >= 0.99 * max(taus.values())

    steep = calibrate_tree(tiny, tiny.head, _ids(tiny), auto, [8, 16], max_new_tokens=16,
                           costs=lambda cfg, rows: (0.1, float(rows) ** 3))
    # tau <= depth + 1 = 5: the chain predicts >= 1 / (0.4 + 125), an 8-node tree <= 5 / (0.4 + 729)
    assert steep.settings == {"tree": "chain"} and steep.name == "chain"


def test_choose_prefers_the_smaller_tree_on_a_tie():
    rows = [{"predicted": 1.0, "rows": 5}, {"predicted": 1.2, "rows": 17}, {"predicted": 1.195, "rows": 9}]
    assert choose(rows) == 2  # within 1% of the best: the 9-row tree
    assert choose(rows, tie=0.0) == 1
    assert choose([{"predicted": 1.0, "rows": 9}, {"predicted": 1.0, "rows": 5}]) == 1
    assert tree_speedup(2.0, 3.0, 0.25, 1.25) == pytest.approx(1.0)
    with pytest.raises(SelfSpecError, match="no candidates"):
        choose([])


def test_candidates_and_their_rows():
    cands = tree_candidates(DecodeConfig(tree="auto", draft_len=3, tree_shape=[3, 2]), [16, 4, 4], static=True)
    assert [n for n, _ in cands] == ["chain", "dynamic/4", "dynamic/16", "static/[3, 2]"]
    assert [head_rows(c) for _, c in cands] == [4, 5, 17, 10]
    assert all(c.draft_len == 3 and c.draft_threshold is None and c.tree != "auto" for _, c in cands)
    with pytest.raises(SelfSpecError, match=r"^auto.tree_nodes=\[0\]: must be a non-empty list of integers >= 1"):
        tree_candidates(DecodeConfig(), [0])


# ------------------------------------------------------------------------------------------------ auto elsewhere
def test_decode_config_takes_auto_and_refuses_bad_values():
    cfg = DecodeConfig(tree="auto", draft_len=3, tree_shape=[2, 2, 1, 1, 1])
    assert cfg.uses_tree and cfg.tree_depth(head=True) == 5 and cfg.tree_depth(head=False) == 0
    assert cfg.tree_slots() >= max(replace(cfg, tree=t).tree_slots() for t in ("chain", "static", "dynamic"))
    with pytest.raises(SelfSpecError, match=r"^decode.tree='bushy': allowed chain, static, dynamic, auto$"):
        DecodeConfig(tree="bushy")
    with pytest.raises(SelfSpecError, match=r"^decode.draft_threshold=0.5: not supported with decode.tree=auto"):
        DecodeConfig(tree="auto", draft_threshold=0.5)
    # a head's tuned dynamic K is dropped beside auto, as beside any tree
    tuned, taken = with_tuned_settings(DecodeConfig(tree="auto"), {"draft_len": 3, "draft_threshold": 0.6}, {"tree"})
    assert tuned.tree == "auto" and tuned.draft_threshold is None and taken == ["draft_len"]


def test_engine_and_api_refuse_an_unresolved_auto(tiny):
    ids = _ids(tiny)[0]
    with pytest.raises(SelfSpecError, match=UNRESOLVED):
        Decoder(tiny.backbone, tiny.head).decode(ids, DecodeConfig(tree="auto", max_new_tokens=4))
    with pytest.raises(SelfSpecError, match=UNRESOLVED):
        tiny.generate(ids, max_new_tokens=4, tree="auto")
    # the autoregressive baseline has no tree to choose
    assert tiny.generate(ids, max_new_tokens=4, tree="auto", strategy="autoregressive").token_ids == _ar(tiny, ids, 4)


def test_api_auto_takes_the_heads_tuned_tree():
    m = make_tiny("llama", head="lens", exit_layer=2)
    m.head.decode_settings = {"tree": "dynamic", "tree_nodes": 5, "draft_len": 3}
    ids = _ids(m)[0]
    out = m.generate(ids, max_new_tokens=10, tree="auto")
    assert out.decode.tree == "dynamic" and out.decode.tree_nodes == 5 and "tree" in out.tuned_from_head
    assert out.token_ids == _ar(m, ids, 10)
    m.head.decode_settings = {"tree": "auto"}  # a head that carries no concrete tree resolves nothing
    with pytest.raises(SelfSpecError, match=UNRESOLVED):
        m.generate(ids, max_new_tokens=4, tree="auto")


def test_auto_config_tree_keys():
    from selfspec.evaluation.config import AutoConfig

    a = AutoConfig(tree_nodes=[16, 4, 4])
    assert a.tree_nodes == [4, 16] and a.tree_static is False and a.repeats == 5
    with pytest.raises(SelfSpecError, match=r"^auto.tree_nodes=\[0\]: must be a non-empty list of integers >= 1"):
        AutoConfig(tree_nodes=[0])
    with pytest.raises(SelfSpecError, match=r"^auto.tree_nodes=\[2000\]: at most 1024"):
        AutoConfig(tree_nodes=[2000])
    with pytest.raises(SelfSpecError, match=r"^auto.tree_static='yes': allowed true or false"):
        AutoConfig(tree_static="yes")
    with pytest.raises(SelfSpecError, match=r"^auto.repeats=0: must be an integer >= 1"):
        AutoConfig(repeats=0)


def test_eval_resolves_auto_to_a_concrete_tree_and_stays_lossless(tiny):
    """selfspec.eval's path (resolve_auto_tree): the calibration prompts' first turns, a concrete tree, the table."""
    from selfspec.cli.eval import resolve_auto_tree
    from selfspec.evaluation.config import EvalConfig
    from selfspec.evaluation.runner import Renderer

    ecfg = EvalConfig(methods=["autoregressive", "selfspec"],
                      auto={"tree_nodes": [3, 6], "prompts": 1, "max_new_tokens": 8, "repeats": 1})
    items = [PromptItem("a", "qa", (PROMPTS[0], "and then?")), PromptItem("b", "qa", (PROMPTS[1],))]
    renderer = Renderer(tiny.tokenizer, chat=False)
    dcfg, info = resolve_auto_tree(ecfg, tiny, tiny.head, DecodeConfig(tree="auto", max_new_tokens=12), items, renderer)
    assert dcfg.tree in ("chain", "dynamic") and info["tree"] == dcfg.tree
    assert [r["name"] for r in info["table"]] == ["chain", "dynamic/3", "dynamic/6"]
    assert info["context"] == len(renderer.render(items[0].turns, [])[0])  # one calibration prompt: its first turn
    if dcfg.tree == "dynamic":
        assert dcfg.tree_nodes == info["tree_nodes"]
    for item in items:
        ids = renderer.render(item.turns, [])[0]
        assert Decoder(tiny.backbone, tiny.head).decode(ids, dcfg).token_ids == _ar(tiny, ids, 12)


def test_eval_cli_tree_auto(tmp_path: Path):
    from test_eval import TINY, run_app

    out = tmp_path / "run"
    proc = run_app([*TINY, "head=lens", "head.exit_layer=2", "decode.tree=auto", "auto.tree_nodes=[2,4]",
                    "auto.prompts=1", "auto.max_new_tokens=8", "auto.repeats=1", "methods=[autoregressive,selfspec]",
                    "decode.max_new_tokens=10", "prompts.limit=2", "warmup=false", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    run = summary["run"]["tree_auto"]
    assert run["tree"] in ("chain", "dynamic") and [r["name"] for r in run["table"]] == ["chain", "dynamic/2", "dynamic/4"]
    assert summary["methods"]["selfspec"]["lossless"] == 1.0
    assert "- decode.tree=auto: `" + run["name"] + "`" in (out / "summary.md").read_text()


# ------------------------------------------------------------------------------------------------ auto.enabled
def test_calibrate_picks_e_and_k_among_the_candidates():
    from selfspec.heads import HeadConfig, build_head

    m = make_tiny("llama", head="medusa", exit_layer=2)
    heads = {2: m.head, 1: build_head(HeadConfig(type="lens", exit_layer=1), m.backbone)}
    cal = calibrate(m, heads, _ids(m), [1, 3], max_new_tokens=8, repeats=1)
    assert cal.exit_layer in (1, 2) and cal.draft_len in (1, 3) and set(cal.table) == {1, 2}
    row = cal.table[cal.exit_layer]
    assert set(row["verify_cost"]) == {1, 3} and cal.predicted_speedup == max(
        s for r in cal.table.values() for s in r["predicted"].values())
    with pytest.raises(SelfSpecError, match="no calibration prompts"):
        calibrate(m, heads, [], [1], max_new_tokens=8)
