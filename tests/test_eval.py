"""python -m selfspec.eval on tiny random models: methods, lossless, multi-turn, outputs, sweeps, errors.

The Hydra apps run in subprocesses (Hydra owns the process: working dir, logging, sys.argv). Everything else
(accounting of HF's calls, stats merging, data selection, the head cache, step costs, the sweep report) is
tested in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from conftest import make_tiny
from selfspec.errors import SelfSpecError

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHOD_KEYS = {"tokens_per_s", "speedup", "tau", "accept_rate", "accept_rate_per_position", "lossless",
               "peak_memory_mb", "head_params"}
# A wide init makes every layer matter (see conftest): drafts are then partly rejected.
TINY = ["model=tiny", "+model.random_init.initializer_range=0.3", "logger=none", "head_cache.train_missing=false"]


def run_app(args: list[str], cwd: Path, module: str = "selfspec.eval", timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "SELFSPEC_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path


# ------------------------------------------------------------------------------------------------ one real run
@pytest.fixture(scope="module")
def eval_run(tmp_path_factory) -> Path:
    """All five methods on two builtin prompts (one of them 2-turn)."""
    tmp = tmp_path_factory.mktemp("eval")
    out = tmp / "run"
    proc = run_app([*TINY, "head=lens", "head.exit_layer=2", "decode.draft_len=3", "decode.max_new_tokens=12",
                    "data.limit=1", "data.per_category=true", "data.categories=[writing,qa]", "save_prompts=true",
                    f"hydra.run.dir={out}"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_summary_has_every_key_and_lossless(eval_run: Path) -> None:
    summary = json.loads((eval_run / "summary.json").read_text())
    assert {"methods", "per_category", "config"} <= set(summary)
    methods = summary["methods"]
    assert list(methods) == ["hf_generate", "hf_early_exit", "hf_prompt_lookup", "autoregressive", "selfspec"]
    for name, m in methods.items():
        assert METHOD_KEYS <= set(m), (name, METHOD_KEYS - set(m))
        assert m["tokens_per_s"] > 0 and m["peak_memory_mb"] > 0
    assert methods["selfspec"]["lossless"] == 1.0
    assert methods["autoregressive"]["lossless"] == 1.0
    assert methods["hf_generate"]["speedup"] == 1.0
    assert methods["selfspec"]["tau"] >= 1.0 and methods["autoregressive"]["tau"] == 1.0
    assert 0 <= methods["selfspec"]["accept_rate"] <= 1 and len(methods["selfspec"]["accept_rate_per_position"]) == 3
    assert set(summary["per_category"]) == {"writing", "qa"}
    assert summary["config"]["decode"]["draft_len"] == 3
    result = json.loads((eval_run / "result.json").read_text())
    assert result["exit_layer"] == 2 and result["draft_len"] == 3 and result["eval/tau"] == methods["selfspec"]["tau"]
    assert result["eval/speedup"] == methods["selfspec"]["speedup"] and result["eval/predicted_speedup"] > 0
    assert "| `selfspec` |" in (eval_run / "summary.md").read_text()
    for png in ("acceptance_by_position.png", "speedup_by_category.png"):
        _png(eval_run / png)


def test_results_lines_and_multi_turn(eval_run: Path) -> None:
    records = [json.loads(line) for line in (eval_run / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 5
    assert {"method", "prompt_id", "category", "token_ids", "text", "stats"} <= set(records[0])
    by_method = {}
    for r in records:
        if r["category"] == "writing":
            by_method[r["method"]] = r
    assert len(by_method) == 5
    for r in by_method.values():
        first, second = r["turn_texts"]
        assert r["stats"]["turns"] == 2 and len(r["turn_new_tokens"]) == 2
        assert len(r["token_ids"]) == sum(r["turn_new_tokens"]) == r["stats"]["new_tokens"]
        # The second prompt carries the model's own first answer as an assistant message.
        assert "<|assistant|>" + first in r["prompts"][1] and r["prompts"][1].startswith(r["prompts"][0][:-len("<|assistant|>")])
        assert r["prompt_lens"][1] > r["prompt_lens"][0]
    ref = by_method["hf_generate"]["token_ids"]
    assert by_method["selfspec"]["token_ids"] == ref and by_method["autoregressive"]["token_ids"] == ref


# ------------------------------------------------------------------------------------------------ sweeps
def _fake_job(sweep: Path, name: str, result: dict | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    if result is not None:
        (job / "result.json").write_text(json.dumps(result))


def test_sweep_report_on_fake_multirun(tmp_path: Path) -> None:
    from selfspec.evaluation.sweep import EvalSweepCallback

    sweep = tmp_path / "multirun"
    n = 0
    for E in (2, 4):
        for K in (1, 2, 4):
            s = 0.8 + 0.1 * K - 0.05 * E
            _fake_job(sweep, str(n), {"status": "ok", "head": "lens", "head_source": "untrained", "exit_layer": E,
                                      "draft_len": K, "eval/speedup": s, "eval/predicted_speedup": s * 1.1,
                                      "eval/tau": 1 + K * 0.3, "eval/accept_rate": 0.5})
            n += 1
    _fake_job(sweep, str(n), {"status": "failed", "error": "RuntimeError: boom"})
    _fake_job(sweep, str(n + 1), None)  # killed before writing anything
    config = SimpleNamespace(hydra=SimpleNamespace(sweep=SimpleNamespace(dir=str(sweep))))
    EvalSweepCallback().on_multirun_end(config)
    md = (sweep / "sweep.md").read_text()
    assert "**Best: E=2, K=4**" in md and "predicted" in md
    assert md.count("| 2 | 4 |") == 1 and md.count("| `lens (untrained)` |") == 6
    assert "## Failed jobs" in md and "RuntimeError: boom" in md and "no result.json" in md
    _png(sweep / "heatmap_speedup.png")
    _png(sweep / "heatmap_tau.png")


def test_multirun_fixed_and_auto_draft_len(tmp_path: Path) -> None:
    proc = run_app(["-m", *TINY, "head=medusa", "head.exit_layer=2", "decode.draft_len=2,auto",
                    "methods=[autoregressive,selfspec]", "data.limit=1", "decode.max_new_tokens=8", "warmup=false",
                    "auto.prompts=1", "auto.max_new_tokens=8", "auto.draft_lens=[1,2,3]", "auto.exit_layers=[1,2]",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    fixed, auto = (json.loads((sweep / j / "result.json").read_text()) for j in ("0", "1"))
    assert fixed["draft_len"] == 2 and fixed["exit_layer"] == 2 and fixed["eval/lossless"] == 1.0
    assert auto["draft_len"] in (1, 2, 3) and auto["exit_layer"] in (1, 2) and auto["eval/lossless"] == 1.0
    run = json.loads((sweep / "1" / "summary.json").read_text())["run"]["auto"]
    assert set(run["table"]) == {"1", "2"} and run["draft_len"] == auto["draft_len"]
    assert "| 2 | 2 |" in (sweep / "sweep.md").read_text()
    _png(sweep / "heatmap_speedup.png")


# ------------------------------------------------------------------------------------------------ errors
def test_broken_spec_bench_line_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "question.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]}\n'
                   '{"question_id": 2, "category": "qa", "turns": ["half a record"\n')
    proc = run_app([*TINY, "data=spec_bench", f"data.path={bad}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: data.path=") and "line 2" in lines[0] and "not valid JSON" in lines[0]


def test_data_path_required_for_spec_bench(tmp_path: Path) -> None:
    from selfspec.eval import load_items

    with pytest.raises(SelfSpecError, match="data.path: required"):
        load_items(OmegaConf.load(ROOT / "conf" / "data" / "spec_bench.yaml"))


# ------------------------------------------------------------------------------------------------ data
def test_load_items_selection(tmp_path: Path) -> None:
    from selfspec.eval import load_items

    items = load_items({"path": None, "limit": 2, "per_category": True})
    cats = [it.category for it in items]
    assert len(items) == 12 and all(cats.count(c) == 2 for c in set(cats))
    assert len(load_items({"limit": 3})) == 3
    assert {it.category for it in load_items({"categories": ["qa", "rag"]})} == {"qa", "rag"}
    with pytest.raises(SelfSpecError, match="data.categories"):
        load_items({"categories": ["nope"]})

    f = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": ["a?", "b?"] if c == "writing" else ["a?"]}
            for i, c in enumerate(["writing", "roleplay", "qa", "qa", "writing"])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Spec-Bench's MT-bench categories become one task; unknown keys (a training data file's) are ignored.
    items = load_items({"path": str(f), "limit": 1, "per_category": True, "spec_bench_tasks": True, "text_key": "x"})
    assert [(it.category, len(it.turns)) for it in items] == [("mt_bench", 2), ("qa", 1)]


def test_data_jsonl_from_the_shared_data_group(tmp_path: Path) -> None:
    """`data=jsonl data.path=FILE` (the training's conf/data/jsonl.yaml) works for evaluation too."""
    if not (ROOT / "conf" / "data" / "jsonl.yaml").is_file():
        pytest.skip("conf/data/jsonl.yaml (owned by training) is not there yet")
    from hydra import compose, initialize_config_dir

    from selfspec.eval import load_items

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hello there", "category": "a"}\n{"prompt": "Bye", "category": "b"}\n')
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=["data=jsonl", f"data.path={f}", "data.limit=1"])
        assert [it.turns for it in load_items(cfg.data)] == [("Hello there",)]
        # the eval-only keys exist for every data file, so they need no `+`
        cfg = compose("eval", overrides=["data=jsonl", f"data.path={f}", "data.categories=[b]"])
        assert [it.turns for it in load_items(cfg.data)] == [("Bye",)]
        assert compose("eval").data.per_category is False


