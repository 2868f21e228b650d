"""python -m selfspec.eval (selfspec/cli/eval.py) on tiny random models: methods, lossless, multi-turn, outputs,
sweeps, config errors.

The Hydra apps run in subprocesses (Hydra owns the process: working dir, logging, sys.argv). The parts are
tested in-process where they live: tests/evaluation/ (runner, prompt sets, head cache, step costs, reports,
plots, sweeps), tests/model/test_hf_baselines.py (HF's calls), tests/test_timing.py (the harness).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.errors import SelfSpecError

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
                    "prompts.limit=1", "prompts.per_category=true", "prompts.categories=[writing,qa]", "save_prompts=true",
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
def test_multirun_fixed_and_auto_draft_len(tmp_path: Path) -> None:
    proc = run_app(["-m", *TINY, "head=medusa", "head.exit_layer=2", "decode.draft_len=2", "auto.enabled=false,true",
                    "methods=[autoregressive,selfspec]", "prompts.limit=1", "decode.max_new_tokens=8", "warmup=false",
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
    proc = run_app([*TINY, "prompts=spec_bench", f"prompts.path={bad}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: prompts.path=") and "line 2" in lines[0] and "not valid JSON" in lines[0]


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("eval", overrides=list(overrides))


def test_eval_config_is_typed() -> None:
    from selfspec.cli.eval import eval_config

    e = eval_config(_compose("auto.enabled=true", "head_cache.trainer.max_steps=30", "head_cache.data.num_prompts=16",
                             "hf.prompt_lookup_num_tokens=4"))
    assert e.auto.enabled is True and e.auto.draft_lens == list(range(1, 9))
    assert e.head_cache.trainer.max_steps == 30 and e.head_cache.data.num_prompts == 16  # training's typed configs
    assert e.head_cache.trainer.lr == 1e-3 and e.head_cache.data.source == "selfgen"  # conf/trainer, conf/data defaults
    assert e.hf.prompt_lookup_num_tokens == 4 and e.reference_method == "hf_generate"
    with pytest.raises(SelfSpecError, match="reference='nope': not among methods"):
        eval_config(_compose("reference=nope"))
    with pytest.raises(SelfSpecError, match=r"auto.draft_lens=\[0\]"):
        eval_config(_compose("auto.draft_lens=[0]"))
    with pytest.raises(SelfSpecError, match="head_cache.trainer.max_steps=0"):
        eval_config(_compose("head_cache.trainer.max_steps=0"))


def test_old_spellings_say_where_the_key_went() -> None:
    """`data=` (now training's group only) and `decode.draft_len=auto` (now auto.enabled=true) fail with one line."""
    from selfspec.cli.eval import decode_config_for_eval, eval_config

    with pytest.raises(SelfSpecError, match=r"^data: evaluation reads prompts=builtin\|spec_bench\|jsonl"):
        eval_config(_compose("+data=spec_bench"))
    with pytest.raises(SelfSpecError, match=r"^decode.draft_len=auto: a calibrated K is auto.enabled=true"):
        decode_config_for_eval(_compose("decode.draft_len=auto").decode)
    assert decode_config_for_eval(_compose("decode.draft_len=6").decode).draft_len == 6


def test_the_chain_cost_model_is_reported_only_where_it_applies() -> None:
    """The summary's predicted speedup models K exit-head drafts per round, one pass each: not trees, rounds that
    context lookup drafts (lookup first) or several drafts per pass."""
    from selfspec.decoding.config import DecodeConfig
    from selfspec.cli.eval import chain_model_applies

    assert chain_model_applies(DecodeConfig()) and chain_model_applies(DecodeConfig(draft_threshold=0.6))
    for kw in (dict(tree="dynamic"), dict(lookup=True), dict(lookup=True, lookup_mode="first"), dict(tokens_per_pass=2)):
        assert not chain_model_applies(DecodeConfig(**kw)), kw


def test_the_run_writes_a_result_record_with_the_machine_the_code_and_intervals(eval_run: Path) -> None:
    from selfspec.evaluation.record import SCHEMA, check_record
    from selfspec.utils.machine import cpu_identity

    rec = json.loads((eval_run / "record.json").read_text())
    check_record(rec, "record.json")
    assert rec["schema"] == SCHEMA and rec["reference"] == "hf_generate"
    assert rec["machine"]["cpu"] == cpu_identity()  # the model name and number, the flags, the cores
    assert rec["machine"]["software"]["torch"] and rec["machine"]["threads"]["policy"] == "auto"
    commit = rec["code"]["commit"]
    assert commit is None or (len(commit) == 40 and isinstance(rec["code"]["dirty"], bool))
    assert rec["command"]["argv"][:3] == ["python", "-m", "selfspec.eval"] and "head=lens" in rec["command"]["overrides"]
    assert rec["prompts"]["count"] == 2 and len(rec["prompts"]["sha256"]) == 64
    assert rec["model"]["name"] == "tiny" and rec["model"]["layers"] == 4
    summary = json.loads((eval_run / "summary.json").read_text())
    for name, m in rec["methods"].items():
        assert m["speedup"] == summary["methods"][name]["speedup"] and m["tau"] == summary["methods"][name]["tau"]
        assert "draft_mb" in m and "lossless" in m
    sel = rec["methods"]["selfspec"]
    lo, hi = sel["speedup_ci95"]
    assert lo <= sel["speedup"] <= hi  # two prompts: a real interval around the point estimate
    assert rec["methods"]["hf_generate"]["speedup_ci95"] is None  # the reference itself
    assert rec["methods"]["selfspec"]["head"]["type"] == "lens" and rec["methods"]["autoregressive"]["head"] is None
    assert "95% interval" in (eval_run / "summary.md").read_text()