# ------------------------------------------------------------------------------------------------ accounting
def test_hf_round_stats_from_target_calls() -> None:
    from selfspec.evaluation.runner import hf_round_stats

    # plain generate: prefill (P=5) then one call per token
    st = hf_round_stats([(0, 5), (5, 1), (6, 1)], prompt_len=5, new_tokens=3)
    assert st == {"verify_steps": 3, "drafted": 0, "accepted": 0, "drafted_per_position": [],
                  "accepted_per_position": []}
    # assisted, P=5: prefill + 2 drafts, both accepted (the next round starts at the 8th token, position 7);
    # then 3 drafts, 1 accepted (next start 9); then 2 drafts of which the 7th new token (EOS) leaves 1.
    st = hf_round_stats([(0, 7), (7, 4), (9, 3)], prompt_len=5, new_tokens=7)
    assert st["drafted_per_position"] == [3, 3, 1] and st["accepted_per_position"] == [3, 1, 0]
    assert st["verify_steps"] == 3 and st["accepted"] == 4


def test_merge_turn_stats_sums_and_recomputes() -> None:
    from selfspec.evaluation.runner import merge_turn_stats

    a = {"strategy": "s", "new_tokens": 6, "verify_steps": 3, "drafted": 6, "accepted": 3, "seconds": 1.0,
         "drafted_per_position": [3, 2, 1], "accepted_per_position": [2, 1, 0]}
    b = {"strategy": "s", "new_tokens": 2, "verify_steps": 1, "drafted": 1, "accepted": 1, "seconds": 1.0,
         "drafted_per_position": [1], "accepted_per_position": [1]}
    m = merge_turn_stats([a, b])
    assert m["new_tokens"] == 8 and m["tau"] == 2.0 and m["accept_rate"] == 4 / 7 and m["turns"] == 2
    assert m["drafted_per_position"] == [4, 2, 1] and m["accept_rate_per_position"] == [0.75, 0.5, 0.0]
    assert m["tokens_per_s"] == 4.0


def test_cost_ratios_from_engine_stats() -> None:
    from selfspec.evaluation.report import cost_ratios

    records = [
        {"method": "autoregressive", "stats": {"verify_s": 1.0, "verify_steps": 10, "seconds": 1.0}},
        {"method": "selfspec", "stats": {"draft_s": 0.2, "drafted": 8, "verify_s": 0.6, "verify_steps": 4}},
    ]
    c = cost_ratios(records)
    assert c["draft_cost"] == pytest.approx(0.25) and c["verify_cost"] == pytest.approx(1.5)
    assert cost_ratios(records[:1]) is None
    # with dynamic K the head also runs for drafts it then declines: c is per exit-head pass
    records[1]["stats"]["draft_steps"] = 10
    assert cost_ratios(records)["draft_cost"] == pytest.approx(0.2)


# ------------------------------------------------------------------------------------------------ heads, costs
def test_head_cache_trains_once_per_exit_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from selfspec.evaluation import head_cache
    from selfspec.heads import HeadConfig, build_head, save_head

    m = make_tiny("llama")
    trained: list[int] = []

    def fake_train_head(cfg, run_dir) -> Path:
        trained.append(cfg["exit_layer"])
        head = build_head(HeadConfig(type="medusa", exit_layer=cfg["exit_layer"]), m.backbone)
        return save_head(head, tmp_path / f"trained-{len(trained)}", m.backbone)

    monkeypatch.setattr(head_cache, "_trainer", lambda: fake_train_head)
    monkeypatch.setattr(head_cache, "train_config", lambda node, hcfg, E, ov: {"exit_layer": E})
    root = tmp_path / "heads"
    cfg = HeadConfig(type="medusa")
    kw = dict(model_name="tiny", root=root)
    assert head_cache.resolve_head(m, cfg, exit_layer=2, **kw)[1] == "trained"
    head, source = head_cache.resolve_head(m, cfg, exit_layer=2, **kw)
    assert source == "cache" and head.exit_layer == 2 and trained == [2]
    assert head_cache.resolve_head(m, cfg, exit_layer=3, **kw)[1] == "trained" and trained == [2, 3]
    assert list(head_cache.cached_exit_layers(root, "tiny", m.backbone, cfg)) == [2, 3]
    # other sizes are another head: not found in the cache
    assert head_cache.cached_exit_layers(root, "tiny", m.backbone, HeadConfig(type="medusa", num_blocks=2)) == {}
    # without a trainer: the untrained head, said so
    monkeypatch.setattr(head_cache, "_trainer", lambda: None)
    assert head_cache.resolve_head(m, cfg, exit_layer=4, **kw)[1] == "untrained"
    # a saved head must exit where head.exit_layer says
    path = str(head_cache.cached_exit_layers(root, "tiny", m.backbone, cfg)[2])
    assert head_cache.resolve_head(m, HeadConfig(path=path, exit_layer=2), **kw)[1] == "path"
    with pytest.raises(SelfSpecError, match="exits at layer 2"):
        head_cache.resolve_head(m, HeadConfig(path=path, exit_layer=3), **kw)


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
        measure_costs(m.backbone, heads, [6], [1], context=8, repeats=1)
